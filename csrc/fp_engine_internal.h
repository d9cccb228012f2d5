/* Shared between the engine core (fp_engine.c) and its backends. */
#ifndef FP_ENGINE_INTERNAL_H
#define FP_ENGINE_INTERNAL_H

#include "fp_engine.h"

#define FP_ALIGN 4096u

struct fp_request {
    int fd;
    int is_write;
    int is_direct;  /* issued on the O_DIRECT descriptor */
    int buf_index;  /* engine buffer the bytes live in, or -1 */
    char *buf;
    size_t len;     /* bytes still to transfer, starting at buf/off */
    uint64_t off;
};

struct fp_backend {
    const char *name;
    int (*init)(struct fp_engine *e);
    void (*fini)(struct fp_engine *e);
    /* Queues one request; may submit earlier ones to make room. */
    int (*queue)(struct fp_engine *e, struct fp_request *r);
    /* Hands queued requests to the kernel. */
    int (*submit)(struct fp_engine *e);
    /* Waits for at least min_nr completions (0: only those ready) and
     * reports each with fp__complete(). Returns the number reaped or -errno. */
    int (*reap)(struct fp_engine *e, int min_nr);
};

struct fp_engine {
    struct fp_config cfg;
    const struct fp_backend *backend;
    void *backend_state;

    char *region;           /* all buffers, one mapping */
    size_t region_size;
    int locked;
    int lock_errno;

    struct fp_request *requests; /* queue_depth slots */
    int *free_slots;
    int num_free;
    int in_flight;
    int *buf_pending;       /* requests in flight per buffer */

    int error;              /* first -errno of the current operation */
    const char *error_op;
    uint64_t error_offset;

    /* write stream */
    int stream_active;
    int direct_fd, buffered_fd;
    int direct;
    uint64_t pos;           /* file offset of the next byte */
    int cur;                /* buffer being filled */
    uint64_t cur_base;      /* file offset of byte 0 of the current buffer */
    size_t cur_start, cur_fill;
    uint64_t prealloc_step; /* 0: not the only writer, or fallocate refused */
    uint64_t alloc_end;     /* the file's size as extended by fallocate */
    int sole_writer;        /* the stream owns the whole file: cut it to size at the end */

    /* pread */
    uint64_t read_eof;      /* lowest offset where a read hit end of file */
};

void fp__complete(struct fp_engine *e, struct fp_request *r, int64_t res);
int fp__request_index(const struct fp_engine *e, const struct fp_request *r);

extern const struct fp_backend fp_backend_psync;
#ifdef FP_HAVE_LIBAIO
extern const struct fp_backend fp_backend_aio;
#endif
#ifdef FP_HAVE_LIBURING
extern const struct fp_backend fp_backend_uring;
#endif

#endif
