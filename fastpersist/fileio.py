"""fastpersist's file I/O layer, shared by save, load and what builds on them:
O_DIRECT descriptors, engines taken from the pool for a file, reads of many
extents through the engine, and what the page cache holds of a file. (Which
mode a load reads in, and parallel reads through the page cache:
read_pipeline. The engine itself, its pool and its binding: _engine.py.)"""
from __future__ import annotations

import contextlib
import errno
import functools
import logging
import os

from . import _engine
from .helper_threads import HelperThreads, ReadStopped
from .options import Options

log = logging.getLogger("fastpersist")


def open_direct(path: str, flags: int, same_as: int = -1) -> int:
    """An O_DIRECT descriptor for path, or -1 where the filesystem refuses it
    (tmpfs on older kernels, ramfs, some FUSE and network filesystems).

    same_as: a descriptor already open on path. The second descriptor must
    reach the same file: a symlink or another file planted at the name in
    between is refused, never written through."""
    try:
        injected = _engine.injected_open_error()
        if injected is not None:
            raise injected
        fd = os.open(path, flags | os.O_DIRECT | os.O_CLOEXEC)
    except OSError as exc:
        if exc.errno != errno.EINVAL:
            raise
        log.debug("fastpersist: %s refuses O_DIRECT; using buffered I/O", path)
        return -1
    if same_as >= 0 and not same_file(os.fstat(fd), os.fstat(same_as)):
        os.close(fd)
        raise OSError(errno.EEXIST, "the file was replaced while fastpersist opened it", path)
    return fd


def same_file(a: os.stat_result, b: os.stat_result) -> bool:
    return (a.st_dev, a.st_ino) == (b.st_dev, b.st_ino)


def open_direct_of(fd: int, path: str, flags: int) -> int:
    """An O_DIRECT descriptor of the file ``fd`` is open on (-1 where refused),
    not of whatever ``path`` names by now: a load whose file a concurrent
    save renames a new checkpoint over would otherwise read the new file's
    bytes at the old index's offsets. Opened through /proc/self/fd (the
    open file itself, renamed or deleted); without /proc, by path, and -1
    (reads through ``fd``) where the name names another file by then.

    Also -1 where the re-open is refused (EACCES, EPERM): a re-open is an
    open, checked against the file's mode as it is now and the process's
    credentials as they are now, while ``fd`` was opened before either
    changed (a caller's file object whose file became mode 0000, a process
    that opened its checkpoint and then dropped privileges). torch.load
    reads such a file through the object it was given; so do the reads
    here, through ``fd`` (buffered), never through another descriptor."""
    try:
        return open_direct(f"/proc/self/fd/{fd}", flags, same_as=fd)
    except (FileNotFoundError, PermissionError):
        pass  # no /proc here, or the open file may not be opened again (the same answer by path, below)
    try:
        return open_direct(path, flags, same_as=fd)
    except OSError as exc:
        if exc.errno not in (errno.EEXIST, errno.EACCES, errno.EPERM):
            raise
        log.debug("fastpersist: %s cannot be opened again (%s); reading through its open descriptor",
                  path, os.strerror(exc.errno))
        return -1


@contextlib.contextmanager
def reading_engine(path: str, options: Options, nbytes: int = 0, fd: int = -1):
    """An engine from the pool (for a file of nbytes, where known: see
    _engine.acquire) and an O_DIRECT descriptor for the file (-1 where
    refused or not wanted): of the file ``fd`` is open on where given (see
    open_direct_of), else of path; returned to the pool and closed afterwards."""
    if not options.direct:
        direct_fd = -1
    else:
        direct_fd = open_direct_of(fd, path, os.O_RDONLY) if fd >= 0 else open_direct(path, os.O_RDONLY)
    try:
        engine = _engine.acquire(options, nbytes)
        try:
            yield engine, direct_fd
        finally:
            _engine.release(engine)
    finally:
        if direct_fd >= 0:
            os.close(direct_fd)


def read_extents(engine: _engine.Engine, direct_fd: int, fd: int, path: str, extents, checksums: bool,
                 prefault: bool = False, stop=None) -> dict:
    """Reads (address, offset, nbytes) extents of the file into memory, in as
    few passes as non-overlapping batches allow (tied tensors share file
    bytes). Returns {(offset, nbytes): crc} with checksums, else {}; raises
    EOFError where the file ended early.

    prefault: the destinations may be memory never touched (a model built
    without initialising its weights, as a restart builds it): helper
    threads fault their pages in ahead of the copies, so page faults overlap
    the I/O instead of stalling the engine's copy loop.
    stop: a helper_threads.StopSignal; once set, the engine stops before its
    next buffer and ReadStopped is raised."""
    with prefaulting(extents) if prefault else contextlib.nullcontext():
        return _read_extents(engine, direct_fd, fd, path, extents, checksums, stop)


@contextlib.contextmanager
def prefaulting(extents, threads: int = 0, read_only: bool = False):
    """_Prefault's helpers for the (address, offset, nbytes) extents while the
    block runs. Entered before taking an engine, it faults memory in while a
    new engine is created (in a fresh process: 10-140 ms here to lock and
    register its buffers, which the reads would otherwise wait for).
    threads: at most this many helpers (0: _Prefault.MAX_THREADS).
    read_only: the extents are a mapping of a file to read from, not
    memory to write: its pages are read in (MADV_POPULATE_READ; from the
    device where not cached), never made writable (a private mapping's
    pages would be copied)."""
    with _Prefault(extents, threads, read_only):
        yield


def _read_extents(engine: _engine.Engine, direct_fd: int, fd: int, path: str, extents, checksums: bool,
                  stop=None) -> dict:
    crcs = {}
    # the same bytes into the same memory once: tied weights (an embedding
    # and the output layer) reach here under two names
    pending = sorted({e for e in extents if e[2]}, key=lambda e: (e[1], e[2]))
    while pending:
        batch, rest, end = [], [], -1
        for e in pending:
            if e[1] >= end:
                batch.append(e)
                end = e[1] + e[2]
            else:
                rest.append(e)
        try:
            copied, sums = engine.read_extents(direct_fd, fd, batch, path, checksums=checksums,
                                               stop=None if stop is None else stop.word)
        except OSError as exc:
            if exc.errno == errno.ECANCELED and stop is not None and stop.is_set():
                raise ReadStopped(path) from None
            raise
        if copied != sum(e[2] for e in batch):
            raise EOFError(path)
        if checksums:
            crcs.update(((e[1], e[2]), c) for e, c in zip(batch, sums))
        pending = rest
    return crcs


class _Prefault:
    """Faults in the pages of destination extents, in file order, on helper
    threads (madvise MADV_POPULATE_WRITE, Linux 5.14+; elsewhere the copies
    fault the pages in themselves). Pages already present cost a page-table
    walk; their contents are never changed.

    Two threads where the process may run on two CPUs (the read pipeline
    asks for up to read_threads where there are more), taking alternate
    8 MiB stretches of the destinations so both stay just ahead of the
    reads: faulting in fresh memory is slower than the disk reads on VMs
    like this one (0.5-2 GB/s per thread, the host backing each new page),
    and two threads populated 2 GiB at 1.8-2.8 GB/s where one did at
    1.3-1.55 GB/s. A 2 GB fastpersist.load in a fresh process took 1.11 s
    with two, 1.39 s with one and 1.56 s with three (medians, 8 alternating
    rounds, 2 CPUs)."""

    # below this the threads are not worth starting; above it, they pay even
    # for small checkpoints: a 50 MB load into fresh memory read in 0.025 s
    # with one, 0.046 s without (4 alternating rounds); a 12 MB load in a
    # fresh process, through the page cache, took 12.5 ms with two, 14.8 ms
    # without (medians of 6 alternating processes)
    MIN_BYTES = 4 << 20
    MADV_POPULATE_READ = 22
    MADV_POPULATE_WRITE = 23
    PIECE = 8 << 20
    MAX_THREADS = 2

    def __init__(self, extents, threads: int = 0, read_only: bool = False):
        self._ranges = sorted(((e[1], e[0], e[2]) for e in extents if e[2]), key=lambda r: r[0])
        self._threads = threads
        self._advice = self.MADV_POPULATE_READ if read_only else self.MADV_POPULATE_WRITE
        self._helpers = HelperThreads(name="fastpersist-prefault")

    def __enter__(self) -> "_Prefault":
        ranges = self._ranges
        if sum(r[2] for r in ranges) >= self.MIN_BYTES:
            count = max(1, min(self._threads or self.MAX_THREADS, _usable_cpus()))
            for index in range(count):
                if not self._helpers.start(self._run, ranges, index, count):
                    break  # no more threads: those started do the work, or the copies do
        return self

    def __exit__(self, *exc) -> None:
        # the helpers stop at their next piece whatever the block did: what is left, the copies fault in
        self._helpers.stop.set()
        self._helpers.wait()

    def _run(self, ranges, index: int, count: int) -> None:
        """The pieces whose start falls in stretch index, index + count, ...
        of PIECE bytes, counted over all the ranges together: by bytes, not
        by piece, so a small bias after each weight does not leave one
        thread all the weights."""
        import ctypes

        libc = _libc()
        page = os.sysconf("SC_PAGE_SIZE")
        resident = (ctypes.c_ubyte * (self.PIECE // page))()
        stop = self._helpers.stop
        before = 0  # bytes of the ranges before this piece
        for _, address, nbytes in ranges:
            lo = -(-address // page) * page
            hi = (address + nbytes) // page * page
            while lo < hi and not stop.is_set():
                n = min(self.PIECE, hi - lo)
                # mincore first: walking pages already in (a model that was
                # trained, not just built) cost 0.05-0.14 s of CPU per 2 GB
                # here, taken from the engine's threads; mincore, 2 ms
                if (before // self.PIECE) % count == index and (
                        libc.mincore(lo, n, resident) != 0 or 0 in ctypes.string_at(resident, -(-n // page))):
                    if libc.madvise(lo, n, self._advice) != 0:
                        # an older kernel, or memory it will not populate:
                        # all helpers stop, the copies fault the rest in
                        stop.set()
                        return
                before += n
                lo += n


def _usable_cpus() -> int:
    """CPUs this process may run on (its affinity; not a cgroup's quota)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


@functools.lru_cache(maxsize=None)
def _libc():
    """libc with madvise and mincore typed (looked up once)."""
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
    libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    return libc


def cached_fraction(fd: int, size: int, offset: int = 0) -> "float | None":
    """The fraction of an open file's size bytes from offset (its first
    ones by default) in the page cache, or None where it cannot be told."""
    raw = resident_pages(fd, size, offset)
    if raw is None:
        return None
    return (len(raw) - raw.count(0)) / len(raw) if raw else 0.0


def resident_pages(fd: int, size: int, offset: int = 0) -> "bytes | None":
    """One byte per page of an open file's size bytes from offset (the page
    holding offset first), non-zero where the page is in the page cache
    (mincore over a read-only shared mapping of them, made and unmade
    here); None where it cannot be told."""
    import ctypes
    import mmap

    size += offset % mmap.PAGESIZE  # a mapping starts on a page
    offset -= offset % mmap.PAGESIZE
    if size <= 0:
        return b""
    libc = _libc()
    address = libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, offset)
    if address in (None, ctypes.c_void_p(-1).value):
        return None
    try:
        pages = -(-size // mmap.PAGESIZE)
        resident = ctypes.create_string_buffer(pages)
        if libc.mincore(address, size, resident) != 0:
            return None
        return resident.raw  # one byte a page; its low bit: resident (the others are reserved, zero today)
    finally:
        libc.munmap(address, size)
