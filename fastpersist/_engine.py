"""Thin Python face of the C engine: engine selection, errno -> OSError, and a
bounded pool of engines so their pre-touched buffers are reused from save to
save.

cffi releases the GIL for every call into the engine, so copying, checksums
and waiting on the disk run without holding it.

Fork: an engine belongs to the process that created it (its ring, AIO
context and registered buffers are the parent's; the C engine refuses to run
anywhere else). A forked child starts with an empty pool and creates its own.
An engine whose operation failed is never handed out again.
"""
from __future__ import annotations

import ctypes
import errno
import functools
import logging
import os
import threading
import weakref
from typing import Optional

from .options import Options

log = logging.getLogger("fastpersist")

_KINDS = {"psync": 0, "libaio": 1, "io_uring": 2}
_AUTO_ORDER = ("io_uring", "libaio", "psync")

_lib = None
_ffi = None


def _load():
    """Imports the compiled module on first use (import fastpersist stays light)."""
    global _lib, _ffi
    if _lib is None:
        try:
            from . import _engine_cffi
        except ImportError as exc:  # pragma: no cover - depends on the install
            raise ImportError(
                "fastpersist's C engine is not built; run `pip install -e .` (or `make build`) "
                f"in the fastpersist source tree ({exc})"
            ) from exc
        _lib, _ffi = _engine_cffi.lib, _engine_cffi.ffi
    return _lib, _ffi


def loaded() -> bool:
    """Whether the compiled module is imported already (its first import costs ~0.7 ms)."""
    return _lib is not None


def compiled_engines() -> list[str]:
    lib, _ = _load()
    return [name for name, kind in _KINDS.items() if lib.fp_kind_compiled(kind)]


def crc32_implementation() -> str:
    """Which CRC-32 fp_crc32 runs: ISA-L's (libisal.so.2, loaded at run time) or zlib's."""
    lib, _ = _load()
    return "ISA-L (libisal.so.2)" if lib.fp_crc32_isal() else "zlib (libisal2 not installed)"


def crc32(data, crc: int = 0) -> int:
    """zlib-compatible CRC-32 of a bytes-like object, with the engine's CRC."""
    lib, ffi = _load()
    buf = ffi.from_buffer(data)
    return lib.fp_crc32(crc, buf, len(buf))


def crc32_at(address: int, nbytes: int, crc: int = 0) -> int:
    """The engine's CRC-32 of nbytes of this process's memory at address."""
    lib, ffi = _load()
    return lib.fp_crc32(crc, ffi.cast("char *", address), nbytes)


def pickle_scan(data, globals_table: bytes, build_ordered_dict: bool) -> bool:
    """fp_pickle_scan: whether a pickle is a state dict as torch.save writes it (see _state_pickle)."""
    lib, ffi = _load()
    buf = ffi.from_buffer(data)
    rc = lib.fp_pickle_scan(buf, len(buf), globals_table, len(globals_table), int(build_ordered_dict))
    if rc < 0:
        raise MemoryError("fp_pickle_scan ran out of memory")
    return rc == 1


def memory_at(address: int, nbytes: int):
    """A writable buffer over nbytes of this process's memory at address."""
    _, ffi = _load()
    return ffi.buffer(ffi.cast("char *", address), nbytes)


def crc32_combine(crc_a: int, crc_b: int, len_b: int) -> int:
    """CRC-32 of A followed by B from the CRC-32s of A and B and B's length."""
    lib, _ = _load()
    return lib.fp_crc32_combine(crc_a, crc_b, len_b)


def copy_many(copies, threads: int = 1) -> None:
    """Copies (source address, destination address, nbytes) items, non-overlapping,
    in one C call that runs without the GIL, the bytes shared among `threads`
    threads (fp_copy_many)."""
    import array

    lib, ffi = _load()
    flat = array.array("Q")  # struct fp_copy is three 64-bit words on the 64-bit platforms built for
    for item in copies:
        flat.extend(item)
    if not flat:
        return
    assert ffi.sizeof("struct fp_copy") == 3 * flat.itemsize
    rc = lib.fp_copy_many(ffi.cast("struct fp_copy *", ffi.from_buffer(flat)), len(flat) // 3, threads)
    if rc < 0:
        raise OSError(-rc, f"fp_copy_many: {os.strerror(-rc)} (threads={threads})")


class Engine:
    """One I/O context: a ring (or AIO context) and its bounce buffers."""

    def __init__(self, kind: str, options: Options, generation: int = 0):
        lib, ffi = _load()
        cfg = ffi.new("struct fp_config *")
        cfg.kind = _KINDS[kind]
        cfg.buffer_size = options.buffer_size
        cfg.num_buffers = options.num_buffers
        cfg.queue_depth = options.queue_depth
        cfg.request_size = options.request_size
        cfg.lock_memory = int(options.lock_memory)
        out = ffi.new("struct fp_engine **")
        rc = lib.fp_engine_create(cfg, out)
        if rc < 0:
            raise OSError(-rc, f"cannot start the {kind} engine: {os.strerror(-rc)}")
        hooks: list = []
        self._before_destroy = hooks  # the destructor holds the list, not the engine

        def destroy(handle, creator=os.getpid()):
            if os.getpid() == creator:  # a forked child owns no buffers (nor their registrations)
                for hook in hooks:
                    try:
                        hook()
                    except Exception:  # a destructor cannot raise; the hook says what went wrong
                        log.exception("fastpersist: a hook run before an engine's buffers are freed failed")
            lib.fp_engine_destroy(handle)

        self._handle = ffi.gc(out[0], destroy)
        self.kind = kind
        self.options = options
        self.memory_locked = bool(lib.fp_engine_memory_locked(self._handle))
        self.lock_errno = lib.fp_engine_lock_errno(self._handle)
        self._crc = ffi.new("uint32_t *")
        self._pulled = None  # read_next's out-parameters, made on the first pull read
        self._reserved = None  # reserve's, made on the first reservation
        # buffers registered with CUDA (device_io.register_buffers): None not tried, False refused
        self.device_registered: Optional[bool] = None
        self._path = None
        self.generation = generation  # the pool's, at creation (a fork starts a new one)
        self.pid = os.getpid()
        self.pool_key: Optional[tuple] = None  # set when checked out of the pool

    def buffer_region(self) -> tuple:
        """(address, nbytes) of the engine's buffers, one mapping, buffer i at
        address + i * buffer_size."""
        lib, ffi = _load()
        address = int(ffi.cast("uintptr_t", lib.fp_engine_buffer(self._handle, 0)))
        return address, self.options.buffer_size * self.options.num_buffers

    def before_destroy(self, hook) -> None:
        """Runs hook() just before the buffers are unmapped, in the creating
        process only (a registration of the buffers with a device is undone there)."""
        self._before_destroy.append(hook)

    # -- errors ---------------------------------------------------------
    @property
    def usable(self) -> bool:
        """False once an operation failed, and in any process but the creator."""
        lib, _ = _load()
        return lib.fp_engine_usable(self._handle) == 0

    def _check(self, rc: int, what: str) -> int:
        if rc < 0:
            lib, ffi = _load()
            err = -rc
            if err == errno.ECHILD and os.getpid() != self.pid:
                raise OSError(err, f"this fastpersist {self.kind} engine was created by process {self.pid} and "
                                   f"cannot be used in process {os.getpid()} after fork(); a file being written "
                                   "or read across fork() must be reopened in the child", self._path)
            op = ffi.string(lib.fp_last_error_op(self._handle)).decode() or what
            offset = lib.fp_last_error_offset(self._handle)
            if err == errno.ENOTRECOVERABLE:
                raise OSError(err, f"this fastpersist {self.kind} engine failed earlier ({op} at offset {offset}) "
                                   "and is not used again", self._path)
            raise OSError(err, f"{os.strerror(err)} (fastpersist {self.kind} {op} at offset {offset})", self._path)
        return rc

    # -- write stream ---------------------------------------------------
    def begin(self, direct_fd: int, buffered_fd: int, offset: int, path: Optional[str],
              prealloc_step: int = 0) -> None:
        """Starts a write stream at offset; prealloc_step > 0 only for the file's sole writer."""
        lib, _ = _load()
        self._path = path
        self._check(lib.fp_stream_begin(self._handle, direct_fd, buffered_fd, offset, prealloc_step), "begin")

    def write(self, data) -> int:
        """Appends a bytes-like object; returns its length."""
        lib, ffi = _load()
        buf = ffi.from_buffer(data)
        self._check(lib.fp_stream_write(self._handle, buf, len(buf), ffi.NULL), "write")
        return len(buf)

    def write_address(self, address: int, nbytes: int, crc: Optional[int] = None) -> Optional[int]:
        """Appends nbytes of host memory at address; updates and returns crc if given."""
        lib, ffi = _load()
        src = ffi.cast("const void *", address)
        if crc is None:
            self._check(lib.fp_stream_write(self._handle, src, nbytes, ffi.NULL), "write")
            return None
        self._crc[0] = crc
        self._check(lib.fp_stream_write(self._handle, src, nbytes, self._crc), "write")
        return int(self._crc[0])

    def write_zeros(self, nbytes: int) -> None:
        lib, _ = _load()
        self._check(lib.fp_stream_zero(self._handle, nbytes), "write")

    def reserve(self, max_bytes: int) -> tuple:
        """(address, length): the next 0 < length <= max_bytes bytes of the
        stream, in the engine's buffer, for the caller to fill and commit()."""
        lib, ffi = _load()
        if self._reserved is None:  # made once: a GPU save reserves once per buffer of every storage
            self._reserved = (ffi.new("void **"), ffi.new("size_t *"))
        dst, length = self._reserved
        self._check(lib.fp_stream_reserve(self._handle, max_bytes, dst, length), "reserve")
        return int(ffi.cast("uintptr_t", dst[0])), int(length[0])

    def commit(self, nbytes: int, crc: Optional[int] = None) -> Optional[int]:
        """Appends the first nbytes of the reservation; updates and returns crc if given."""
        lib, ffi = _load()
        if crc is None:
            self._check(lib.fp_stream_commit(self._handle, nbytes, ffi.NULL), "commit")
            return None
        self._crc[0] = crc
        self._check(lib.fp_stream_commit(self._handle, nbytes, self._crc), "commit")
        return int(self._crc[0])

    def tell(self) -> int:
        lib, _ = _load()
        return int(lib.fp_stream_offset(self._handle))

    def direct(self) -> bool:
        lib, _ = _load()
        return bool(lib.fp_stream_direct(self._handle))

    def end(self) -> None:
        lib, _ = _load()
        self._check(lib.fp_stream_end(self._handle), "write")

    def abort(self) -> None:
        lib, _ = _load()
        lib.fp_stream_abort(self._handle)

    # -- reads ----------------------------------------------------------
    def pread_into(self, direct_fd: int, buffered_fd: int, address: int, nbytes: int, offset: int,
                   path: Optional[str] = None) -> int:
        """Reads nbytes at offset into host memory at address; returns bytes read.
        (Fresh memory: fileio.prefaulting faults it in ahead of the reads.)"""
        lib, ffi = _load()
        self._path = path
        return self._check(
            lib.fp_pread(self._handle, direct_fd, buffered_fd, ffi.cast("void *", address), nbytes, offset),
            "read",
        )

    def read_begin(self, direct_fd: int, buffered_fd: int, offset: int, length: int,
                   path: Optional[str] = None) -> None:
        """Starts a pull read of the file's bytes [offset, offset + length):
        read_next() hands over the engine's buffers in file order."""
        lib, ffi = _load()
        self._path = path
        if self._pulled is None:
            self._pulled = (ffi.new("int *"), ffi.new("const void **"), ffi.new("size_t *"), ffi.new("uint64_t *"))
        self._check(lib.fp_read_begin(self._handle, direct_fd, buffered_fd, offset, length), "read")

    def read_next(self) -> Optional[tuple]:
        """(index, address, length, file offset) of the next buffer, which
        stays the caller's until read_release(index); None at the end."""
        lib, ffi = _load()
        index, data, length, offset = self._pulled
        if self._check(lib.fp_read_next(self._handle, index, data, length, offset), "read") == 0:
            return None
        return int(index[0]), int(ffi.cast("uintptr_t", data[0])), int(length[0]), int(offset[0])

    def read_release(self, index: int) -> None:
        """Gives the oldest buffer read_next handed over back to the engine."""
        lib, _ = _load()
        self._check(lib.fp_read_release(self._handle, index), "read")

    def read_end(self) -> None:
        """Waits for the reads in flight and ends the pull read; raises its first error."""
        lib, _ = _load()
        self._check(lib.fp_read_end(self._handle), "read")

    def read_extents(self, direct_fd: int, buffered_fd: int, extents, path: Optional[str] = None,
                     *, checksums: bool = False, progress=None, stop: Optional[int] = None):
        """Reads (address, offset, length) extents, sorted by offset, in one pass.
        Returns bytes copied and, with checksums, each extent's CRC-32.
        progress: a ctypes.c_uint64 the engine sets, while it reads, to the
        file offset below which every extent's bytes are in place (another
        thread may use them before the call returns).
        stop: the address of an int another thread may set non-zero to stop
        the read before its next buffer (OSError ECANCELED then; nothing is
        written into the extents once it is raised)."""
        lib, ffi = _load()
        self._path = path
        count = len(extents)
        table = ffi.new("struct fp_extent[]", count)
        for i, (address, offset, length) in enumerate(extents):
            table[i].dst = ffi.cast("void *", address)
            table[i].offset = offset
            table[i].length = length
        crcs = ffi.new("uint32_t[]", count) if checksums else ffi.NULL
        where = ffi.NULL if progress is None else ffi.cast("uint64_t *", ctypes.addressof(progress))
        stop_word = ffi.NULL if stop is None else ffi.cast("const int *", stop)
        copied = self._check(lib.fp_read_extents_until(self._handle, direct_fd, buffered_fd, table, count, crcs,
                                                       where, stop_word), "read")
        return copied, (list(crcs) if checksums else None)


# ---------------------------------------------------------------------------
# engine pool
#
# At most options.max_engines engines of one configuration are alive at once
# (each holds buffer_size * num_buffers of pre-touched, locked memory); a
# thread that needs one more waits for another thread to release one, unless
# it already holds one itself (a load inside a save must not deadlock).
#
# An engine for a file smaller than the configuration's buffers gets buffers
# sized to the file (sized_for) and is pooled with the configuration's
# others, counted against the same bound: a small file takes the smallest
# idle engine that holds it, and a larger file, finding only smaller ones
# idle at the bound, drops one to make room.


_pool_lock = threading.Condition()
_auto_lock = threading.Lock()
_idle: dict[tuple, list[Engine]] = {}
_in_use: dict[tuple, "weakref.WeakSet[Engine]"] = {}  # an engine dropped without release() stops counting
_creating: dict[tuple, int] = {}
_generation = 0
_held = threading.local()
_auto_kind: Optional[str] = None
_memlock_reported = False


def _pool_key(kind: str, options: Options) -> tuple:
    return (kind, options.buffer_size, options.num_buffers, options.queue_depth,
            options.request_size, options.lock_memory)


def _create(kind: str, options: Options) -> Engine:
    global _memlock_reported
    engine = Engine(kind, options, _generation)
    if options.lock_memory and not engine.memory_locked and not _memlock_reported:
        _memlock_reported = True
        log.info(
            "fastpersist: could not lock %d MiB of I/O buffers in memory (%s; see `ulimit -l`); "
            "continuing with unlocked buffers",
            options.buffer_size * options.num_buffers >> 20, os.strerror(engine.lock_errno),
        )
    return engine


def _resolve_auto(options: Options) -> Engine:
    """Tries the engines in order of speed; reports a refusal once."""
    global _auto_kind
    compiled = compiled_engines()
    failures = []
    for kind in _AUTO_ORDER:
        if kind not in compiled:
            failures.append(f"{kind}: not compiled in")
            continue
        try:
            engine = _create(kind, options)
        except OSError as exc:
            failures.append(f"{kind}: {os.strerror(exc.errno)}")
            continue
        if failures:
            # an engine the build left out is a lasting loss, said louder than a kernel's refusal
            level = logging.WARNING if any("not compiled in" in f for f in failures) else logging.INFO
            log.log(level, "fastpersist: using the %s engine (%s)%s", kind, "; ".join(failures),
                    "; this build has no io_uring or libaio engine: install liburing-dev and libaio-dev, "
                    "then reinstall fastpersist, for saves and loads at the device's speed"
                    if level == logging.WARNING else "")
        _auto_kind = kind
        return engine
    raise OSError(errno.ENOSYS, "no fastpersist engine could start: " + "; ".join(failures))


def _alive(key: tuple) -> int:
    return len(_idle.get(key, ())) + len(_in_use.get(key, ())) + _creating.get(key, 0)


def _check_out(key: tuple, engine: Engine) -> Engine:
    engine.pool_key = key  # the configuration asked for: its buffers may be smaller
    _in_use.setdefault(key, weakref.WeakSet()).add(engine)
    _held.count = getattr(_held, "count", 0) + 1
    return engine


def sized_for(options: Options, nbytes: int) -> Options:
    """The options of an engine for a file of nbytes: options itself where
    the file fills their buffers (or its size is unknown: 0); else buffers
    no larger than the file can use. Creating an engine first touches and
    locks its buffers, ~0.25 ms per MiB here (16 ms for the default 64 MiB,
    20-150 ms in a busy or fresh process): more than a small file's whole
    save, which the first save of a small checkpoint in a process paid."""
    if nbytes <= 0 or nbytes >= options.buffer_size * options.num_buffers:
        return options
    share = -(-nbytes // options.num_buffers)
    buffer_size = min(options.buffer_size, max(options.request_size, 1 << (share - 1).bit_length()))
    num_buffers = min(options.num_buffers, max(2, -(-nbytes // buffer_size)))
    return _with_buffers(options, buffer_size, num_buffers)


@functools.lru_cache(maxsize=64)
def _with_buffers(options: Options, buffer_size: int, num_buffers: int) -> Options:
    # one Options per geometry: replace() builds and checks a new one (8 us, every small save)
    return options.replace(buffer_size=buffer_size, num_buffers=num_buffers)


def _holds(engine: Engine, need: Options) -> bool:
    return engine.options.buffer_size >= need.buffer_size and engine.options.num_buffers >= need.num_buffers


def _capacity(engine: Engine) -> int:
    return engine.options.buffer_size * engine.options.num_buffers


def _known_kind(options: Options) -> Optional[str]:
    """The engine kind options ask for; None while "auto" has not been resolved yet."""
    return options.engine if options.engine != "auto" else _auto_kind


def acquire(options: Options, nbytes: int = 0) -> Engine:
    """An idle engine for these options, from the pool or new; waits while
    max_engines of them are in use by other threads. nbytes: the size of
    the file it is for, where known (0: not): the smallest idle engine whose
    buffers hold it, or a new one with buffers sized to it (sized_for)."""
    need = sized_for(options, nbytes)
    kind = _known_kind(options)
    if kind is None:  # first auto use: one thread finds the engine the kernel allows
        with _auto_lock:
            if _auto_kind is None:
                engine = _resolve_auto(need)
                with _pool_lock:
                    return _check_out(_pool_key(engine.kind, options), engine)
        kind = _auto_kind
    if kind not in compiled_engines():
        raise OSError(errno.ENOSYS, f"the {kind} engine is not compiled into this fastpersist build")
    key = _pool_key(kind, options)
    holds_one = getattr(_held, "count", 0) > 0
    dropped = None  # an idle engine too small, making room: freed outside the lock
    with _pool_lock:
        while True:
            idle = _idle.get(key)
            fitting = [e for e in idle if _holds(e, need)] if idle else ()
            if fitting:
                engine = min(fitting, key=_capacity)
                idle.remove(engine)
                return _check_out(key, engine)
            if _alive(key) < options.max_engines or holds_one:
                _creating[key] = _creating.get(key, 0) + 1
                break
            if idle:  # at the bound with only smaller engines idle: one makes room
                dropped = idle.pop(0)
                continue
            # released engines notify; one dropped without release() only
            # leaves the WeakSet, so look again now and then
            _pool_lock.wait(timeout=0.5)
    del dropped
    try:
        engine = _create(kind, need)
    finally:
        with _pool_lock:
            _creating[key] -= 1
            _pool_lock.notify()
    with _pool_lock:
        return _check_out(key, engine)


def release(engine: Engine) -> None:
    """Returns an engine to the pool; a failed one (or one from before a fork) is dropped."""
    _held.count = max(0, getattr(_held, "count", 0) - 1)
    if engine.generation != _generation:
        return  # created before a fork: unusable here
    key = engine.pool_key or _pool_key(engine.kind, engine.options)
    with _pool_lock:
        _in_use.get(key, set()).discard(engine)
        # over the bound (a nested acquire went past it): drop it instead of pooling it
        if engine.usable and _alive(key) < engine.options.max_engines:
            _idle.setdefault(key, []).append(engine)
        _pool_lock.notify()


def has_idle(options: Options, nbytes: int = 0) -> bool:
    """Whether acquire(options, nbytes) would hand out an engine that exists
    (no buffers to lock and register first)."""
    kind = _known_kind(options)
    if kind is None:
        return False
    need = sized_for(options, nbytes)
    with _pool_lock:
        return any(_holds(e, need) for e in _idle.get(_pool_key(kind, options), ()))


def pool_size() -> int:
    """Engines alive in this process's pool, idle or in use."""
    with _pool_lock:
        return sum(_alive(key) for key in set(_idle) | set(_in_use) | set(_creating))


def clear_pool() -> None:
    """Drops idle engines and forgets the auto choice (frees their buffers)."""
    global _auto_kind
    with _pool_lock:
        _idle.clear()
        _auto_kind = None
        _pool_lock.notify_all()


def _forget_pool_in_child() -> None:
    """After fork, in the child: the parent's engines are unusable here (and
    their buffers unmapped); start an empty pool. Dropping them frees only
    the child's copies of their bookkeeping. The lock is new: another parent
    thread may have held the old one at the fork."""
    global _pool_lock, _auto_lock, _idle, _in_use, _creating, _generation, _held
    _pool_lock = threading.Condition()
    _auto_lock = threading.Lock()
    _idle, _in_use, _creating = {}, {}, {}
    _generation += 1
    _held = threading.local()


os.register_at_fork(after_in_child=_forget_pool_in_child)


# ---------------------------------------------------------------------------
# fault injection for tests (see csrc/fp_engine.h)

_open_faults_seen = 0


def injected_open_error() -> Optional[OSError]:
    """The error the FASTPERSIST_FAULT_INJECT rule "open:N:ERRNO" assigns to
    this process's next O_DIRECT open, or None. The engine ignores "open"
    rules: opening files is the binding's job."""
    global _open_faults_seen
    spec = os.environ.get("FASTPERSIST_FAULT_INJECT")
    if not spec:
        return None
    _open_faults_seen += 1
    for rule in spec.split(","):
        site, _, rest = rule.partition(":")
        nth, _, result = rest.partition(":")
        if site != "open":
            continue
        later = nth.endswith("+")
        n = int(nth.rstrip("+"))
        if _open_faults_seen == n or (later and _open_faults_seen > n):
            code = getattr(errno, result)
            return OSError(code, f"{os.strerror(code)} (injected by FASTPERSIST_FAULT_INJECT)")
    return None
