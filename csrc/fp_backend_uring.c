/* io_uring backend (liburing). The engine's buffers are registered as fixed
 * buffers when the kernel allows it, which saves pinning pages per request. */
#define _GNU_SOURCE
#include <errno.h>
#include <stdlib.h>
#include <sys/uio.h>
#include <unistd.h>

#include <liburing.h>

#include "fp_engine_internal.h"

struct uring_state {
    struct io_uring ring;
    int fixed; /* buffers registered */
};

static int uring_init(struct fp_engine *e)
{
    struct uring_state *s = calloc(1, sizeof(*s));
    if (!s)
        return -ENOMEM;
    int rc = io_uring_queue_init((unsigned)e->cfg.queue_depth, &s->ring, 0);
    if (rc < 0) { /* -EPERM when disabled by sysctl or seccomp, -ENOSYS when absent */
        free(s);
        return rc;
    }
    int nb = e->cfg.num_buffers;
    struct iovec *iov = calloc((size_t)nb, sizeof(*iov));
    if (iov) {
        for (int i = 0; i < nb; i++) {
            iov[i].iov_base = fp_engine_buffer(e, i);
            iov[i].iov_len = e->cfg.buffer_size;
        }
        s->fixed = io_uring_register_buffers(&s->ring, iov, (unsigned)nb) == 0;
        free(iov);
    }
    e->backend_state = s;
    return 0;
}

static void uring_fini(struct fp_engine *e)
{
    struct uring_state *s = e->backend_state;
    if (!s)
        return;
    io_uring_queue_exit(&s->ring); /* also unregisters the buffers */
    free(s);
    e->backend_state = NULL;
}

static void uring_fini_forked(struct fp_engine *e)
{
    struct uring_state *s = e->backend_state;
    if (!s)
        return;
    close(s->ring.ring_fd); /* this process's descriptor; the ring stays the parent's */
    free(s);
    e->backend_state = NULL;
}

static int uring_queue(struct fp_engine *e, struct fp_request *r)
{
    struct uring_state *s = e->backend_state;
    struct io_uring_sqe *sqe = io_uring_get_sqe(&s->ring);
    if (!sqe) {
        int rc = io_uring_submit(&s->ring);
        if (rc < 0)
            return rc;
        sqe = io_uring_get_sqe(&s->ring);
        if (!sqe)
            return -EBUSY;
    }
    if (s->fixed && r->buf_index >= 0) {
        if (r->is_write)
            io_uring_prep_write_fixed(sqe, r->fd, r->buf, (unsigned)r->len, r->off, r->buf_index);
        else
            io_uring_prep_read_fixed(sqe, r->fd, r->buf, (unsigned)r->len, r->off, r->buf_index);
    } else if (r->is_write) {
        io_uring_prep_write(sqe, r->fd, r->buf, (unsigned)r->len, r->off);
    } else {
        io_uring_prep_read(sqe, r->fd, r->buf, (unsigned)r->len, r->off);
    }
    io_uring_sqe_set_data(sqe, r);
    return 0;
}

static int uring_submit(struct fp_engine *e)
{
    struct uring_state *s = e->backend_state;
    int rc = (int)fp__inject(e, FP_SITE_SUBMIT, 0);
    if (rc == 0)
        rc = io_uring_submit(&s->ring);
    return rc < 0 ? rc : 0; /* unsubmitted entries stay in the ring for the next try */
}

static int uring_reap(struct fp_engine *e, int min_nr)
{
    struct uring_state *s = e->backend_state;
    struct io_uring_cqe *cqe;
    int reaped = 0;
    if (min_nr > 0) {
        int rc = io_uring_wait_cqe(&s->ring, &cqe);
        if (rc < 0)
            return rc;
    }
    while (io_uring_peek_cqe(&s->ring, &cqe) == 0) {
        struct fp_request *r = io_uring_cqe_get_data(cqe);
        int64_t res = cqe->res;
        io_uring_cqe_seen(&s->ring, cqe);
        fp__complete(e, r, res);
        reaped++;
    }
    return reaped; /* retries queued by fp__complete are submitted by the core */
}

static int uring_unsubmitted(const struct fp_engine *e)
{
    const struct uring_state *s = e->backend_state;
    return (int)io_uring_sq_ready(&s->ring);
}

const struct fp_backend fp_backend_uring = {
    "io_uring", uring_init, uring_fini, uring_fini_forked, uring_queue, uring_submit, uring_reap,
    uring_unsubmitted,
};
