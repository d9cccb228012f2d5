/* fastpersist I/O engine core: buffers, request slots, the write stream and
 * pread. The kernel interface lives in the backends (fp_backend_*.c). */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include "fp_engine_internal.h"

#include <dlfcn.h>
#include <zlib.h>

/* Copy granularity of fp_stream_write: small enough that the CRC reads the
 * bytes back from cache right after memcpy wrote them. */
#define FP_COPY_CHUNK (256u * 1024u)

static uint64_t align_down(uint64_t x) { return x & ~(uint64_t)(FP_ALIGN - 1); }
static uint64_t align_up(uint64_t x) { return align_down(x + FP_ALIGN - 1); }

/* CRC-32: ISA-L's PCLMUL implementation where libisal.so.2 is installed,
 * loaded at run time (never a build or install dependency), zlib's else. */
typedef uint32_t (*isal_crc32_fn)(uint32_t, const unsigned char *, uint64_t);
static isal_crc32_fn isal_crc32;
static pthread_once_t crc_once = PTHREAD_ONCE_INIT;

static void crc_resolve(void)
{
    if (getenv("FASTPERSIST_NO_ISAL")) /* tests: the zlib path on a machine with ISA-L */
        return;
    void *lib = dlopen("libisal.so.2", RTLD_NOW | RTLD_LOCAL);
    if (lib)
        isal_crc32 = (isal_crc32_fn)dlsym(lib, "crc32_gzip_refl");
}

int fp_crc32_isal(void)
{
    pthread_once(&crc_once, crc_resolve);
    return isal_crc32 != NULL;
}

uint32_t fp_crc32(uint32_t crc, const void *buf, size_t n)
{
    pthread_once(&crc_once, crc_resolve);
    if (isal_crc32)
        return isal_crc32(crc, (const unsigned char *)buf, n);
    return (uint32_t)crc32_z(crc, (const unsigned char *)buf, n);
}

/* CRC-32 combination. A CRC is a remainder modulo the CRC polynomial P, so
 * crc(A.B) = crc(A) * x^(8*len(B)) + crc(B) (mod P), in bit-reflected form.
 * x^(8*len) is built from x^(2^k) by repeated squaring. */
#define FP_CRC_POLY 0xedb88320u

static uint32_t mul_mod_p(uint32_t a, uint32_t b)
{
    uint32_t product = 0;
    for (uint32_t bit = 1u << 31; bit; bit >>= 1) { /* reflected: x^0 is the top bit */
        if (a & bit)
            product ^= b;
        b = (b & 1) ? (b >> 1) ^ FP_CRC_POLY : b >> 1; /* b *= x */
    }
    return product;
}

uint32_t fp_crc32_combine(uint32_t crc_a, uint32_t crc_b, uint64_t len_b)
{
    uint32_t power = 1u << 30;  /* x^1, squared to x^(2^k) as k rises */
    uint32_t shift = 1u << 31;  /* x^0 */
    for (uint64_t bits = len_b * 8; bits; bits >>= 1) {
        if (bits & 1)
            shift = mul_mod_p(power, shift);
        power = mul_mod_p(power, power);
    }
    return mul_mod_p(shift, crc_a) ^ crc_b;
}

int fp_kind_compiled(int kind)
{
    switch (kind) {
    case FP_ENGINE_PSYNC:
        return 1;
#ifdef FP_HAVE_LIBAIO
    case FP_ENGINE_AIO:
        return 1;
#endif
#ifdef FP_HAVE_LIBURING
    case FP_ENGINE_URING:
        return 1;
#endif
    default:
        return 0;
    }
}

static const struct fp_backend *backend_for(int kind)
{
    switch (kind) {
    case FP_ENGINE_PSYNC:
        return &fp_backend_psync;
#ifdef FP_HAVE_LIBAIO
    case FP_ENGINE_AIO:
        return &fp_backend_aio;
#endif
#ifdef FP_HAVE_LIBURING
    case FP_ENGINE_URING:
        return &fp_backend_uring;
#endif
    default:
        return NULL;
    }
}

/* Records the first failure of the current operation. Any failure also
 * fails the engine for good: it is never used again. */
static void set_error(struct fp_engine *e, int err, const char *op, uint64_t off)
{
    if (e->error == 0) {
        e->error = err;
        e->error_op = op;
        e->error_offset = off;
    }
    if (e->failed == 0)
        e->failed = err;
}

/* Bumped in the child of every fork() (a pthread_atfork handler), so that
 * an engine can tell it was inherited without a getpid() on every call: a
 * 1 MB save made ~200 of them. */
static volatile unsigned fork_generation;
static pthread_once_t fork_handler_once = PTHREAD_ONCE_INIT;
static void count_fork(void) { fork_generation++; }
static void install_fork_handler(void) { pthread_atfork(NULL, NULL, count_fork); }

static int forked(const struct fp_engine *e) { return fork_generation != e->generation; }

/* ---- fault injection (tests only) ------------------------------------- */

static const struct { const char *name; int value; } fault_errnos[] = {
    {"EIO", EIO}, {"ENOSPC", ENOSPC}, {"EAGAIN", EAGAIN}, {"EINTR", EINTR},
    {"EPERM", EPERM}, {"ENOMEM", ENOMEM}, {"ENOSYS", ENOSYS}, {"EINVAL", EINVAL},
    {"EBUSY", EBUSY}, {"EBADF", EBADF},
};
static const char *const fault_sites[] = {"write", "read", "submit", "mlock", "io_uring_setup", "libaio_setup"};

/* Parses one SITE:N[+]:RESULT rule of `len` bytes. */
static int parse_fault(struct fp_engine *e, const char *rule, size_t len)
{
    char buf[64], *site, *nth, *result, *end;
    if (len == 0 || len >= sizeof(buf))
        return -EINVAL;
    memcpy(buf, rule, len);
    buf[len] = 0;
    site = buf;
    if (!(nth = strchr(site, ':')))
        return -EINVAL;
    *nth++ = 0;
    if (!(result = strchr(nth, ':')))
        return -EINVAL;
    *result++ = 0;
    if (strcmp(site, "open") == 0)
        return 0; /* the caller's: the engine opens no files */
    struct fp_fault f = {-1, 0, 0, 0};
    for (int i = 0; i < FP_SITES; i++)
        if (strcmp(site, fault_sites[i]) == 0)
            f.site = i;
    errno = 0;
    f.nth = strtol(nth, &end, 10);
    if (*end == '+') {
        f.and_later = 1;
        end++;
    }
    if (f.site < 0 || errno || end == nth || *end || f.nth < 1)
        return -EINVAL;
    if (strcmp(result, "short") == 0)
        f.result = FP_FAULT_SHORT;
    for (size_t i = 0; i < sizeof(fault_errnos) / sizeof(fault_errnos[0]); i++)
        if (strcmp(result, fault_errnos[i].name) == 0)
            f.result = -fault_errnos[i].value;
    if (f.result == 0 || e->num_faults == FP_MAX_FAULTS)
        return -EINVAL;
    e->faults[e->num_faults++] = f;
    return 0;
}

static int parse_faults(struct fp_engine *e, const char *spec)
{
    while (spec && *spec) {
        const char *comma = strchr(spec, ',');
        size_t len = comma ? (size_t)(comma - spec) : strlen(spec);
        int rc = parse_fault(e, spec, len);
        if (rc < 0)
            return rc;
        spec = comma ? comma + 1 : NULL;
    }
    return 0;
}

int64_t fp__inject(struct fp_engine *e, int site, int64_t res)
{
    if (e->num_faults == 0)
        return res;
    long n = ++e->fault_events[site];
    for (int i = 0; i < e->num_faults; i++) {
        const struct fp_fault *f = &e->faults[i];
        if (f->site != site || (n != f->nth && !(f->and_later && n > f->nth)))
            continue;
        if (f->result != FP_FAULT_SHORT)
            return f->result;
        return res > 1 ? res / 2 : res; /* the rest is transferred again */
    }
    return res;
}

/* ---- engine lifetime -------------------------------------------------- */

int fp_engine_create(const struct fp_config *cfg, struct fp_engine **out)
{
    *out = NULL;
    if (cfg->num_buffers < 2 || cfg->num_buffers > FP_MAX_NUM_BUFFERS ||
        cfg->queue_depth < 1 || cfg->queue_depth > FP_MAX_QUEUE_DEPTH ||
        cfg->buffer_size == 0 || cfg->buffer_size % FP_ALIGN ||
        cfg->buffer_size > FP_MAX_BUFFER_SIZE || cfg->request_size == 0 ||
        cfg->request_size % FP_ALIGN || cfg->request_size > FP_MAX_REQUEST_SIZE)
        return -EINVAL;
    const struct fp_backend *be = backend_for(cfg->kind);
    if (!be)
        return -ENOSYS;

    struct fp_engine *e = calloc(1, sizeof(*e));
    if (!e)
        return -ENOMEM;
    e->cfg = *cfg;
    pthread_once(&fork_handler_once, install_fork_handler);
    e->generation = fork_generation;
    e->direct_fd = e->buffered_fd = -1;
    int rc = parse_faults(e, getenv("FASTPERSIST_FAULT_INJECT"));
    if (rc < 0) {
        free(e);
        return rc;
    }

    e->region_size = cfg->buffer_size * (size_t)cfg->num_buffers;
    e->region = mmap(NULL, e->region_size, PROT_READ | PROT_WRITE,
                     MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (e->region == MAP_FAILED) {
        int err = -errno;
        free(e);
        return err;
    }
    /* Huge pages make the one-time first touch below ~2x cheaper. */
    madvise(e->region, e->region_size, MADV_HUGEPAGE);
    /* A forked child gets no copy of the buffers: they are the parent's (and
     * registered with its ring), and a child must never write from them. */
    madvise(e->region, e->region_size, MADV_DONTFORK);
    if (cfg->lock_memory) {
        int err = (int)-fp__inject(e, FP_SITE_MLOCK, 0);
        if (err == 0 && mlock(e->region, e->region_size) != 0)
            err = errno;
        if (err == 0)
            e->locked = 1;
        else
            e->lock_errno = err;
    }
    /* Touch every page now, so no save pays for first touch. */
    memset(e->region, 0, e->region_size);

    int qd = cfg->queue_depth;
    e->requests = calloc((size_t)qd, sizeof(*e->requests));
    e->free_slots = calloc((size_t)qd, sizeof(int));
    e->buf_pending = calloc((size_t)cfg->num_buffers, sizeof(int));
    if (!e->requests || !e->free_slots || !e->buf_pending) {
        fp_engine_destroy(e);
        return -ENOMEM;
    }
    for (int i = 0; i < qd; i++)
        e->free_slots[i] = qd - 1 - i;
    e->num_free = qd;

    if (cfg->kind == FP_ENGINE_URING)
        rc = (int)fp__inject(e, FP_SITE_URING_SETUP, 0);
    else if (cfg->kind == FP_ENGINE_AIO)
        rc = (int)fp__inject(e, FP_SITE_AIO_SETUP, 0);
    if (rc == 0)
        rc = be->init(e);
    if (rc < 0) {
        fp_engine_destroy(e); /* e->backend is still NULL: nothing to tear down */
        return rc;
    }
    e->backend = be;
    *out = e;
    return 0;
}

static int wait_all(struct fp_engine *e);

void fp_engine_destroy(struct fp_engine *e)
{
    if (!e)
        return;
    if (forked(e)) {
        /* The ring or AIO context and the buffers are the parent's: free only
         * the child's copies of our bookkeeping (the buffers are not mapped
         * here, MADV_DONTFORK, and the address may hold something else now). */
        if (e->backend)
            e->backend->fini_forked(e);
    } else {
        if (e->backend) {
            wait_all(e); /* the kernel may still write from our buffers */
            e->backend->fini(e); /* io_destroy / ring exit also cancel what wait_all could not */
        }
        if (e->region && e->region != MAP_FAILED)
            munmap(e->region, e->region_size);
    }
    free(e->requests);
    free(e->free_slots);
    free(e->buf_pending);
    free(e);
}

int fp_engine_usable(const struct fp_engine *e)
{
    if (forked(e))
        return -ECHILD;
    return e->failed ? -ENOTRECOVERABLE : 0;
}

int fp_engine_kind(const struct fp_engine *e) { return e->cfg.kind; }
int fp_engine_memory_locked(const struct fp_engine *e) { return e->locked; }
int fp_engine_lock_errno(const struct fp_engine *e) { return e->lock_errno; }
size_t fp_engine_buffer_size(const struct fp_engine *e) { return e->cfg.buffer_size; }
int fp_engine_num_buffers(const struct fp_engine *e) { return e->cfg.num_buffers; }
const char *fp_last_error_op(const struct fp_engine *e) { return e->error_op ? e->error_op : ""; }
uint64_t fp_last_error_offset(const struct fp_engine *e) { return e->error_offset; }

void *fp_engine_buffer(const struct fp_engine *e, int index)
{
    if (index < 0 || index >= e->cfg.num_buffers || forked(e))
        return NULL;
    return e->region + (size_t)index * e->cfg.buffer_size;
}

int fp__request_index(const struct fp_engine *e, const struct fp_request *r)
{
    return (int)(r - e->requests);
}

/* ---- request slots ---------------------------------------------------- */

#define FP_SUBMIT_RETRIES 2000 /* transient refusals, 100 us apart: 0.2 s at least */
#define FP_TRANSFER_RETRIES 2000 /* EAGAIN/EINTR completions of one request in a row */

/* Hands queued requests to the kernel. A transient refusal (EAGAIN: the
 * kernel is short of resources; EBUSY: completions must be reaped first;
 * EINTR) is retried after reaping what has completed; anything else, or a
 * refusal that lasts, fails the engine: the queued requests may never run. */
static int kick(struct fp_engine *e)
{
    for (int tries = 0;; tries++) {
        int rc = e->backend->submit(e);
        if (rc >= 0)
            return 0;
        if ((rc == -EAGAIN || rc == -EBUSY || rc == -EINTR) && tries < FP_SUBMIT_RETRIES) {
            if (e->backend->reap(e, 0) <= 0)
                usleep(100);
            continue;
        }
        set_error(e, rc, "submit", 0);
        e->cannot_submit = 1;
        return rc;
    }
}

/* Requests the kernel has and will complete. */
static int in_kernel(const struct fp_engine *e)
{
    return e->in_flight - e->backend->unsubmitted(e);
}

/* Submits what is queued and waits for at least one completion. After a
 * submission failed for good, it still reaps what the kernel already has:
 * those requests may write from, or read into, memory we are about to free. */
static int wait_one(struct fp_engine *e)
{
    if (e->cannot_reap)
        return e->error ? e->error : -ENOTRECOVERABLE;
    if (!e->cannot_submit)
        kick(e);
    if (in_kernel(e) == 0)
        return e->error;
    int rc = e->backend->reap(e, 1);
    if (rc < 0 && rc != -EINTR) {
        set_error(e, rc, "wait", 0);
        e->cannot_reap = 1;
        return rc;
    }
    return e->error;
}

/* Waits until the kernel holds none of our requests (those that can no
 * longer be submitted stay counted in flight: the engine has failed). */
static int wait_all(struct fp_engine *e)
{
    while (!e->cannot_reap && (e->cannot_submit ? in_kernel(e) : e->in_flight) > 0)
        wait_one(e);
    return e->error;
}

static void release(struct fp_engine *e, struct fp_request *r)
{
    if (r->buf_index >= 0)
        e->buf_pending[r->buf_index]--;
    e->in_flight--;
    e->free_slots[e->num_free++] = fp__request_index(e, r);
}

void fp__fail(struct fp_engine *e, struct fp_request *r, int err)
{
    set_error(e, err, r->is_write ? "write" : "read", r->off);
    release(e, r);
}

/* Hands r to the backend (again, for a retry); if it refuses, r fails with its errno. */
static void requeue(struct fp_engine *e, struct fp_request *r)
{
    int rc = e->backend->queue(e, r);
    if (rc < 0)
        fp__fail(e, r, rc);
}

static int queue_request(struct fp_engine *e, int fd, int is_write, int is_direct,
                         int buf_index, char *buf, size_t len, uint64_t off)
{
    while (e->num_free == 0) {
        if (wait_one(e) < 0)
            return e->error;
    }
    struct fp_request *r = &e->requests[e->free_slots[--e->num_free]];
    r->fd = fd;
    r->is_write = is_write;
    r->is_direct = is_direct;
    r->buf_index = buf_index;
    r->buf = buf;
    r->len = len;
    r->off = off;
    r->retries = 0;
    e->in_flight++;
    if (buf_index >= 0)
        e->buf_pending[buf_index]++;
    requeue(e, r);
    return e->error;
}

/* Called by the backends for every finished request: retries interrupted
 * and short transfers, falls back to the buffered descriptor where O_DIRECT
 * is refused, and records the first failure with its own errno. */
void fp__complete(struct fp_engine *e, struct fp_request *r, int64_t res)
{
    res = fp__inject(e, r->is_write ? FP_SITE_WRITE : FP_SITE_READ, res);
    if (res == -EAGAIN || res == -EINTR) {
        /* Transient: try again, a bounded number of times, pausing after the first few. */
        if (++r->retries > FP_TRANSFER_RETRIES) {
            fp__fail(e, r, (int)res);
            return;
        }
        if (r->retries > 8)
            usleep(100);
        requeue(e, r);
        return;
    }
    r->retries = 0;
    if (res == -EINVAL && r->is_direct && e->buffered_fd >= 0) {
        /* The filesystem refuses O_DIRECT: same bytes, through the cache. */
        e->direct = 0;
        r->is_direct = 0;
        r->fd = e->buffered_fd;
        requeue(e, r);
        return;
    }
    if (res < 0) {
        fp__fail(e, r, (int)res);
        return;
    }
    if (res == 0 && r->len > 0) {
        if (r->is_write)
            set_error(e, -EIO, "write (no progress)", r->off);
        else if (r->off < e->read_eof)
            e->read_eof = r->off;
        release(e, r);
        return;
    }
    if ((size_t)res < r->len) {
        r->buf += res;
        r->off += (uint64_t)res;
        r->len -= (size_t)res;
        if (r->is_direct && ((r->off % FP_ALIGN) || ((uintptr_t)r->buf % FP_ALIGN))) {
            r->is_direct = 0; /* the remainder is no longer aligned */
            r->fd = e->buffered_fd;
        }
        requeue(e, r);
        return;
    }
    release(e, r);
}

/* Splits [buf, buf+len) at file offset off into requests of request_size. */
static int queue_range(struct fp_engine *e, int fd, int is_write, int is_direct,
                       int buf_index, char *buf, size_t len, uint64_t off)
{
    size_t rs = e->cfg.request_size;
    while (len > 0 && !e->error) {
        size_t n = len < rs ? len : rs;
        queue_request(e, fd, is_write, is_direct, buf_index, buf, n, off);
        buf += n;
        off += n;
        len -= n;
    }
    return e->error;
}

/* Common start of a stream or a read: a usable engine, nothing else
 * running (every operation ends with no request in flight), errors cleared. */
static int start_operation(struct fp_engine *e, int direct_fd, int buffered_fd)
{
    int rc = fp_engine_usable(e);
    if (rc < 0)
        return rc;
    if (e->stream_active || e->read_active)
        return -EBUSY;
    if (buffered_fd < 0)
        return -EBADF;
    e->error = 0;
    e->error_op = NULL;
    e->error_offset = 0;
    e->direct_fd = direct_fd;
    e->buffered_fd = buffered_fd;
    e->direct = direct_fd >= 0;
    return 0;
}

/* ---- write stream ----------------------------------------------------- */

int fp_stream_begin(struct fp_engine *e, int direct_fd, int buffered_fd, uint64_t offset,
                    uint64_t prealloc_step)
{
    int rc = start_operation(e, direct_fd, buffered_fd);
    if (rc < 0)
        return rc;
    e->stream_active = 1;
    e->reserved = 0;
    e->pos = offset;
    e->prealloc_step = prealloc_step;
    e->sole_writer = prealloc_step > 0;
    e->alloc_end = offset;
    e->cur = 0;
    /* With O_DIRECT, buffer bytes map to file offsets modulo the alignment,
     * so whole blocks can be written straight from the buffer. */
    e->cur_base = e->direct ? align_down(offset) : offset;
    e->cur_start = e->cur_fill = (size_t)(offset - e->cur_base);
    return 0;
}

/* Extends the file ahead of the writes (see fp_stream_begin). */
static void preallocate(struct fp_engine *e, uint64_t end)
{
    if (!e->prealloc_step || end <= e->alloc_end)
        return;
    uint64_t target = e->alloc_end + e->prealloc_step;
    if (target < end)
        target = end;
    if (fallocate(e->buffered_fd, 0, (off_t)e->alloc_end, (off_t)(target - e->alloc_end)) == 0) {
        e->alloc_end = target;
    } else {
        /* Unsupported, or no room: the writes will tell. A refused fallocate
         * may have allocated (and grown the file) part way; every write so
         * far lies below alloc_end, so cutting there is safe and frees it. */
        e->prealloc_step = 0;
        if (ftruncate(e->buffered_fd, (off_t)e->alloc_end) != 0)
            set_error(e, -errno, "ftruncate", e->alloc_end);
    }
}

/* Queues the current buffer's bytes [start, end): with O_DIRECT, the
 * aligned middle on the direct descriptor and the unaligned edges through
 * the page cache (the head's block is shared with whoever owns the bytes
 * before it; an unaligned tail ends the file). */
static void queue_span(struct fp_engine *e, size_t start, size_t end)
{
    char *buf = fp_engine_buffer(e, e->cur);
    preallocate(e, e->cur_base + end);
    size_t a0 = (size_t)align_up(start), a1 = (size_t)align_down(end);
    if (!e->direct || a0 >= a1) {
        queue_range(e, e->buffered_fd, 1, 0, e->cur, buf + start, end - start, e->cur_base + start);
        return;
    }
    if (start < a0)
        queue_range(e, e->buffered_fd, 1, 0, e->cur, buf + start, a0 - start, e->cur_base + start);
    queue_range(e, e->direct_fd, 1, 1, e->cur, buf + a0, a1 - a0, e->cur_base + a0);
    if (a1 < end)
        queue_range(e, e->buffered_fd, 1, 0, e->cur, buf + a1, end - a1, e->cur_base + a1);
}

/* Queues the valid bytes of the current buffer. */
static int flush_current(struct fp_engine *e)
{
    if (e->cur_fill == e->cur_start)
        return e->error;
    queue_span(e, e->cur_start, e->cur_fill);
    kick(e);
    return e->error;
}

/* Queues the current buffer's filled whole requests while the rest of it
 * is still being filled, so the device starts on a buffer's first bytes
 * rather than after its last (a 10 MB save's only buffer waited for its
 * whole copy: 1.17x faster with this, 1.06x at 50 MB, even at 300 MB). */
static void flush_filled(struct fp_engine *e)
{
    size_t unit = e->cfg.request_size;
    size_t start = e->cur_start;
    if (e->cur_fill - start < unit + FP_ALIGN)
        return;
    size_t a0 = e->direct ? (size_t)align_up(start) : start;
    size_t end = a0 + (e->cur_fill - a0) / unit * unit; /* aligned: no unaligned tail */
    queue_span(e, start, end);
    e->cur_start = end;
    kick(e);
}

/* Moves to the next buffer, waiting until the kernel is done with it. */
static int advance(struct fp_engine *e)
{
    if (flush_current(e))
        return e->error;
    e->cur_base += e->cur_fill;
    e->cur = (e->cur + 1) % e->cfg.num_buffers;
    e->cur_start = e->cur_fill = 0;
    while (e->buf_pending[e->cur] > 0 && !e->error)
        wait_one(e);
    return e->error;
}

static int stream_put(struct fp_engine *e, const void *src, size_t n, uint32_t *crc)
{
    const char *p = src;
    if (forked(e))
        return -ECHILD; /* the buffers are not mapped in this process */
    if (!e->stream_active)
        return -EINVAL;
    if (e->reserved)
        return -EBUSY;
    while (n > 0) {
        if (e->error)
            return e->error;
        size_t space = e->cfg.buffer_size - e->cur_fill;
        if (space == 0) {
            if (advance(e))
                return e->error;
            continue;
        }
        size_t chunk = n < space ? n : space;
        if (chunk > FP_COPY_CHUNK)
            chunk = FP_COPY_CHUNK;
        char *dst = fp_engine_buffer(e, e->cur) + e->cur_fill;
        if (p) {
            memcpy(dst, p, chunk);
            p += chunk;
        } else {
            memset(dst, 0, chunk);
        }
        if (crc)
            *crc = fp_crc32(*crc, dst, chunk);
        e->cur_fill += chunk;
        e->pos += chunk;
        n -= chunk;
        flush_filled(e);
    }
    return e->error;
}

int fp_stream_write(struct fp_engine *e, const void *src, size_t n, uint32_t *crc)
{
    if (!src && n)
        return -EFAULT;
    return stream_put(e, src, n, crc);
}

int fp_stream_zero(struct fp_engine *e, size_t n) { return stream_put(e, NULL, n, NULL); }

int fp_stream_reserve(struct fp_engine *e, size_t max, void **dst, size_t *len)
{
    if (forked(e))
        return -ECHILD;
    if (!e->stream_active || !dst || !len || max == 0)
        return -EINVAL;
    if (e->reserved)
        return -EBUSY;
    if (e->error)
        return e->error;
    if (e->cur_fill == e->cfg.buffer_size && advance(e))
        return e->error;
    size_t space = e->cfg.buffer_size - e->cur_fill;
    *dst = fp_engine_buffer(e, e->cur) + e->cur_fill;
    *len = e->reserved = space < max ? space : max;
    return 0;
}

int fp_stream_commit(struct fp_engine *e, size_t n, uint32_t *crc)
{
    if (forked(e))
        return -ECHILD;
    size_t reserved = e->reserved;
    e->reserved = 0;
    if (!e->stream_active || !reserved || n > reserved)
        return -EINVAL;
    if (e->error)
        return e->error;
    if (crc && n)
        *crc = fp_crc32(*crc, fp_engine_buffer(e, e->cur) + e->cur_fill, n);
    e->cur_fill += n;
    e->pos += n;
    flush_filled(e);
    return e->error;
}

int fp_stream_end(struct fp_engine *e)
{
    if (forked(e))
        return -ECHILD;
    if (!e->stream_active)
        return -EINVAL;
    e->reserved = 0; /* reserved, never committed: not part of the stream */
    if (!e->error)
        flush_current(e);
    wait_all(e);
    if (!e->error && e->sole_writer) {
        /* The sole writer's file ends exactly where the stream does. */
        struct stat st;
        if (fstat(e->buffered_fd, &st) != 0)
            set_error(e, -errno, "fstat", e->pos);
        else if ((uint64_t)st.st_size != e->pos && ftruncate(e->buffered_fd, (off_t)e->pos) != 0)
            set_error(e, -errno, "ftruncate", e->pos);
    }
    e->stream_active = 0;
    return e->error;
}

void fp_stream_abort(struct fp_engine *e)
{
    if (!forked(e))
        wait_all(e);
    e->stream_active = 0;
    e->reserved = 0;
}

uint64_t fp_stream_offset(const struct fp_engine *e) { return e->pos; }
int fp_stream_direct(const struct fp_engine *e) { return e->direct; }

/* ---- pread ------------------------------------------------------------ */

/* Iterates over the buffer-sized, aligned file chunks that cover a sorted
 * list of extents, reading small gaps through instead of seeking over them. */
struct chunk_iter {
    const struct fp_extent *ext;
    size_t count, next;   /* next extent not yet in a span */
    uint64_t pos, span_end;
};

static int next_chunk(struct fp_engine *e, struct chunk_iter *it, uint64_t *start, uint64_t *end)
{
    uint64_t bs = e->cfg.buffer_size;
    if (it->pos >= it->span_end) {
        while (it->next < it->count && it->ext[it->next].length == 0)
            it->next++;
        if (it->next >= it->count)
            return 0;
        const struct fp_extent *x = &it->ext[it->next++];
        it->pos = align_down(x->offset);
        it->span_end = align_up(x->offset + x->length);
        /* Extents less than a request apart are read as one span, gap and
         * all; farther apart, the gap is skipped (a sharded load reads a
         * part of each tensor: reading the rest would double its I/O). */
        while (it->next < it->count && it->ext[it->next].offset <= it->span_end + e->cfg.request_size) {
            x = &it->ext[it->next++];
            uint64_t xe = align_up(x->offset + x->length);
            if (xe > it->span_end)
                it->span_end = xe;
        }
    }
    *start = it->pos;
    *end = it->pos + bs < it->span_end ? it->pos + bs : it->span_end;
    it->pos = *end;
    return 1;
}

/* The copy-out side of fp_read_extents: moves each finished buffer's bytes
 * into the extents' destinations, in file order. On a helper thread when the
 * read spans a few buffers, so the copies overlap the reads: copied by the
 * thread that reaps, they held back the next requests, and a bounced 2 GB
 * read ran at 0.73-0.82x an O_DIRECT read straight into memory. */
struct copy_out {
    struct fp_engine *e;
    const struct fp_extent *ext;
    size_t count, cur;        /* cur: first extent not yet wholly copied */
    uint32_t *crcs;
    uint64_t *progress;       /* where given: the offset below which every extent is copied */
    int64_t copied;
    uint64_t start[FP_MAX_NUM_BUFFERS], valid_end[FP_MAX_NUM_BUFFERS]; /* the chunk in each buffer */
    int threaded;
    pthread_t thread;
    pthread_mutex_t lock;     /* guards the three below when threaded */
    pthread_cond_t cond;
    size_t handed, done;      /* buffers handed over / copied out, counted from the first */
    int stop;                 /* 1: finish what was handed over; 2: drop it (the read failed) */
};

static void copy_buffer(struct copy_out *c, size_t k)
{
    int b = (int)(k % (size_t)c->e->cfg.num_buffers);
    const char *buf = fp_engine_buffer(c->e, b);
    uint64_t cs = c->start[b], valid_end = c->valid_end[b];
    const struct fp_extent *ext = c->ext;
    while (c->cur < c->count && ext[c->cur].offset + ext[c->cur].length <= cs)
        c->cur++;
    for (size_t i = c->cur; i < c->count && ext[i].offset < valid_end; i++) {
        uint64_t lo = ext[i].offset > cs ? ext[i].offset : cs;
        uint64_t hi = ext[i].offset + ext[i].length;
        if (hi > valid_end)
            hi = valid_end;
        if (hi <= lo)
            continue;
        char *dst = (char *)ext[i].dst + (lo - ext[i].offset);
        const char *src = buf + (lo - cs);
        size_t len = (size_t)(hi - lo);
        if (c->crcs) { /* copy in cache-sized pieces so the CRC reads them from cache */
            for (size_t j = 0; j < len; j += FP_COPY_CHUNK) {
                size_t m = len - j < FP_COPY_CHUNK ? len - j : FP_COPY_CHUNK;
                memcpy(dst + j, src + j, m);
                c->crcs[i] = fp_crc32(c->crcs[i], dst + j, m);
            }
        } else {
            memcpy(dst, src, len);
        }
        c->copied += (int64_t)len;
    }
    if (c->progress) /* buffers are copied out in file order: everything below valid_end is in place */
        __atomic_store_n(c->progress, valid_end, __ATOMIC_RELEASE);
}

static void *copy_out_main(void *arg)
{
    struct copy_out *c = arg;
    pthread_mutex_lock(&c->lock);
    for (;;) {
        while (c->done == c->handed && !c->stop)
            pthread_cond_wait(&c->cond, &c->lock);
        if (c->stop == 2 || c->done == c->handed)
            break;
        size_t k = c->done;
        pthread_mutex_unlock(&c->lock);
        copy_buffer(c, k);
        pthread_mutex_lock(&c->lock);
        c->done = k + 1;
        pthread_cond_broadcast(&c->cond);
    }
    pthread_mutex_unlock(&c->lock);
    return NULL;
}

/* Buffers copied out so far: those below it can be read into again. */
static size_t copy_out_done(struct copy_out *c)
{
    if (!c->threaded)
        return c->done;
    pthread_mutex_lock(&c->lock);
    size_t done = c->done;
    pthread_mutex_unlock(&c->lock);
    return done;
}

/* Buffer k holds its chunk: copy it out now, or hand it to the thread. */
static void copy_out_hand(struct copy_out *c, size_t k)
{
    if (!c->threaded) {
        copy_buffer(c, k);
        c->handed = c->done = k + 1;
        return;
    }
    pthread_mutex_lock(&c->lock);
    c->handed = k + 1;
    pthread_cond_broadcast(&c->cond);
    pthread_mutex_unlock(&c->lock);
}

/* Every buffer is in flight or waiting for the copier: wait until it frees one. */
static void copy_out_wait(struct copy_out *c, size_t done)
{
    pthread_mutex_lock(&c->lock);
    while (c->done == done)
        pthread_cond_wait(&c->cond, &c->lock);
    pthread_mutex_unlock(&c->lock);
}

static void copy_out_finish(struct copy_out *c, int failed)
{
    if (!c->threaded)
        return;
    pthread_mutex_lock(&c->lock);
    c->stop = failed ? 2 : 1;
    pthread_cond_broadcast(&c->cond);
    pthread_mutex_unlock(&c->lock);
    pthread_join(c->thread, NULL);
    pthread_mutex_destroy(&c->lock);
    pthread_cond_destroy(&c->cond);
}

int64_t fp_read_extents(struct fp_engine *e, int direct_fd, int buffered_fd,
                        const struct fp_extent *ext, size_t count, uint32_t *crcs)
{
    return fp_read_extents_progress(e, direct_fd, buffered_fd, ext, count, crcs, NULL);
}

int64_t fp_read_extents_progress(struct fp_engine *e, int direct_fd, int buffered_fd,
                                 const struct fp_extent *ext, size_t count, uint32_t *crcs,
                                 uint64_t *progress)
{
    return fp_read_extents_until(e, direct_fd, buffered_fd, ext, count, crcs, progress, NULL);
}

static int stop_asked(const int *stop)
{
    return stop != NULL && __atomic_load_n(stop, __ATOMIC_ACQUIRE) != 0;
}

int64_t fp_read_extents_until(struct fp_engine *e, int direct_fd, int buffered_fd,
                              const struct fp_extent *ext, size_t count, uint32_t *crcs,
                              uint64_t *progress, const int *stop)
{
    uint64_t total = 0;
    for (size_t i = 0; i < count; i++) {
        if (i > 0 && ext[i].offset < ext[i - 1].offset + ext[i - 1].length)
            return -EINVAL;
        total += ext[i].length;
    }
    int rc = start_operation(e, direct_fd, buffered_fd);
    if (rc < 0)
        return rc;
    e->read_eof = UINT64_MAX;
    size_t nb = (size_t)e->cfg.num_buffers;
    struct copy_out c = {.e = e, .ext = ext, .count = count, .crcs = crcs, .progress = progress};
    if (total >= 2 * (uint64_t)e->cfg.buffer_size) { /* else there is nothing to overlap */
        pthread_mutex_init(&c.lock, NULL);
        pthread_cond_init(&c.cond, NULL);
        c.threaded = pthread_create(&c.thread, NULL, copy_out_main, &c) == 0;
        if (!c.threaded) { /* copy inline instead */
            pthread_mutex_destroy(&c.lock);
            pthread_cond_destroy(&c.cond);
        }
    }
    struct chunk_iter it = {ext, count, 0, 0, 0};
    size_t issued = 0, arrived = 0; /* buffers queued / read and handed to the copy-out */
    int more = 1;
    int fd = direct_fd >= 0 ? direct_fd : buffered_fd;
    int stopped = 0;
    while (!e->error) {
        if (stop_asked(stop)) {
            stopped = 1;
            break;
        }
        size_t done = copy_out_done(&c);
        while (more && issued < done + nb) {
            int b = (int)(issued % nb);
            uint64_t end;
            more = next_chunk(e, &it, &c.start[b], &end);
            if (!more)
                break;
            c.valid_end[b] = end;
            queue_range(e, fd, 0, direct_fd >= 0, b, fp_engine_buffer(e, b), (size_t)(end - c.start[b]),
                        c.start[b]);
            issued++;
        }
        if (e->error)
            break;
        if (arrived == issued) {
            if (!more)
                break; /* everything read; the copier finishes below */
            copy_out_wait(&c, done);
            continue;
        }
        int b = (int)(arrived % nb);
        if (e->buf_pending[b] > 0) {
            wait_one(e);
            continue;
        }
        if (e->read_eof < c.valid_end[b])
            c.valid_end[b] = e->read_eof;
        copy_out_hand(&c, arrived++);
    }
    wait_all(e);
    copy_out_finish(&c, e->error != 0 || stopped);
    if (e->error)
        return e->error;
    return stopped ? -ECANCELED : c.copied;
}

int64_t fp_pread(struct fp_engine *e, int direct_fd, int buffered_fd, void *dst,
                 size_t n, uint64_t offset)
{
    char *d = dst;
    uint64_t end = offset + n;
    if (direct_fd >= 0 && ((uintptr_t)d % FP_ALIGN) != (offset % FP_ALIGN)) {
        struct fp_extent x = {dst, offset, n};
        return fp_read_extents(e, direct_fd, buffered_fd, &x, 1, NULL);
    }
    int rc = start_operation(e, direct_fd, buffered_fd);
    if (rc < 0)
        return rc;
    e->read_eof = UINT64_MAX;
    uint64_t a0 = align_up(offset), a1 = align_down(end);
    if (direct_fd < 0 || a0 >= a1) {
        queue_range(e, buffered_fd, 0, 0, -1, d, n, offset);
    } else {
        if (offset < a0)
            queue_range(e, buffered_fd, 0, 0, -1, d, (size_t)(a0 - offset), offset);
        queue_range(e, e->direct_fd, 0, 1, -1, d + (a0 - offset), (size_t)(a1 - a0), a0);
        if (a1 < end)
            queue_range(e, buffered_fd, 0, 0, -1, d + (a1 - offset), (size_t)(end - a1), a1);
    }
    wait_all(e);
    if (e->error)
        return e->error;
    if (e->read_eof < end)
        return (int64_t)(e->read_eof > offset ? e->read_eof - offset : 0);
    return (int64_t)n;
}

/* ---- pull read stream ------------------------------------------------- */

/* Queues chunks into every buffer the consumer does not hold. */
static int read_ahead(struct fp_engine *e)
{
    size_t nb = (size_t)e->cfg.num_buffers;
    int direct = e->direct_fd >= 0;
    while (!e->error && e->r_next < e->r_stop && e->r_issued < e->r_released + nb) {
        int b = (int)(e->r_issued % nb);
        uint64_t start = e->r_next;
        uint64_t end = e->r_stop - start > e->cfg.buffer_size ? start + e->cfg.buffer_size : e->r_stop;
        size_t need = (size_t)((end - start + e->cfg.request_size - 1) / e->cfg.request_size);
        if (e->in_flight > 0 && (size_t)e->num_free < need)
            break; /* no waiting for request slots here: fp_read_next issues it once they free up */
        e->r_start[b] = start;
        e->r_end[b] = end;
        queue_range(e, direct ? e->direct_fd : e->buffered_fd, 0, direct, b, fp_engine_buffer(e, b),
                    (size_t)(end - start), start);
        e->r_next = end;
        e->r_issued++;
    }
    if (!e->error && !e->cannot_submit)
        kick(e); /* in the kernel's hands while the consumer works */
    return e->error;
}

int fp_read_begin(struct fp_engine *e, int direct_fd, int buffered_fd, uint64_t offset, uint64_t length)
{
    if (length > UINT64_MAX - 2 * FP_ALIGN || offset > UINT64_MAX - 2 * FP_ALIGN - length)
        return -EINVAL;
    int rc = start_operation(e, direct_fd, buffered_fd);
    if (rc < 0)
        return rc;
    e->read_active = 1;
    e->read_eof = UINT64_MAX;
    e->r_lo = offset;
    e->r_hi = offset + length;
    /* aligned chunks, so that O_DIRECT can read each whole into its buffer */
    e->r_next = align_down(offset);
    e->r_stop = length ? align_up(offset + length) : e->r_next;
    e->r_issued = e->r_handed = e->r_released = 0;
    return read_ahead(e);
}

int fp_read_next(struct fp_engine *e, int *index, const void **data, size_t *len, uint64_t *offset)
{
    if (forked(e))
        return -ECHILD;
    if (!e->read_active || !index || !data || !len || !offset)
        return -EINVAL;
    if (e->error)
        return e->error;
    while (e->r_handed == e->r_issued) {
        if (e->r_next >= e->r_stop)
            return 0;
        if (e->r_issued >= e->r_released + (size_t)e->cfg.num_buffers)
            return -EBUSY; /* the consumer holds every buffer */
        /* a free buffer waits for request slots (see read_ahead) */
        wait_one(e);
        read_ahead(e);
        if (e->error)
            return e->error;
    }
    int b = (int)(e->r_handed % (size_t)e->cfg.num_buffers);
    while (e->buf_pending[b] > 0 && !e->error) {
        wait_one(e);
        read_ahead(e);
    }
    if (e->error)
        return e->error;
    uint64_t lo = e->r_start[b] > e->r_lo ? e->r_start[b] : e->r_lo;
    uint64_t hi = e->r_end[b] < e->r_hi ? e->r_end[b] : e->r_hi;
    if (e->read_eof < hi)
        hi = e->read_eof;
    if (hi <= lo)
        return 0; /* the file ended */
    *index = b;
    *data = fp_engine_buffer(e, b) + (lo - e->r_start[b]);
    *len = (size_t)(hi - lo);
    *offset = lo;
    e->r_handed++;
    return 1;
}

int fp_read_release(struct fp_engine *e, int index)
{
    if (forked(e))
        return -ECHILD;
    if (!e->read_active || e->r_released == e->r_handed
        || index != (int)(e->r_released % (size_t)e->cfg.num_buffers))
        return -EINVAL;
    e->r_released++;
    return read_ahead(e);
}

int fp_read_end(struct fp_engine *e)
{
    if (forked(e)) {
        e->read_active = 0;
        return -ECHILD;
    }
    if (!e->read_active)
        return -EINVAL;
    wait_all(e);
    e->read_active = 0;
    return e->error;
}

/* fp_copy_many: each thread copies the bytes [lo, hi) of the items laid end
 * to end. */
struct copy_share {
    const struct fp_copy *items;
    size_t count;
    uint64_t lo, hi;
    pthread_t thread;
};

static void *copy_share_run(void *arg)
{
    struct copy_share *s = arg;
    uint64_t at = 0; /* where item i starts, items laid end to end */
    for (size_t i = 0; i < s->count && at < s->hi; at += s->items[i].n, i++) {
        uint64_t a = at > s->lo ? at : s->lo;
        uint64_t b = at + s->items[i].n < s->hi ? at + s->items[i].n : s->hi;
        if (a < b)
            memcpy((char *)s->items[i].dst + (a - at), (const char *)s->items[i].src + (a - at), (size_t)(b - a));
    }
    return NULL;
}

int fp_copy_many(const struct fp_copy *items, size_t count, int threads)
{
    if (threads < 1 || threads > 64)
        return -EINVAL;
    uint64_t total = 0;
    for (size_t i = 0; i < count; i++)
        total += items[i].n;
    if (total < ((uint64_t)threads << 20)) /* under 1 MiB a thread: not worth starting one */
        threads = 1;
    struct copy_share shares[64];
    uint64_t step = (total + (uint64_t)threads - 1) / (uint64_t)threads;
    step = (step + 4095) & ~(uint64_t)4095; /* stretches end on page multiples of the total */
    int started[64] = {0};
    for (int t = 0; t < threads; t++) {
        uint64_t lo = step * (uint64_t)t, hi = lo + step;
        shares[t] = (struct copy_share){items, count, lo < total ? lo : total, hi < total ? hi : total, 0};
        if (t > 0 && shares[t].lo < shares[t].hi)
            started[t] = pthread_create(&shares[t].thread, NULL, copy_share_run, &shares[t]) == 0;
    }
    copy_share_run(&shares[0]);
    for (int t = 1; t < threads; t++) {
        if (started[t])
            pthread_join(shares[t].thread, NULL);
        else if (shares[t].lo < shares[t].hi)
            copy_share_run(&shares[t]); /* no thread for it: done here */
    }
    return 0;
}
