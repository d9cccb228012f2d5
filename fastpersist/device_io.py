"""Storages on any device filled from the engine's buffers, one buffer at a
time, so that loading a GPU's checkpoint needs no host copy of it: host
memory stays the engine's buffers.

``read_into`` drives the engine's pull read (Engine.read_begin/next/release):
each buffer the engine hands over is copied into the storages it overlaps,
and given back to the engine once those copies are done. Copies to a CUDA
storage run without blocking on a side stream of its device, which first
waits for the caller's current stream; an event recorded after a buffer's
copies says when the buffer may be read into again, and the current stream
waits for the side streams before read_into returns, so work queued after
the load sees the bytes. Copies to a CPU storage are plain copies: the same
code, which tests force CPU storages through (they stand in for a device
that cannot be tested on this machine, never for a GPU test).

The engine's buffers are registered with CUDA (page-locked, so the copies
are DMA without a staging copy) once per engine, and unregistered before
the engine unmaps them; never in a forked child (a registration is the
creating process's). A refused registration is cleared from CUDA's error
state, reported once, and the copies then go through CUDA's staging.

CUDA is touched only when a CUDA storage is met.
"""
from __future__ import annotations

import bisect
import collections
import ctypes
import logging
import os
from typing import Callable, Optional

from . import _engine, cufile, gds

log = logging.getLogger("fastpersist")


class Piece:
    """``nbytes`` file bytes at ``offset`` become the bytes of ``target``: a
    contiguous CPU tensor of nbytes bytes (copied to by address, ``address``),
    or a 1-D uint8 tensor of nbytes elements on another device."""

    __slots__ = ("offset", "nbytes", "target", "address")

    def __init__(self, offset: int, nbytes: int, target):
        self.offset, self.nbytes, self.target = offset, nbytes, target
        self.address = target.data_ptr() if target.device.type == "cpu" else None

    def part(self, lo: int, hi: int) -> "Piece":
        """The piece for bytes [lo, hi) of this one, its target a uint8 view."""
        return Piece(self.offset + lo, hi - lo, self.byte_range(lo, hi))

    def byte_range(self, lo: int, hi: int):
        """Bytes [lo, hi) of the target, as a 1-D uint8 tensor over them."""
        import torch

        target = self.target
        if target.dtype != torch.uint8 or target.dim() != 1:
            if not target.is_contiguous():
                raise ValueError("a piece's target must be contiguous")
            target = target.reshape(-1).view(torch.uint8)  # contiguous: a view of the same bytes
        return target[lo:hi]


def byte_view(storage):
    """A storage as a 1-D uint8 tensor over all its bytes, on its device."""
    import torch

    return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)


def read_into(engine: _engine.Engine, direct_fd: int, fd: int, path: str, pieces: list,
              checksums: bool = False, transfer: str = "auto", allow_compat: bool = False) -> dict:
    """Reads every piece's bytes (pieces may share bytes: tied tensors):
    through the engine's buffers in one pass over the span that covers
    them, or, where GPUDirect Storage takes a piece's aligned middle (see
    _direct_middles), the other bytes in runs between the middles and the
    middles with cuFile. Returns {(offset, nbytes): crc} with checksums,
    else {}; raises EOFError where the file ends early.
    transfer, allow_compat: the options of those names (see cufile.transfer_for)."""
    pieces = [p for p in pieces if p.nbytes]
    if not pieces:
        return {}
    middles = _direct_middles(pieces, transfer, allow_compat)
    if not middles:
        start = min(p.offset for p in pieces)
        end = max(p.offset + p.nbytes for p in pieces)
        return PullRead(engine, direct_fd, fd, path, start, end).deliver(pieces, checksums, transfer, allow_compat)
    return _read_with_middles(engine, direct_fd, fd, path, pieces, middles, checksums, transfer, allow_compat)


def takes_direct(pieces: list, transfer: str, allow_compat: bool) -> bool:
    """Whether GPUDirect Storage would read part of these pieces."""
    return bool(_direct_middles([p for p in pieces if p.nbytes], transfer, allow_compat))


def _direct_middles(pieces: list, transfer: str, allow_compat: bool) -> dict:
    """{index of a piece: (head, middle)} for the pieces whose aligned
    middle GPUDirect Storage reads: on a device it takes, large enough, and
    no other piece sharing the middle's bytes (those go through the buffers
    whole). Raises GdsUnavailable for transfer="gds" where GDS cannot run."""
    takes: dict = {}
    found = {}
    for i, p in enumerate(pieces):
        device = p.target.device
        if device.type == "cpu" and not gds.STAND_IN_FOR_CPU:
            continue
        if device not in takes:
            takes[device] = gds.takes(device, transfer, allow_compat)
        split = gds.aligned_middle(p.offset, p.nbytes) if takes[device] else None
        if split is not None:
            found[i] = split
    if found:  # drop the middles another piece shares bytes with: one sweep over the pieces by offset
        order = sorted(range(len(pieces)), key=lambda i: pieces[i].offset)
        starts = [pieces[i].offset for i in order]
        top: list = []  # per prefix of order: (largest end, its piece, second largest end)
        best = (-1, -1, -1)
        for i in order:
            end = pieces[i].offset + pieces[i].nbytes
            if end > best[0]:
                best = (end, i, best[0])
            elif end > best[2]:
                best = (best[0], best[1], end)
            top.append(best)
        for i, (head, middle) in list(found.items()):
            a = pieces[i].offset + head
            b = a + middle
            k = bisect.bisect_left(starts, b)  # the pieces starting before the middle ends
            if k:
                end, owner, second = top[k - 1]
                if (second if owner == i else end) > a:
                    del found[i]
    return found


def _read_with_middles(engine, direct_fd: int, fd: int, path: str, pieces: list, middles: dict,
                       checksums: bool, transfer: str, allow_compat: bool) -> dict:
    """read_into where GPUDirect Storage reads the middles: in file order,
    each run of other bytes through the engine, then the next middle with
    cuFile. A file or a middle cuFile refuses goes through the buffers."""
    files: dict = {}  # is CUDA's -> gds.DeviceFile or None: one handle serves every GPU
    asked_for_gds = transfer == "gds"
    try:
        for i in middles:
            cuda = pieces[i].target.device.type == "cuda"
            if cuda not in files:
                files[cuda] = gds.open_file(path, direct_fd, fd, cuda, asked_for_gds)
        middles = {i: split for i, split in middles.items()
                   if files[pieces[i].target.device.type == "cuda"] is not None}
        host = []  # what the engine reads: every piece but the middles
        for i, p in enumerate(pieces):
            if i not in middles:
                host.append(p)
                continue
            head, middle = middles[i]
            for lo, hi in ((0, head), (head + middle, p.nbytes)):
                if hi > lo:
                    host.append(p.part(lo, hi))
        order = sorted(middles, key=lambda i: pieces[i].offset)
        host.sort(key=lambda p: p.offset)
        crcs: dict = {}
        mid_crcs: dict = {}
        k = 0
        for i in order + [None]:
            stop = pieces[i].offset + middles[i][0] if i is not None else None
            run = []
            while k < len(host) and (stop is None or host[k].offset < stop):
                run.append(host[k])
                k += 1
            if run:
                start, end = min(p.offset for p in run), max(p.offset + p.nbytes for p in run)
                crcs.update(PullRead(engine, direct_fd, fd, path, start, end).deliver(run, checksums, transfer,
                                                                                      allow_compat))
            if i is None:
                break
            p = pieces[i]
            head, middle = middles[i]
            part = p.byte_range(head, head + middle)
            device_file = files[p.target.device.type == "cuda"]
            try:
                device_file.read(part, p.offset + head)
            except cufile.GdsError as exc:  # this and the file's later middles: through the buffers
                if exc.reason != "failed earlier":
                    gds.fall_back(path, exc.reason, asked_for_gds)
                crcs.update(PullRead(engine, direct_fd, fd, path, p.offset + head, p.offset + head + middle).deliver(
                    [p.part(head, head + middle)], checksums, transfer, allow_compat))
                if checksums:
                    mid_crcs[i] = crcs[p.offset + head, middle]
            else:
                if checksums:
                    from . import device_crc

                    mid_crcs[i] = device_crc.crc32(part)
    finally:
        for device_file in files.values():
            if device_file is not None:
                device_file.close()
    if not checksums:
        return {}
    out = {}
    for i, p in enumerate(pieces):
        if i not in middles:
            out[p.offset, p.nbytes] = crcs[p.offset, p.nbytes]
            continue
        head, middle = middles[i]
        crc = crcs.get((p.offset, head), 0) if head else 0
        crc = _engine.crc32_combine(crc, mid_crcs[i], middle)
        tail = p.nbytes - head - middle
        if tail:
            crc = _engine.crc32_combine(crc, crcs[p.offset + head + middle, tail], tail)
        out[p.offset, p.nbytes] = crc
    return out


class PullRead:
    """The engine's pull read of the file's bytes [start, end), begun at
    once: the engine fills its buffers ahead while the caller still works
    out where the bytes go (a load_into unpickles and plans meanwhile), then
    deliver() copies them out. Exactly one of deliver() and abandon() ends it;
    the engine stays the caller's to release afterwards."""

    def __init__(self, engine: _engine.Engine, direct_fd: int, fd: int, path: str, start: int, end: int):
        self.engine, self.path, self.start, self.end = engine, path, start, end
        engine.read_begin(direct_fd, fd, start, end - start, path)
        self.open = True

    THREADED_COPY = 4 << 20  # a buffer of this many bytes or more is copied out by several threads

    def covers(self, spans) -> bool:
        """Whether every (offset, nbytes) span lies within the read."""
        return all(self.start <= offset and offset + nbytes <= self.end for offset, nbytes in spans)

    def deliver(self, pieces: list, checksums: bool = False, transfer: str = "auto",
                allow_compat: bool = False) -> dict:
        """Copies every piece's bytes to its target; returns {(offset,
        nbytes): crc} with checksums, else {}. Raises EOFError where the file
        ends before the span, ValueError for a piece outside it."""
        engine = self.engine
        pieces = sorted((p for p in pieces if p.nbytes), key=lambda p: (p.offset, p.nbytes))
        if not self.covers([(p.offset, p.nbytes) for p in pieces]):
            self.abandon()
            raise ValueError(f"{self.path}: bytes asked for outside the part of the file read "
                             f"({self.start}..{self.end})")
        self.open = False
        copies = Copies()
        crcs = [0] * len(pieces) if checksums else None
        copy_threads = _copy_threads()
        held: collections.deque = collections.deque()  # (buffer index, its copies' token), oldest first
        first = 0  # pieces before it lie wholly behind the stream
        reached = self.start
        try:
            if any(p.target.device.type == "cuda" for p in pieces):
                cufile.transfer_for(transfer, allow_compat)  # transfer="gds" raises here, naming what is missing
                register_buffers(engine)
            while True:
                # give back the buffers whose copies are done; all held: wait for the oldest
                while held and (len(held) == engine.options.num_buffers or copies.done(held[0][1])):
                    index, token = held.popleft()
                    copies.wait(token)
                    engine.read_release(index)
                got = engine.read_next()
                if got is None:
                    break
                index, address, length, offset = got
                host = None
                stop = offset + length
                while first < len(pieces) and pieces[first].offset + pieces[first].nbytes <= offset:
                    first += 1
                i = first
                to_cpu = []  # (source, destination, nbytes): one C call for the buffer's CPU copies
                while i < len(pieces) and pieces[i].offset < stop:
                    p = pieces[i]
                    lo, hi = max(offset, p.offset), min(stop, p.offset + p.nbytes)
                    if lo < hi:
                        if p.address is not None:
                            to_cpu.append((address + lo - offset, p.address + lo - p.offset, hi - lo))
                        else:
                            host = _host_bytes(address, length) if host is None else host
                            copies.copy(p.target[lo - p.offset:hi - p.offset], host[lo - offset:hi - offset])
                        if crcs is not None:
                            crcs[i] = _engine.crc32(_engine.memory_at(address + lo - offset, hi - lo), crcs[i])
                    i += 1
                if to_cpu:
                    _engine.copy_many(to_cpu, copy_threads if length >= self.THREADED_COPY else 1)
                held.append((index, copies.mark()))
                reached = stop
        except BaseException:
            copies.abandon()
            _end_quietly(engine)
            raise
        # The engine goes back to its pool next, where another save or load may
        # refill its buffers: the device copies out of them must be done first.
        for _, token in held:
            copies.wait(token)
        engine.read_end()
        copies.finish()
        if reached < self.end:
            raise EOFError(self.path)
        return {(p.offset, p.nbytes): c for p, c in zip(pieces, crcs)} if crcs is not None else {}

    def abandon(self) -> None:
        """Ends the read without delivering (its error, if any, is dropped:
        the caller is raising its own, or reading the file another way)."""
        if self.open:
            self.open = False
            _end_quietly(self.engine)


def _copy_threads() -> int:
    """As many threads as torch's own copies use (they run while the engine
    reads the next buffers)."""
    import torch

    return max(1, min(8, torch.get_num_threads()))


def _end_quietly(engine: _engine.Engine) -> None:
    try:
        engine.read_end()
    except OSError:
        pass  # the error being raised already says what went wrong


def _host_bytes(address: int, nbytes: int):
    """A uint8 tensor over host memory (an engine buffer), no copy."""
    import torch

    return torch.frombuffer((ctypes.c_ubyte * nbytes).from_address(address), dtype=torch.uint8)


class Copies:
    """Copies out of engine buffers into storages: CPU targets at once, CUDA
    targets without blocking on a side stream per device. mark() closes the
    copies issued since the last mark: a token that done() and wait() ask
    about; finish() makes each device's current stream wait for them."""

    def __init__(self, callers_streams: Optional[dict] = None):
        self.streams: dict = {}  # CUDA device -> (side stream, the caller's current stream)
        self.since_mark: set = set()  # CUDA devices copied to since the last mark
        # {device: stream}: the current streams of the thread that asked for the read, where the copies
        # run on other threads (whose own current stream is the default one)
        self.callers_streams = callers_streams

    def copy(self, target, source) -> None:
        if target.device.type != "cuda":
            target.copy_(source)
            return
        import torch

        device = target.device
        entry = self.streams.get(device)
        if entry is None:
            current = self.callers_streams.get(device) if self.callers_streams is not None else None
            current = torch.cuda.current_stream(device) if current is None else current
            side = torch.cuda.Stream(device)
            side.wait_stream(current)  # the targets were allocated (and maybe written) there
            entry = self.streams[device] = (side, current)
        with torch.cuda.stream(entry[0]):
            target.copy_(source, non_blocking=True)
        self.since_mark.add(device)

    def mark(self) -> Optional[list]:
        if not self.since_mark:
            return None
        events = []
        for device in self.since_mark:
            event = self._event(device)
            event.record(self.streams[device][0])
            events.append(event)
        self.since_mark = set()
        return events

    @staticmethod
    def _event(device):
        import torch

        with torch.cuda.device(device):
            return torch.cuda.Event()

    @staticmethod
    def done(token) -> bool:
        return token is None or all(event.query() for event in token)

    @staticmethod
    def wait(token) -> None:
        for event in token or ():
            event.synchronize()

    def finish(self) -> None:
        for side, current in self.streams.values():
            current.wait_stream(side)

    def abandon(self) -> None:
        """After a failure: the engine may reuse its buffers only once the
        copies out of them are done."""
        for side, _ in self.streams.values():
            side.synchronize()


def callers_streams(pieces: list) -> dict:
    """{device: the calling thread's current stream} for the CUDA devices
    the pieces' targets are on."""
    devices = {p.target.device for p in pieces if p.target.device.type == "cuda"}
    if not devices:
        return {}
    import torch

    return {device: torch.cuda.current_stream(device) for device in devices}


# ---------------------------------------------------------------------------
# staging buffers: host memory that page-cache readers fill and copies to a
# device drain (read_pipeline.read_pieces), page-locked where a target is
# on a GPU, so that each copy is a DMA that runs while the reader goes on

class StagingBuffers:
    """The process's staging buffers, kept from one load to the next:
    page-locking memory costs milliseconds per buffer, more than a small
    file's read. A page-locked buffer is an anonymous mapping registered
    with CUDA (cudaHostRegister, as the engine's buffers are: torch's own
    pinned allocator would keep them after release()), left out of forked
    children (MADV_DONTFORK). At most KEEP_BYTES are kept; release()
    unregisters them and lets them go. In a forked child the parent's are
    never used or freed."""

    KEEP_BYTES = 256 << 20

    def __init__(self):
        import threading

        self._lock = threading.Lock()
        self._free: dict = {}  # (pinned, nbytes) -> [uint8 tensor]
        self._owners: dict = {}  # address -> (mapping, unregister) of a page-locked buffer

    def take(self, count: int, nbytes: int, pinned: bool) -> list:
        with self._lock:
            kept = self._free.get((pinned, nbytes), [])
            taken = [kept.pop() for _ in range(min(count, len(kept)))]
        try:
            while len(taken) < count:
                taken.append(self._new(nbytes, pinned))
        except BaseException:
            self.give(taken, nbytes, pinned)
            raise
        return taken

    def _new(self, nbytes: int, pinned: bool):
        import mmap

        import torch

        if not pinned:
            return torch.empty(nbytes, dtype=torch.uint8)
        memory = mmap.mmap(-1, nbytes)
        buffer = torch.frombuffer(memory, dtype=torch.uint8)
        unregister = register_host_memory(buffer.data_ptr(), nbytes, "staging buffers")
        if unregister is not None and hasattr(mmap, "MADV_DONTFORK"):
            memory.madvise(mmap.MADV_DONTFORK)  # page-locked pages would be copied into every forked child
        with self._lock:
            self._owners[buffer.data_ptr()] = (memory, unregister)  # mapped while owned: the key stays unique
        return buffer

    def give(self, buffers: list, nbytes: int, pinned: bool) -> None:
        dropped = []
        with self._lock:
            kept = self._free.setdefault((pinned, nbytes), [])
            for buffer in buffers:
                if self._kept_bytes() + nbytes <= self.KEEP_BYTES:
                    kept.append(buffer)
                else:
                    dropped.append(buffer)
        self._drop(dropped)

    def kept_bytes(self) -> int:
        with self._lock:
            return self._kept_bytes()

    def _kept_bytes(self) -> int:
        return sum(nbytes * len(v) for (_, nbytes), v in self._free.items())

    def release(self) -> None:
        with self._lock:
            free, self._free = self._free, {}
        buffers = [b for kept in free.values() for b in kept]
        free.clear()
        self._drop(buffers)

    def _drop(self, buffers: list) -> None:
        """Unregisters page-locked buffers and lets their mappings go: each
        is unmapped when the last tensor over it goes (a tensor made by
        torch.frombuffer holds its mapping); empties buffers."""
        with self._lock:
            owners = [self._owners.pop(b.data_ptr(), None) for b in buffers]
        buffers.clear()
        for owner in owners:
            if owner is not None and owner[1] is not None:
                owner[1]()  # cudaHostUnregister, while the memory is still mapped

    def forget_in_child(self) -> None:
        """After fork, in the child: a fresh lock (another thread may have
        held the parent's), and the parent's buffers set aside for good:
        their ranges are not mapped here (MADV_DONTFORK), so freeing their
        mapping objects would unmap whatever the child has put there since."""
        import threading

        self._lock = threading.Lock()
        keep_forever((self._free, self._owners))
        self._free, self._owners = {}, {}


def keep_forever(obj) -> None:
    """A reference to obj that is never dropped, not even at interpreter
    exit (a forked child's objects over memory only its parent maps)."""
    ctypes.pythonapi.Py_IncRef(ctypes.py_object(obj))


staging_buffers = StagingBuffers()
os.register_at_fork(after_in_child=lambda: staging_buffers.forget_in_child())


def write_storage(source, sink, crc: Optional[int], copiers: Optional[dict] = None) -> Optional[int]:
    """Writes a storage's bytes (``source``, a 1-D uint8 tensor on any
    device) to a FastFileWriter: its aligned middle with GPUDirect Storage
    where the file has a DeviceFile for the device, everything else through
    the engine's buffers (stream_bytes). Alignment is the file's: the
    writer's offset, not the record's place in its plan (a DCP file holds
    many plans one after another). Returns the updated CRC-32 where crc is
    given."""
    device_file_for = getattr(sink, "device_file", None)
    if device_file_for is not None:
        device_file = device_file_for(source.device)  # transfer="gds" raises here where GDS cannot run
    else:
        gds.takes(source.device, sink.options.transfer, sink.options.allow_gds_compat)  # raises as well
        device_file = None
    split = gds.aligned_middle(sink.tell(), source.numel()) if device_file is not None else None
    if split is None:
        return stream_bytes(source, sink, crc, copiers)
    head, middle = split
    crc = stream_bytes(source[:head], sink, crc, copiers)
    part = source[head:head + middle]
    try:
        sink.write_outside(middle, lambda offset: device_file.write(part, offset))
    except cufile.GdsError as exc:  # the file's handle is closed: its other records take the buffers
        gds.fall_back(sink.path, exc.reason, sink.options.transfer == "gds")
        crc = stream_bytes(part, sink, crc, copiers)  # the stream begins again where the middle would have
    else:
        if crc is not None:
            from . import device_crc

            crc = _engine.crc32_combine(crc, device_crc.crc32(part), middle)
    return stream_bytes(source[head + middle:], sink, crc, copiers)


def stream_bytes(source, sink, crc: Optional[int], copiers: Optional[dict] = None) -> Optional[int]:
    """Copies a 1-D uint8 tensor on any device into the sink's engine
    buffers, one reservation at a time (sink.reserve(max) returns a
    writable buffer of at most max bytes; sink.commit(n, crc) appends them),
    so no host copy of the whole tensor is made: host memory stays the
    engine's buffers. Each copy into buffer k overlaps the engine's write of
    buffer k - 1. copiers: {device: ToHost} kept across one file's storages
    (one side stream per device, not one per storage)."""
    import torch

    nbytes = source.numel()
    copiers = {} if copiers is None else copiers
    copier = copiers.get(source.device)
    if copier is None and nbytes:
        copier = copiers[source.device] = ToHost(source.device, sink.io_engine)
    done = 0
    while done < nbytes:
        buffer = sink.reserve(nbytes - done)
        length = len(buffer)
        target = torch.frombuffer(buffer, dtype=torch.uint8)
        try:
            copier.copy(target, source[done:done + length])
        except BaseException:
            sink.commit(0)  # gives the reservation up
            raise
        crc = sink.commit(length, crc)
        done += length
    return crc


class ToHost:
    """Copies a storage on ``device`` into engine buffers, one buffer at a
    time (stream_bytes): for CUDA, without blocking on a side
    stream that first waits for the caller's current stream (kernels still
    queued when the save was called write what the file gets), into buffers
    registered with CUDA; copy() returns once the bytes are in the buffer,
    which the engine writes next while the following copy runs."""

    def __init__(self, device, engine: Optional[_engine.Engine] = None):
        self.side = None
        if device.type == "cuda":
            import torch

            if engine is not None:
                register_buffers(engine)
            self.side = torch.cuda.Stream(device)
            self.side.wait_stream(torch.cuda.current_stream(device))

    def copy(self, target, source) -> None:
        if self.side is None:
            target.copy_(source)
            return
        import torch

        with torch.cuda.stream(self.side):
            target.copy_(source, non_blocking=True)
        self.side.synchronize()


# ---------------------------------------------------------------------------
# registering the engine's buffers with CUDA

_refusal_reported = False


def register_buffers(engine: _engine.Engine) -> bool:
    """Registers the engine's buffers with CUDA once (cudaHostRegister);
    True where they are registered now."""
    if engine.device_registered is not None:
        return engine.device_registered
    unregister = register_host_memory(*engine.buffer_region(), "I/O buffers")
    engine.device_registered = unregister is not None
    if unregister is not None:
        engine.before_destroy(unregister)
    return engine.device_registered


def register_host_memory(address: int, nbytes: int, what: str) -> Optional[Callable[[], None]]:
    """cudaHostRegister of host memory fastpersist owns (page-locked: copies
    between it and a GPU go by DMA, without CUDA's staging). Returns the
    call that unregisters it, to make before the memory is unmapped; None
    where CUDA refuses, said once in the log."""
    import torch

    cudart = torch.cuda.cudart()  # held by the returned call: it may run while Python shuts down
    # cudaHostRegisterDefault: with unified addressing (every 64-bit Linux process) the memory is
    # portable and mapped, so one registration serves copies to and from every GPU of the process
    rc = int(cudart.cudaHostRegister(address, nbytes, 0))
    if rc != 0:
        _clear_cuda_error()
        _report_refusal(rc, nbytes, what)
        return None

    def unregister() -> None:
        try:
            rc = int(cudart.cudaHostUnregister(address))
        except Exception:  # at exit, torch's binding can be torn down before the memory: the process takes both
            return
        if rc != 0:  # at exit, CUDA may be gone before the memory: nothing left to undo then
            _clear_cuda_error()
            log.debug("fastpersist: cudaHostUnregister of %s failed (CUDA error %d)", what, rc)

    return unregister


def _report_refusal(rc: int, nbytes: int, what: str) -> None:
    global _refusal_reported
    if not _refusal_reported:
        _refusal_reported = True
        log.warning("fastpersist: CUDA refused to register %d MiB of %s (cudaHostRegister: CUDA error %d); "
                    "copies between them and the GPU go through CUDA's staging, slower", nbytes >> 20, what, rc)


def _clear_cuda_error() -> None:
    """A failed CUDA runtime call leaves its error as the thread's last one,
    which torch's next kernel-launch check would raise: read it to clear it.
    torch's binding has no cudaGetLastError; the runtime torch loaded has."""
    runtime = _cuda_runtime()
    if runtime is not None:
        runtime.cudaGetLastError()


def _torch_cuda_library() -> Optional[str]:
    import torch

    path = os.path.join(os.path.dirname(torch.__file__), "lib", "libtorch_cuda.so")
    return path if os.path.exists(path) else None


def _cuda_runtime(torch_library: Optional[str] = None):
    """The CUDA runtime torch itself calls, or None. Looked up through
    torch's own CUDA library (dlsym from its handle searches what it was
    linked with), not by name: a process can hold two runtimes (cupy's and
    torch's, say), each with its own last error."""
    torch_library = torch_library or _torch_cuda_library()
    if torch_library is None:
        return None
    try:
        library = ctypes.CDLL(torch_library)
        library.cudaGetLastError  # raises AttributeError where torch's runtime does not export it
    except (OSError, AttributeError):
        return None
    return library
