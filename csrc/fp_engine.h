/*
 * fastpersist I/O engine: asynchronous, offset-based file I/O through
 * page-aligned, page-locked buffers, with io_uring, libaio or plain
 * pwrite/pread underneath.
 *
 * The engine knows nothing of Python or torch. Every function that can fail
 * returns 0 (or a count) on success and -errno on failure; it never exits.
 * Details of the first failure (operation, file offset) are kept in the
 * engine and can be read with fp_last_error_op()/fp_last_error_offset().
 *
 * Errors that every operation may return besides those of the I/O itself:
 *   -ECHILD           the engine was created by another process: after fork()
 *                     its ring, AIO context and buffers belong to the parent
 *                     (the buffers are not even mapped in the child), so the
 *                     child must create engines of its own.
 *   -ENOTRECOVERABLE  an earlier operation failed; a failed engine is never
 *                     reused (its in-flight accounting may not be trustworthy).
 *
 * Test-only fault injection: FASTPERSIST_FAULT_INJECT, read once by
 * fp_engine_create, is a comma-separated list of SITE:N:RESULT rules. The
 * N-th event at SITE in that engine (N+ : the N-th and every later one)
 * gets RESULT, an errno name (EIO, ENOSPC, EAGAIN, EINTR, EPERM, ENOMEM,
 * ENOSYS, EINVAL, EBUSY, EBADF) or "short" (a transfer that moved half its
 * bytes). Sites: write and read (request completions), submit (handing
 * requests to the kernel), mlock, io_uring_setup and libaio_setup (the
 * backend's start in fp_engine_create; N is 1), and open (not used by the
 * engine: reserved for the caller that opens the files). A malformed list
 * makes fp_engine_create fail with -EINVAL.
 */
#ifndef FP_ENGINE_H
#define FP_ENGINE_H

#include <stddef.h>
#include <stdint.h>

enum fp_engine_kind {
    FP_ENGINE_PSYNC = 0, /* portable: synchronous pwrite/pread */
    FP_ENGINE_AIO = 1,   /* Linux native AIO through libaio */
    FP_ENGINE_URING = 2, /* io_uring through liburing */
};

/* Bounds of struct fp_config. I/O lengths and results are 32-bit in
 * io_uring, and num_buffers sizes arrays on the stack. */
enum {
    FP_MAX_BUFFER_SIZE = 1073741824,  /* 1 GiB */
    FP_MAX_REQUEST_SIZE = 1073741824, /* 1 GiB */
    FP_MAX_NUM_BUFFERS = 64,
    FP_MAX_QUEUE_DEPTH = 4096,
};

struct fp_config {
    int kind;              /* enum fp_engine_kind */
    size_t buffer_size;    /* bytes per bounce buffer, multiple of 4096 */
    int num_buffers;       /* 2..FP_MAX_NUM_BUFFERS: one is filled while the others are in flight */
    int queue_depth;       /* requests in flight at most, 1..FP_MAX_QUEUE_DEPTH */
    size_t request_size;   /* bytes per I/O request, multiple of 4096 */
    int lock_memory;       /* try mlock() on the buffers */
};

struct fp_engine;

/* 1 if support for `kind` was compiled in. */
int fp_kind_compiled(int kind);

/* Creates an engine. Fails with -EINVAL for a configuration out of bounds,
 * with -EPERM/-ENOSYS etc. when the kernel refuses the backend (io_uring
 * disabled, seccomp), so callers can fall back. */
int fp_engine_create(const struct fp_config *cfg, struct fp_engine **out);
/* Waits for requests in flight and frees everything. In a process other
 * than the creator (after fork) it only frees what that process owns. */
void fp_engine_destroy(struct fp_engine *e);

/* 0 while the engine can be used; otherwise -ECHILD (created by another
 * process) or -ENOTRECOVERABLE (an operation failed). */
int fp_engine_usable(const struct fp_engine *e);

int fp_engine_kind(const struct fp_engine *e);
/* 1 if the buffers are locked in memory, 0 if mlock was refused or not asked. */
int fp_engine_memory_locked(const struct fp_engine *e);
/* errno of the refused mlock, 0 if none. */
int fp_engine_lock_errno(const struct fp_engine *e);
/* NULL for a bad index, or in a process other than the creator. */
void *fp_engine_buffer(const struct fp_engine *e, int index);
size_t fp_engine_buffer_size(const struct fp_engine *e);
int fp_engine_num_buffers(const struct fp_engine *e);

/* Operation and file offset of the first failure. */
const char *fp_last_error_op(const struct fp_engine *e);
uint64_t fp_last_error_offset(const struct fp_engine *e);

/*
 * Sequential write stream starting at `offset`. Bytes are copied into the
 * engine's buffers and written asynchronously. Whole aligned blocks go to
 * `direct_fd` (opened with O_DIRECT), the unaligned head and tail to
 * `buffered_fd`, so several streams may fill disjoint ranges of one file.
 * Pass direct_fd = -1 to write everything through buffered_fd.
 * If the O_DIRECT fd refuses a write with EINVAL, the stream switches to
 * buffered_fd for the rest (fp_stream_direct() then returns 0).
 * One stream per engine at a time.
 *
 * prealloc_step > 0 declares the stream the file's only writer: the file is
 * extended with fallocate() that many bytes ahead of the writes and cut to
 * its exact end by fp_stream_end(). Writes inside the file's size let ext4
 * and xfs run O_DIRECT writes concurrently instead of one extending write
 * at a time (about 1.4x here). Refused fallocate() just turns this off.
 */
int fp_stream_begin(struct fp_engine *e, int direct_fd, int buffered_fd, uint64_t offset,
                    uint64_t prealloc_step);
/* Appends n bytes from src. If crc is not NULL, *crc is updated with the
 * CRC-32 (zip/zlib polynomial) of the bytes. */
int fp_stream_write(struct fp_engine *e, const void *src, size_t n, uint32_t *crc);
/* Appends n zero bytes. */
int fp_stream_zero(struct fp_engine *e, size_t n);
/* Ordered reserve/commit, for a producer that fills the engine's buffer
 * itself (a device-to-host copy): *dst receives the start of *len writable
 * bytes (0 < *len <= max) in the current buffer, the stream's next bytes;
 * a full buffer is queued first and the next one waited for.
 * fp_stream_commit(e, n, crc) then appends the first n <= *len of them
 * (CRC-32 into *crc if not NULL, as fp_stream_write) and ends the
 * reservation. Until then nothing else may be appended: -EBUSY. A commit
 * without a reservation, or of more than was reserved, is -EINVAL (and
 * ends the reservation); committing 0 bytes gives a reservation up. */
int fp_stream_reserve(struct fp_engine *e, size_t max, void **dst, size_t *len);
int fp_stream_commit(struct fp_engine *e, size_t n, uint32_t *crc);
/* Writes what is buffered, waits for every request, ends the stream. */
int fp_stream_end(struct fp_engine *e);
/* Ends the stream without writing what is still buffered (after an error);
 * waits for the requests already in flight. */
void fp_stream_abort(struct fp_engine *e);
uint64_t fp_stream_offset(const struct fp_engine *e);
int fp_stream_direct(const struct fp_engine *e);

/*
 * Reads n bytes at `offset` into dst. When dst and offset are aligned alike,
 * the aligned middle is read straight into dst with O_DIRECT requests, up to
 * queue_depth in flight; otherwise it goes through the engine's buffers.
 * Fresh destination memory is faulted in by the caller (fastpersist.fileio's
 * prefaulting helpers), not here.
 * Returns the number of bytes read (less than n only at end of file).
 */
int64_t fp_pread(struct fp_engine *e, int direct_fd, int buffered_fd, void *dst,
                 size_t n, uint64_t offset);

/* One destination of fp_read_extents: `length` file bytes at `offset`. */
struct fp_extent {
    void *dst;
    uint64_t offset;
    uint64_t length;
};

/*
 * Reads many file ranges into their own destinations in one pass: the file
 * spans that cover them are read sequentially through the engine's buffers
 * (O_DIRECT, whole buffers in flight) and each extent's bytes are copied out
 * as their buffer arrives, so the destinations can have any alignment. When
 * the extents add up to two buffers or more, the copies run on a helper
 * thread that lives only for the call (no thread outlives it; a fork during
 * the call leaves the child without it, as with every engine resource).
 * Extents must be sorted by offset and must not overlap (-EINVAL otherwise);
 * small gaps between them are read through rather than skipped.
 * If crcs is not NULL, crcs[i] is updated with the CRC-32 of extent i.
 * Returns the number of bytes copied (less than the total only at end of file).
 */
int64_t fp_read_extents(struct fp_engine *e, int direct_fd, int buffered_fd,
                        const struct fp_extent *extents, size_t count, uint32_t *crcs);

/*
 * fp_read_extents, telling another thread how far it has got while it runs:
 * each time a buffer's bytes have been copied out, *progress is set (an
 * atomic store with release order) to the file offset below which every
 * extent's bytes are in place. A thread that reads *progress (with acquire
 * order) may use the bytes of each extent that ends at or below it before
 * the call returns. progress may be NULL.
 */
int64_t fp_read_extents_progress(struct fp_engine *e, int direct_fd, int buffered_fd,
                                 const struct fp_extent *extents, size_t count, uint32_t *crcs,
                                 uint64_t *progress);

/*
 * fp_read_extents_progress that another thread can stop: once *stop is
 * non-zero (read with acquire order before each buffer is queued or handed
 * to the copier) nothing more is read or copied; the reads in flight are
 * waited for and the copier finishes the buffer it is copying, so that when
 * the call returns -ECANCELED no byte of any extent is written any more.
 * (A load given up on, an interrupt, must not leave the engine writing into
 * memory its caller is about to free.) stop may be NULL.
 */
int64_t fp_read_extents_until(struct fp_engine *e, int direct_fd, int buffered_fd,
                              const struct fp_extent *extents, size_t count, uint32_t *crcs,
                              uint64_t *progress, const int *stop);

/*
 * Pull read stream, for a consumer that takes the bytes out of the engine's
 * buffers itself (a host-to-device copy): the file range [offset, offset +
 * length) is read in file order into the buffers, whole buffers in flight
 * (aligned chunks on direct_fd, as fp_read_extents), and handed over one
 * buffer at a time. One stream per engine; nothing else runs meanwhile
 * (-EBUSY).
 *
 * fp_read_next waits for the next buffer in file order and returns 1 with
 * *index the buffer, *data and *len its bytes of the range (len > 0) and
 * *offset the file offset of data[0]; 0 once the range, or the file, has
 * ended. A buffer stays the consumer's until fp_read_release(e, index),
 * which must release them in the order they were handed (-EINVAL
 * otherwise); the engine reads the next chunk into it then. With every
 * buffer held nothing can be read ahead: fp_read_next returns -EBUSY.
 * fp_read_end waits for the reads in flight and ends the stream (held
 * buffers count as released); it returns the stream's first error.
 */
int fp_read_begin(struct fp_engine *e, int direct_fd, int buffered_fd, uint64_t offset, uint64_t length);
int fp_read_next(struct fp_engine *e, int *index, const void **data, size_t *len, uint64_t *offset);
int fp_read_release(struct fp_engine *e, int index);
int fp_read_end(struct fp_engine *e);

/* CRC-32 as zlib computes it, with the fastest implementation installed. */
uint32_t fp_crc32(uint32_t crc, const void *buf, size_t n);
/* 1 where fp_crc32 runs ISA-L's CRC (libisal.so.2, loaded at run time), 0
 * where it runs zlib's. */
int fp_crc32_isal(void);
/* The CRC-32 of A followed by B, from crc_a, crc_b and B's length: how the
 * CRCs of a record's pieces, computed apart (by several ranks), combine. */
uint32_t fp_crc32_combine(uint32_t crc_a, uint32_t crc_b, uint64_t len_b);

/* One memory copy of fp_copy_many. */
struct fp_copy {
    const void *src;
    void *dst;
    size_t n;
};
/*
 * Copies every item's n bytes from src to dst (no overlaps), the bytes
 * shared among `threads` threads (1 to 64; the caller's is one of them) in
 * contiguous stretches across the items, so one call moves many tensors
 * with no per-item cost in the caller. A helper that cannot start leaves
 * its stretch to the caller's thread. Returns 0, or -EINVAL for a bad
 * thread count. (A snapshot of a checkpoint's tensors: save_async.)
 */
int fp_copy_many(const struct fp_copy *items, size_t count, int threads);

/*
 * Whether a protocol-2 pickle is a state dict as torch.save writes it (the
 * rules of fastpersist/_state_pickle.py): 1 yes, 0 no, -ENOMEM. globals
 * lists the GLOBALs allowed, each as [kind, length, "module\nname\n"];
 * build_ordered_dict: whether BUILD may set an OrderedDict's attributes.
 * No Python object is touched: bytes in, a decision out.
 */
int fp_pickle_scan(const uint8_t *data, size_t len, const uint8_t *globals, size_t globals_len,
                   int build_ordered_dict);

#endif
