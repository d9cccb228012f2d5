/* Linux native AIO backend (libaio). One iocb per request slot; queued
 * iocbs are handed to io_submit in batches. */
#define _GNU_SOURCE
#include <errno.h>
#include <stdlib.h>
#include <string.h>

#include <libaio.h>

#include "fp_engine_internal.h"

struct aio_state {
    io_context_t ctx;
    struct iocb *iocbs;     /* one per request slot */
    struct iocb **pending;  /* queued, not yet submitted */
    int num_pending;
    struct io_event *events;
};

static int aio_init(struct fp_engine *e)
{
    int qd = e->cfg.queue_depth;
    struct aio_state *s = calloc(1, sizeof(*s));
    if (!s)
        return -ENOMEM;
    s->iocbs = calloc((size_t)qd, sizeof(*s->iocbs));
    s->pending = calloc((size_t)qd, sizeof(*s->pending));
    s->events = calloc((size_t)qd, sizeof(*s->events));
    int rc = (s->iocbs && s->pending && s->events) ? io_setup(qd, &s->ctx) : -ENOMEM;
    if (rc < 0) {
        free(s->iocbs);
        free(s->pending);
        free(s->events);
        free(s);
        return rc;
    }
    e->backend_state = s;
    return 0;
}

/* The AIO context is not inherited by a forked child: only memory to free. */
static void aio_fini_forked(struct fp_engine *e)
{
    struct aio_state *s = e->backend_state;
    if (!s)
        return;
    free(s->iocbs);
    free(s->pending);
    free(s->events);
    free(s);
    e->backend_state = NULL;
}

static void aio_fini(struct fp_engine *e)
{
    struct aio_state *s = e->backend_state;
    if (!s)
        return;
    io_destroy(s->ctx); /* waits for, or cancels, requests still in flight */
    aio_fini_forked(e);
}

static int aio_submit(struct fp_engine *e)
{
    struct aio_state *s = e->backend_state;
    while (s->num_pending > 0) {
        int rc = (int)fp__inject(e, FP_SITE_SUBMIT, 0);
        if (rc == 0)
            rc = io_submit(s->ctx, s->num_pending, s->pending);
        if (rc == -EAGAIN || rc == -EBUSY || rc == -EINTR)
            return rc; /* the core reaps completions, then tries again */
        if (rc < 0) {
            /* The kernel took none of them: fail them so nobody waits. */
            int failed = s->num_pending;
            s->num_pending = 0;
            for (int i = 0; i < failed; i++)
                fp__fail(e, s->pending[i]->data, rc);
            return rc;
        }
        s->num_pending -= rc;
        memmove(s->pending, s->pending + rc, (size_t)s->num_pending * sizeof(*s->pending));
    }
    return 0;
}

static int aio_queue(struct fp_engine *e, struct fp_request *r)
{
    struct aio_state *s = e->backend_state;
    struct iocb *cb = &s->iocbs[fp__request_index(e, r)];
    if (r->is_write)
        io_prep_pwrite(cb, r->fd, r->buf, r->len, (long long)r->off);
    else
        io_prep_pread(cb, r->fd, r->buf, r->len, (long long)r->off);
    cb->data = r;
    s->pending[s->num_pending++] = cb;
    return 0;
}

static int aio_reap(struct fp_engine *e, int min_nr)
{
    struct aio_state *s = e->backend_state;
    int rc;
    do {
        rc = io_getevents(s->ctx, min_nr, e->cfg.queue_depth, s->events, NULL);
    } while (rc == -EINTR);
    if (rc < 0)
        return rc;
    for (int i = 0; i < rc; i++) {
        struct fp_request *r = s->events[i].data;
        /* res is unsigned long: negative errno comes back as a huge value */
        int64_t res = (int64_t)(long)s->events[i].res;
        fp__complete(e, r, res);
    }
    return rc; /* retries queued by fp__complete are submitted by the core */
}

static int aio_unsubmitted(const struct fp_engine *e)
{
    const struct aio_state *s = e->backend_state;
    return s->num_pending;
}

const struct fp_backend fp_backend_aio = {
    "libaio", aio_init, aio_fini, aio_fini_forked, aio_queue, aio_submit, aio_reap, aio_unsubmitted,
};
