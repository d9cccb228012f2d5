/* Portable backend: each request is a synchronous pwrite/pread, finished
 * before queue() returns. Works wherever POSIX does. */
#define _GNU_SOURCE
#include <errno.h>
#include <unistd.h>

#include "fp_engine_internal.h"

static int psync_init(struct fp_engine *e) { (void)e; return 0; }
static void psync_fini(struct fp_engine *e) { (void)e; }

static int psync_queue(struct fp_engine *e, struct fp_request *r)
{
    ssize_t n = r->is_write ? pwrite(r->fd, r->buf, r->len, (off_t)r->off)
                            : pread(r->fd, r->buf, r->len, (off_t)r->off);
    fp__complete(e, r, n < 0 ? -errno : (int64_t)n);
    return 0;
}

/* Nothing to submit; the fault site still counts, so tests treat every engine alike. */
static int psync_submit(struct fp_engine *e) { return (int)fp__inject(e, FP_SITE_SUBMIT, 0); }
static int psync_reap(struct fp_engine *e, int min_nr) { (void)e; (void)min_nr; return 0; }

static int psync_unsubmitted(const struct fp_engine *e) { (void)e; return 0; }

const struct fp_backend fp_backend_psync = {
    "psync", psync_init, psync_fini, psync_fini, psync_queue, psync_submit, psync_reap, psync_unsubmitted,
};
