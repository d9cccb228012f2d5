"""Thin Python face of the C engine: engine selection, errno -> OSError, and a
pool of engines so their pre-touched buffers are reused from save to save.

cffi releases the GIL for every call into the engine, so copying, checksums
and waiting on the disk run without holding it.
"""
from __future__ import annotations

import errno
import logging
import os
import threading
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


def compiled_engines() -> list[str]:
    lib, _ = _load()
    return [name for name, kind in _KINDS.items() if lib.fp_kind_compiled(kind)]


def crc32(data, crc: int = 0) -> int:
    """zlib-compatible CRC-32 of a bytes-like object, with the engine's CRC."""
    lib, ffi = _load()
    buf = ffi.from_buffer(data)
    return lib.fp_crc32(crc, buf, len(buf))


class Engine:
    """One I/O context: a ring (or AIO context) and its bounce buffers."""

    def __init__(self, kind: str, options: Options):
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
        self._handle = ffi.gc(out[0], lib.fp_engine_destroy)
        self.kind = kind
        self.options = options
        self.memory_locked = bool(lib.fp_engine_memory_locked(self._handle))
        self.lock_errno = lib.fp_engine_lock_errno(self._handle)
        self._crc = ffi.new("uint32_t *")
        self._path = None

    # -- errors ---------------------------------------------------------
    def _check(self, rc: int, what: str) -> int:
        if rc < 0:
            lib, ffi = _load()
            op = ffi.string(lib.fp_last_error_op(self._handle)).decode() or what
            offset = lib.fp_last_error_offset(self._handle)
            err = -rc
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
                   path: Optional[str] = None, *, prefault: bool = False) -> int:
        """Reads nbytes at offset into host memory at address; returns bytes read.
        prefault=True: the memory is freshly mapped, fault it in on another thread."""
        lib, ffi = _load()
        self._path = path
        flags = lib.FP_READ_PREFAULT if prefault else 0
        return self._check(
            lib.fp_pread(self._handle, direct_fd, buffered_fd, ffi.cast("void *", address), nbytes, offset, flags),
            "read",
        )

    def read_extents(self, direct_fd: int, buffered_fd: int, extents, path: Optional[str] = None,
                     *, checksums: bool = False):
        """Reads (address, offset, length) extents, sorted by offset, in one pass.
        Returns bytes copied and, with checksums, each extent's CRC-32."""
        lib, ffi = _load()
        self._path = path
        count = len(extents)
        table = ffi.new("struct fp_extent[]", count)
        for i, (address, offset, length) in enumerate(extents):
            table[i].dst = ffi.cast("void *", address)
            table[i].offset = offset
            table[i].length = length
        crcs = ffi.new("uint32_t[]", count) if checksums else ffi.NULL
        copied = self._check(lib.fp_read_extents(self._handle, direct_fd, buffered_fd, table, count, crcs), "read")
        return copied, (list(crcs) if checksums else None)


# ---------------------------------------------------------------------------
# engine pool


_pool_lock = threading.Lock()
_pool: dict[tuple, list[Engine]] = {}
_auto_kind: Optional[str] = None
_memlock_reported = False


def _pool_key(kind: str, options: Options) -> tuple:
    return (kind, options.buffer_size, options.num_buffers, options.queue_depth,
            options.request_size, options.lock_memory)


def _create(kind: str, options: Options) -> Engine:
    global _memlock_reported
    engine = Engine(kind, options)
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
    if _auto_kind is not None:
        return _create(_auto_kind, options)
    compiled = compiled_engines()
    failures = []
    for kind in _AUTO_ORDER:
        if kind not in compiled:
            failures.append(f"{kind}: not compiled in")
            continue
        try:
            engine = _create(kind, options)
        except OSError as exc:
            failures.append(f"{kind}: {exc.strerror}")
            continue
        if failures:
            log.info("fastpersist: using the %s engine (%s)", kind, "; ".join(failures))
        _auto_kind = kind
        return engine
    raise OSError(errno.ENOSYS, "no fastpersist engine could start: " + "; ".join(failures))


def acquire(options: Options) -> Engine:
    """An idle engine for these options, from the pool or new."""
    kind = options.engine if options.engine != "auto" else _auto_kind
    if kind is not None:
        with _pool_lock:
            idle = _pool.get(_pool_key(kind, options))
            if idle:
                return idle.pop()
    if options.engine == "auto":
        return _resolve_auto(options)
    if options.engine not in compiled_engines():
        raise OSError(errno.ENOSYS, f"the {options.engine} engine is not compiled into this fastpersist build")
    return _create(options.engine, options)


def release(engine: Engine) -> None:
    with _pool_lock:
        idle = _pool.setdefault(_pool_key(engine.kind, engine.options), [])
        if not idle:  # keep one idle engine per configuration
            idle.append(engine)


def clear_pool() -> None:
    """Drops idle engines and forgets the auto choice (frees their buffers)."""
    global _auto_kind
    with _pool_lock:
        _pool.clear()
        _auto_kind = None
