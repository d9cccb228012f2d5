/* Shared between the engine core (fp_engine.c) and its backends. */
#ifndef FP_ENGINE_INTERNAL_H
#define FP_ENGINE_INTERNAL_H

#include <sys/types.h>

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
    int retries;    /* EAGAIN/EINTR completions in a row */
};

struct fp_backend {
    const char *name;
    int (*init)(struct fp_engine *e);
    void (*fini)(struct fp_engine *e);
    /* Frees what a forked child owns of the backend state, touching nothing
     * shared with the parent (no waiting, no teardown of the kernel object). */
    void (*fini_forked)(struct fp_engine *e);
    /* Queues one request; may submit earlier ones to make room. */
    int (*queue)(struct fp_engine *e, struct fp_request *r);
    /* Hands queued requests to the kernel. -EAGAIN, -EBUSY or -EINTR: some
     * are still queued, try again after reaping; other errors are final. */
    int (*submit)(struct fp_engine *e);
    /* Waits for at least min_nr completions (0: only those ready) and
     * reports each with fp__complete(). Returns the number reaped or -errno. */
    int (*reap)(struct fp_engine *e, int min_nr);
    /* Requests queued but not handed to the kernel yet. */
    int (*unsubmitted)(const struct fp_engine *e);
};

/* Test-only fault injection (FASTPERSIST_FAULT_INJECT, see fp_engine.h). */
enum fp_fault_site {
    FP_SITE_WRITE, FP_SITE_READ, FP_SITE_SUBMIT, FP_SITE_MLOCK, FP_SITE_URING_SETUP, FP_SITE_AIO_SETUP, FP_SITES
};
#define FP_FAULT_SHORT 1 /* result: a transfer that moved half its bytes */
#define FP_MAX_FAULTS 8

struct fp_fault {
    int site;
    long nth;
    int and_later;
    int result;  /* -errno or FP_FAULT_SHORT */
};

struct fp_engine {
    struct fp_config cfg;
    unsigned generation;    /* fork_generation where the engine was created: another is a forked child */
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
    int failed;             /* an operation failed: never used again */
    int cannot_submit;      /* a submission failed for good: queued requests never reach the kernel */
    int cannot_reap;        /* waiting for completions failed: nothing more can be reaped */

    struct fp_fault faults[FP_MAX_FAULTS];
    int num_faults;
    long fault_events[FP_SITES];

    /* write stream */
    int stream_active;
    size_t reserved; /* bytes handed out by fp_stream_reserve, not yet committed */
    int direct_fd, buffered_fd;
    int direct;
    uint64_t pos;           /* file offset of the next byte */
    int cur;                /* buffer being filled */
    uint64_t cur_base;      /* file offset of byte 0 of the current buffer */
    size_t cur_start, cur_fill; /* queued up to cur_start, filled up to cur_fill */
    uint64_t prealloc_step; /* 0: not the only writer, or fallocate refused */
    uint64_t alloc_end;     /* the file's size as extended by fallocate */
    int sole_writer;        /* the stream owns the whole file: cut it to size at the end */

    /* pread */
    uint64_t read_eof;      /* lowest offset where a read hit end of file */

    /* pull read stream (fp_read_begin) */
    int read_active;
    uint64_t r_lo, r_hi;    /* the range asked for */
    uint64_t r_next, r_stop; /* aligned: the next chunk's start, the end of the last */
    size_t r_issued, r_handed, r_released; /* chunks queued / handed over / given back */
    uint64_t r_start[FP_MAX_NUM_BUFFERS], r_end[FP_MAX_NUM_BUFFERS]; /* the chunk in each buffer */
};

void fp__complete(struct fp_engine *e, struct fp_request *r, int64_t res);
/* Fails a request the kernel never took: records err, frees the slot. */
void fp__fail(struct fp_engine *e, struct fp_request *r, int err);
/* The result of the next event at `site`: `res`, unless a fault rule says otherwise. */
int64_t fp__inject(struct fp_engine *e, int site, int64_t res);
int fp__request_index(const struct fp_engine *e, const struct fp_request *r);

extern const struct fp_backend fp_backend_psync;
#ifdef FP_HAVE_LIBAIO
extern const struct fp_backend fp_backend_aio;
#endif
#ifdef FP_HAVE_LIBURING
extern const struct fp_backend fp_backend_uring;
#endif

#endif
