"""fastpersist's read pipeline: how a file's bytes reach the memory a load
asked for. Every load (torch files, load_into, safetensors) hands it
(address, offset, nbytes) extents and reads through it; what differs
between them is planning what goes where, not how bytes move.

The source decides the mode, per file:

- **through the page cache**, in parallel: the file is (nearly) all in the
  page cache (just written, read before, or on tmpfs), or it is small and
  no engine is idle (creating one locks and registers its buffers, which
  costs more than reading a small file). ``read_threads`` threads each
  pread their own pieces straight into the destinations, faulting fresh
  memory in as they go. One thread tops out far below memory's speed: here
  (2 CPUs) a 1 GiB cached file read into fresh memory at 0.4-0.8 GB/s with
  one thread and 2.6-3.3 GB/s with two (pages populated ahead of each
  piece); an H100 host read tmpfs at 2.9 GB/s with one and 18.4 with eight.
- **through the engine** otherwise: O_DIRECT into its registered buffers
  (io_uring or libaio), copied out on its helper thread while helper
  threads fault fresh destinations in ahead of the copies
  (fileio.read_extents); the device, not the copy, is the bound there.

Host memory: the destinations, and in engine mode the engine's buffers
(``buffer_size * num_buffers``, pooled); no copy of the file."""
from __future__ import annotations

import contextlib
import ctypes
import mmap
import os
import threading
from typing import Optional

from . import _engine, device_io
from .fileio import _libc, _usable_cpus, cached_fraction, prefaulting, read_extents as engine_read_extents
from .fileio import reading_engine, resident_pages
from .helper_threads import HelperThreads, ReadStopped, StopSignal
from .options import Options

# below this a file with no engine idle is read through the page cache (see above)
SMALL_FILE_BYTES = 64 << 20
# this fraction of a file in the page cache and it is read from there, not from the device again; a
# file less cached is judged span by span, MIXED_SPAN bytes each
CACHED_ENOUGH = 0.9
MIXED_SPAN = 2 << 20

# extents closer than GATHER_GAP are read by one preadv (the gap into a scratch buffer), up to
# GATHER_IOVECS pieces: a checkpoint's small tensors, their records' headers between them
GATHER_GAP = 64 << 10
GATHER_IOVECS = 1024  # the kernel's IOV_MAX
# a larger extent is cut into pieces of PIECE bytes, shared among the threads
PIECE = 8 << 20
# below this in all, one thread reads (starting threads costs ~0.1 ms)
PARALLEL_MIN = 4 << 20
MADV_POPULATE_WRITE = 23


def read_threads(options: Options) -> int:
    """The threads a page-cache read uses (the read_threads option; 0: the
    CPUs this process may run on, at least 2, at most 8: two threads fault
    fresh memory in faster than one even on one CPU's share)."""
    if options.read_threads:
        return options.read_threads
    return max(2, min(8, _usable_cpus()))


def through_page_cache(fd: int, size: int, options: Options, offset: int = 0, nbytes: Optional[int] = None) -> bool:
    """Whether bytes [offset, offset + nbytes) of a file of size bytes are
    read through the page cache: the file is small and no engine is idle,
    or CACHED_ENOUGH of the span is in the page cache already (a tmpfs
    file always is)."""
    nbytes = size - offset if nbytes is None else nbytes
    if size < SMALL_FILE_BYTES and not _engine.has_idle(options, nbytes):
        return True
    return is_cached(fd, nbytes, offset)


def is_cached(fd: int, nbytes: int, offset: int = 0) -> bool:
    """Whether CACHED_ENOUGH of bytes [offset, offset + nbytes) of the file
    are in the page cache (False where that cannot be told)."""
    return (cached_fraction(fd, nbytes, offset) or 0.0) >= CACHED_ENOUGH


def read_extents(fd: int, path: str, size: int, options: Options, extents, checksums: bool, *,
                 fresh: bool = False, started: Optional[threading.Event] = None,
                 stop: Optional[StopSignal] = None) -> dict:
    """Reads (address, offset, nbytes) extents of the open file fd (path
    names it in errors) into memory, in the mode its source calls for.
    Returns {(offset, nbytes): crc} with checksums, else {}; raises EOFError
    where the file ended early, OSError naming the path and offset.

    A file partly in the page cache is read both ways at once: its cached
    spans (MIXED_SPAN bytes each, CACHED_ENOUGH of their pages in) by the
    page-cache readers, the rest by the engine, so that neither mode reads
    what the other does better.

    fresh: the destinations may be memory never touched; its pages are
    faulted in by the readers (page cache) or by helper threads ahead of the
    engine's copies, not one page fault at a time in a copy loop.
    started, if given, is set once only the read's own work is left (the
    caller, waiting to unpickle meanwhile, then goes on).
    stop: set by another thread that gives up on the read (the read runs on
    a thread of its own): it ends at its next piece or engine buffer with
    ReadStopped.

    However the read ends (an error, an interrupt raised in the calling
    thread, stop), no reader, helper or engine is writing into the
    destinations any more when it returns or raises."""
    if size < SMALL_FILE_BYTES and not _engine.has_idle(options, size):
        cached, uncached = extents, []
    else:
        cached, uncached = _split_by_residency(fd, size, extents)
    if not uncached:
        if started is not None:
            started.set()
        return _page_cache_read(fd, path, extents, checksums, options, fresh, stop)
    if not cached:
        return _engine_read(fd, path, size, options, extents, checksums, fresh, started, stop)
    return _read_both_ways(fd, path, size, options, cached, uncached, checksums, fresh, started, stop)


def _page_cache_read(fd: int, path: str, extents, checksums: bool, options: Options, fresh: bool,
                     stop: Optional[StopSignal]) -> dict:
    """pread_extents with read_threads readers, each populating its own
    fresh pages; one reader alone (read_threads=1) has prefault helpers
    beside it instead: populating its pieces itself, it ran a 47 MB load
    at 0.67x the speed of one reader with two helpers here."""
    threads = read_threads(options)
    if fresh and threads == 1:
        with prefaulting(extents):
            return pread_extents(fd, path, extents, checksums, threads=1, stop=stop)
    return pread_extents(fd, path, extents, checksums, threads=threads, populate=fresh, stop=stop)


@contextlib.contextmanager
def engine_for(fd: int, path: str, size: int, options: Options, offset: int = 0, nbytes: Optional[int] = None):
    """(engine, direct_fd) for reads whose consumer takes the engine's
    buffers (GPU loads: device_io.read_into): O_DIRECT where bytes [offset,
    offset + nbytes) are on the device, buffered reads (direct_fd -1) where
    they are in the page cache already, as through_page_cache judges:
    an O_DIRECT read would fetch them from the device again."""
    if through_page_cache(fd, size, options, offset, nbytes):
        options = options.replace(direct=False)
    with reading_engine(path, options, size if nbytes is None else nbytes, fd) as pair:
        yield pair


def read_pieces(fd: int, path: str, size: int, options: Options, pieces: list, checksums: bool = False,
                offset: int = 0, nbytes: Optional[int] = None, stop: Optional[StopSignal] = None) -> dict:
    """Reads device_io pieces (targets on a GPU, or any device) of the open
    file fd: bytes [offset, offset + nbytes) of it hold them all. Where
    through_page_cache says the page cache is the source, read_threads
    readers pread runs of the pieces into staging buffers (page-locked where
    a target is on a GPU), each copying its buffer to the targets on a
    stream of its own while it reads into its other buffer; otherwise the
    engine's buffers (device_io.read_into: O_DIRECT), as where GPUDirect
    Storage takes a piece (its transfer option decides that; "gds" raises
    where GDS cannot run). Returns {(offset,
    nbytes): crc} with checksums, else {}; EOFError where the file ended
    early. Every copy is done when it returns; the targets' current streams
    are the caller's. No reader outlives the call."""
    pieces = [p for p in pieces if p.nbytes]
    if not pieces:
        return {}
    if through_page_cache(fd, size, options, offset, nbytes) and \
            not device_io.takes_direct(pieces, options.transfer, options.allow_gds_compat):
        return _staged_read(fd, path, pieces, read_threads(options), _stage_bytes(options, pieces),
                            checksums, stop)
    with engine_for(fd, path, size, options, offset, nbytes) as (engine, direct_fd):
        return device_io.read_into(engine, direct_fd, fd, path, pieces, checksums=checksums, transfer=options.transfer,
                                   allow_compat=options.allow_gds_compat)


def _stage_bytes(options: Options, pieces: list) -> int:
    """One staging buffer's size: the engine's host memory (buffer_size *
    num_buffers) shared among the readers' two buffers each, a power of two
    from 1 MiB up to buffer_size, no larger than the read needs."""
    budget = options.buffer_size * options.num_buffers // (2 * read_threads(options))
    size = 1 << 20
    while size * 2 <= min(budget, options.buffer_size):
        size *= 2
    total = sum(p.nbytes for p in pieces)
    while size > 1 << 20 and size // 2 >= total:
        size //= 2
    return size


def _stage_chunks(pieces: list, stage_bytes: int) -> list:
    """The staged read's work, in file order: (lo, hi, parts), one pread of
    bytes [lo, hi) (at most stage_bytes; pieces less than GATHER_GAP apart
    share one, the gap read too), then each part (key, a, b) copied: bytes
    [a, b) of the pieces keyed (offset, nbytes) (tied tensors: one read,
    a copy to each)."""
    keys = sorted({(p.offset, p.nbytes) for p in pieces})
    chunks: list = []
    lo = hi = -1
    parts: list = []
    for key in keys:
        at, end = key[0], key[0] + key[1]
        while at < end:
            if lo < 0 or at < lo or at > hi + GATHER_GAP or at >= lo + stage_bytes:
                if lo >= 0:
                    chunks.append((lo, hi, parts))
                lo, hi, parts = at, at, []
            stop = min(end, lo + stage_bytes)
            parts.append((key, at - key[0], stop - key[0]))
            hi, at = max(hi, stop), stop
    if lo >= 0:
        chunks.append((lo, hi, parts))
    return chunks


def _staged_read(fd: int, path: str, pieces: list, threads: int, stage_bytes: int, checksums: bool,
                 stop: Optional[StopSignal] = None) -> dict:
    """read_pieces through the page cache (see there)."""
    chunks = _stage_chunks(pieces, stage_bytes)
    targets: dict = {}
    for p in pieces:
        targets.setdefault((p.offset, p.nbytes), []).append(p)
    pinned = any(p.target.device.type == "cuda" for p in pieces)
    streams = device_io.callers_streams(pieces)
    threads = max(1, min(threads, len(chunks)))
    sums: dict = {}  # (offset, nbytes) -> [(a, crc of bytes [a, b), b - a)]
    state = _Shared(False)
    work = iter(chunks)

    def run(stop: StopSignal) -> None:
        copies = device_io.Copies(streams)
        buffers: list = []  # taken with the first run: a reader left with no work allocates nothing
        tokens: list = [None, None]
        done = False
        try:
            for k, (lo, hi, parts) in enumerate(work):  # a list iterator's next is atomic: one thread per chunk
                if state.error is not None or stop.is_set():
                    break
                if not buffers:
                    buffers.extend(device_io.staging_buffers.take(2, stage_bytes, pinned))
                slot = k % 2
                copies.wait(tokens[slot])  # its last copies have left it
                staged = buffers[slot]
                address = staged.data_ptr()
                _pread_into(fd, path, address, lo, hi - lo)
                to_cpu = []  # (source, destination, nbytes): one C call for the run's CPU targets
                for key, a, b in parts:
                    at = key[0] + a - lo
                    for piece in targets[key]:
                        if piece.address is not None:
                            to_cpu.append((address + at, piece.address + a, b - a))
                        else:
                            copies.copy(piece.target[a:b], staged[at:at + b - a])
                    if checksums:
                        sums.setdefault(key, []).append((a, _engine.crc32_at(address + at, b - a), b - a))
                if to_cpu:
                    _engine.copy_many(to_cpu)
                tokens[slot] = copies.mark()
            for token in tokens:
                copies.wait(token)
            copies.finish()
            done = True
        finally:
            if not done:
                try:
                    copies.abandon()  # the buffers go back only once no copy reads them
                    done = True
                except BaseException:  # noqa: BLE001 - the error in flight is the one raised
                    pass  # copies that cannot be waited for: their buffers are never reused (leaked, registered)
            if buffers and done:
                device_io.staging_buffers.give(buffers, stage_bytes, pinned)

    _run_on_helpers(run, threads, stop, state, path)
    if not checksums:
        return {}
    return {key: _crc_of_parts(part[1:] for part in sorted(parts)) for key, parts in sums.items()}


def _pread_into(fd: int, path: str, address: int, offset: int, nbytes: int) -> None:
    """nbytes of the file at offset into memory at address; EOFError where
    the file ends first, OSError naming the path and offset."""
    view = memoryview((ctypes.c_ubyte * nbytes).from_address(address)).cast("B")
    done = 0
    try:
        while done < nbytes:
            got = os.preadv(fd, [view[done:]], offset + done)
            if got == 0:
                raise EOFError(path)
            done += got
    except OSError as exc:
        raise OSError(exc.errno, f"{os.strerror(exc.errno)} (fastpersist page-cache read at offset "
                                 f"{offset + done})", path) from exc
    finally:
        view.release()


def _engine_read(fd: int, path: str, size: int, options: Options, extents, checksums: bool, fresh: bool,
                 started: Optional[threading.Event], stop: Optional[StopSignal]) -> dict:
    with prefaulting(extents, read_threads(options)) if fresh else contextlib.nullcontext():
        with reading_engine(path, options, size, fd) as (engine, direct_fd):
            if started is not None:
                started.set()
            return engine_read_extents(engine, direct_fd, fd, path, extents, checksums, stop=stop)


def _split_by_residency(fd: int, size: int, extents) -> tuple:
    """([(address, offset, nbytes, whole extent)] in the page cache,
    [...] not), each extent cut where its spans change kind; all of them
    on one side where CACHED_ENOUGH of the file is in (or out), or where
    the page cache cannot be asked."""
    raw = resident_pages(fd, size)
    if raw is None:
        return [], list(extents)
    pages = len(raw)
    if not pages or (pages - raw.count(0)) / pages >= CACHED_ENOUGH:
        return list(extents), []
    per_span = MIXED_SPAN // mmap.PAGESIZE
    spans = []
    for i in range(0, pages, per_span):
        n = min(per_span, pages - i)  # the last span may be short
        spans.append((n - raw.count(0, i, i + n)) / n >= CACHED_ENOUGH)
    if not any(spans):
        return [], list(extents)
    cached, uncached = [], []
    for extent in extents:
        address, offset, nbytes = extent
        at, end = offset, offset + nbytes
        while at < end:
            kind = spans[min(at // MIXED_SPAN, len(spans) - 1)]
            stop = min(end, (at // MIXED_SPAN + 1) * MIXED_SPAN)
            while stop < end and spans[min(stop // MIXED_SPAN, len(spans) - 1)] == kind:
                stop = min(end, stop + MIXED_SPAN)
            (cached if kind else uncached).append((address + at - offset, at, stop - at, extent))
            at = stop
    return cached, uncached


def _read_both_ways(fd: int, path: str, size: int, options: Options, cached: list, uncached: list,
                    checksums: bool, fresh: bool, started: Optional[threading.Event],
                    stop: Optional[StopSignal]) -> dict:
    """The cached pieces by the page-cache readers on a thread of their
    own, the others by the engine on this one, at once; the CRC of each
    extent read in pieces is combined from theirs, in file order."""
    found: dict = {}
    failed: list = []

    def read_cached(signal: StopSignal) -> None:
        try:
            found["cached"] = _page_cache_read(fd, path, [p[:3] for p in cached], checksums, options, fresh,
                                               signal)
        except BaseException as exc:  # noqa: BLE001 - raised by the caller below
            failed.append(exc)
            signal.set()  # the engine's part is of no use now either

    try:
        with HelperThreads(stop) as helpers:
            if not helpers.start(read_cached, helpers.stop):
                read_cached(helpers.stop)
            crcs = _engine_read(fd, path, size, options, [p[:3] for p in uncached], checksums, fresh, started,
                                helpers.stop)
    except ReadStopped:
        if not failed or isinstance(failed[0], ReadStopped):
            raise  # given up on by the caller's caller
    if failed and not isinstance(failed[0], ReadStopped):
        raise failed[0]  # the page-cache side's error, which stopped the engine's side
    if not checksums:
        return {}
    crcs.update(found["cached"])
    pieces: dict = {}  # whole extent -> {(offset, nbytes)} of its pieces (an extent asked twice: once)
    for piece in cached + uncached:
        pieces.setdefault(piece[3][1:], set()).add(piece[1:3])
    return {whole: _crc_of_parts((crcs[part], part[1]) for part in sorted(parts)) for whole, parts in pieces.items()}


def pread_extents(fd: int, path: str, extents, checksums: bool, threads: int = 1, populate: bool = False,
                  stop: Optional[StopSignal] = None) -> dict:
    """Reads (address, offset, nbytes) extents through the page cache with
    up to ``threads`` threads (the caller one of them), straight into each
    destination. Returns {(offset, nbytes): crc} with checksums, else {};
    EOFError where the file ended early; OSError naming the path and offset.
    The same (offset, nbytes) twice is read once (tied weights); other
    overlapping extents each get their bytes.

    populate: fault each piece's pages in (MADV_POPULATE_WRITE) before
    reading into it: one call per piece instead of a fault per page inside
    the copy (2.6 GB/s -> 3.1-3.3 here, two threads, fresh memory).
    stop: once set (by a thread giving up on this read), no more pieces are
    read; ReadStopped is raised once the readers have stopped.

    No reader outlives the call, however it ends (helper_threads)."""
    pending = sorted({e for e in extents if e[2]}, key=lambda e: (e[1], e[2]))
    units = list(_units(pending))
    total = sum(e[2] for e in pending)
    threads = max(1, min(threads, len(units), -(-total // PARALLEL_MIN)))
    pieces: dict = {}  # (offset, nbytes) of an extent read in pieces -> [crc of each piece]
    state = _Shared(populate)
    work = iter(units)

    def run(stop: StopSignal) -> None:
        scratch = memoryview(bytearray(GATHER_GAP))
        for unit in work:  # a list iterator's next is atomic: each unit taken by one thread
            if state.error is not None or stop.is_set():
                return
            _read_unit(fd, path, unit, scratch, checksums, state, pieces)

    _run_on_helpers(run, threads, stop, state, path)
    if not checksums:
        return {}
    crcs = state.crcs
    for (offset, nbytes), sums in pieces.items():
        crcs[offset, nbytes] = _crc_of_parts((crc, min(PIECE, nbytes - i * PIECE)) for i, crc in enumerate(sums))
    return crcs


def _crc_of_parts(parts) -> int:
    """The CRC-32 of consecutive parts, from each one's (crc, nbytes), in order."""
    crc = None
    for part_crc, nbytes in parts:
        crc = part_crc if crc is None else _engine.crc32_combine(crc, part_crc, nbytes)
    return crc


def _run_on_helpers(run, threads: int, stop: Optional[StopSignal], state: "_Shared", path: str) -> None:
    """run(signal) on the calling thread and on up to threads - 1 helper
    threads, which share its work; then raises the first error a helper
    met (state.fail), or ReadStopped where stop was set. The caller reads
    too: whatever it raises (an interrupt included) leaves only once every
    helper has stopped (HelperThreads), and is raised rather than a
    helper's error."""
    def helper(signal: StopSignal) -> None:
        try:
            run(signal)
        except BaseException as exc:  # noqa: BLE001 - handed to the caller
            state.fail(exc)

    with HelperThreads(stop) as helpers:
        for _ in range(threads - 1):
            if not helpers.start(helper, helpers.stop):
                break  # no more threads: those started, and the caller, do the work
        run(helpers.stop)
    if state.error is not None:
        raise state.error
    if stop is not None and stop.is_set():
        raise ReadStopped(path)


class _Shared:
    """What pread_extents' threads share: the first error, the CRCs of whole extents."""

    def __init__(self, populate: bool):
        self.error: Optional[BaseException] = None
        self.crcs: dict = {}
        self.populate = populate
        self._lock = threading.Lock()

    def fail(self, exc: BaseException) -> None:
        with self._lock:
            if self.error is None:
                self.error = exc


def _units(pending: list):
    """The work of a read, in file order: ("run", [extents]) for extents
    near enough to read with one preadv, ("piece", extent, index) for each
    PIECE of a large one."""
    start = 0
    while start < len(pending):
        first = pending[start]
        if first[2] > PIECE:
            for index in range(-(-first[2] // PIECE)):
                yield "piece", first, index
            start += 1
            continue
        stop, end = start + 1, first[1] + first[2]
        size = first[2]
        while stop < len(pending) and 2 * (stop - start) < GATHER_IOVECS and size < PIECE:
            offset = pending[stop][1]
            if offset < end or offset - end > GATHER_GAP or pending[stop][2] > PIECE:
                break
            end = offset + pending[stop][2]
            size += pending[stop][2]
            stop += 1
        yield "run", pending[start:stop]
        start = stop


def _read_unit(fd: int, path: str, unit, scratch: memoryview, checksums: bool, state: _Shared,
               pieces: dict) -> None:
    if unit[0] == "piece":
        _, (address, offset, nbytes), index = unit
        skip = index * PIECE
        n = min(PIECE, nbytes - skip)
        run = [(address + skip, offset + skip, n)]
    else:
        run = unit[1]
    if state.populate:
        _populate(run, state)
    views = [memoryview((ctypes.c_ubyte * n).from_address(address)).cast("B") for address, _, n in run]
    try:
        _pread_run(fd, path, run, views, scratch)
        if not checksums:
            return
        if unit[0] == "piece":
            sums = pieces.get((offset, nbytes))
            if sums is None:
                sums = pieces.setdefault((offset, nbytes), [0] * -(-nbytes // PIECE))  # atomic under the GIL
            sums[index] = _engine.crc32(views[0])
        else:
            for (_, offset, n), view in zip(run, views):
                state.crcs[offset, n] = _engine.crc32(view)
    finally:
        for view in views:
            view.release()


def _pread_run(fd: int, path: str, run: list, views: list, scratch: memoryview) -> None:
    """One preadv for extents in file order with small gaps between them
    (the gaps into scratch); piece by piece where it comes back short."""
    iov, position = [], run[0][1]
    for (_, offset, nbytes), view in zip(run, views):
        if offset > position:
            iov.append(scratch[:offset - position])
        iov.append(view)
        position = offset + nbytes
    at = run[0][1]
    try:
        got = os.preadv(fd, iov, at)
        if got != position - run[0][1]:  # a short read (the file ended, or a signal): piece by piece
            for (_, offset, nbytes), view in zip(run, views):
                done = 0
                while done < nbytes:
                    at = offset + done
                    n = os.preadv(fd, [view[done:]], at)
                    if n == 0:
                        raise EOFError(path)
                    done += n
    except OSError as exc:  # named as the engine's errors are: errno, path, operation, offset
        raise OSError(exc.errno, f"{os.strerror(exc.errno)} (fastpersist page-cache read at offset {at})",
                      path) from exc


def _populate(run: list, state: _Shared) -> None:
    """Faults in the whole pages of a unit's destinations not in memory yet
    (mincore first: populating pages already in walks them, 0.05-0.14 s of
    CPU per 2 GB here, where mincore takes 2 ms); where the kernel will not
    (before Linux 5.14; memory it cannot populate), stops asking: the reads
    fault pages in themselves."""
    libc = _libc()
    page = mmap.PAGESIZE
    for address, _, nbytes in run:
        lo = -(-address // page) * page
        hi = (address + nbytes) // page * page
        if hi <= lo:
            continue
        resident = (ctypes.c_ubyte * ((hi - lo) // page))()
        if libc.mincore(lo, hi - lo, resident) == 0 and 0 not in bytes(resident):
            continue
        if libc.madvise(lo, hi - lo, MADV_POPULATE_WRITE) != 0:
            state.populate = False
            return


__all__ = ["CACHED_ENOUGH", "SMALL_FILE_BYTES", "engine_for", "is_cached", "pread_extents", "read_extents",
           "read_pieces", "read_threads", "through_page_cache"]
