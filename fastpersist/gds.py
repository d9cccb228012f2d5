"""The GPUDirect Storage data path: each large record's 4 KiB-aligned middle
moves between the file and device memory with cuFile, its unaligned edges
(and every other byte of the file) through the engine's buffers.

A save ends the engine's write stream where a middle begins (an aligned
offset, so nothing is left half-written), has cuFile write the middle, and
begins the stream again after it; a load reads the file's other bytes in
runs through the engine and the middles with cuFile. Either way the file is
byte for byte what the bounce path writes, and the bytes are the device's
as of the call: the device's current stream is synchronized before cuFile
touches them (cuFile is not stream-ordered).

CRC-32s of the middles are computed on their device (fastpersist.device_crc)
and combined with the edges' (computed by the engine): ``gds`` keeps
``compute_crc32`` and load-time verification as they are on the bounce path.

Per-file fallback: cuFile can open its driver and still refuse a file
(its filesystem, a handle it cannot register) or fail an I/O in it. The
file's records, from there on, then go through the engine's buffers whole;
the reason is logged once (a warning where ``transfer="gds"`` was asked
for, information under ``auto``) and counted in ``stats()``, which the GPU
benchmark prints.

Tests drive this same code with CPU storages and a stand-in for cuFile that
moves the middles with pwrite and pread (``STAND_IN_FOR_CPU``): they check
the splitting, the stream's end and restart, the CRCs and the fallbacks on
this machine. They stand in for the cuFile calls, never for a GPU test.
"""
from __future__ import annotations

import collections
import logging
import os
import threading
from typing import Optional

from . import cufile

log = logging.getLogger("fastpersist")

ALIGNMENT = 4096
MIN_BYTES = 1 << 20  # a smaller middle goes through the buffers: a cuFile call and a sync cost more than it saves

STAND_IN_FOR_CPU = False  # tests: CPU storages take this path, their middles moved by _HostStandIn

_stats_lock = threading.Lock()
_stats = {"files": 0, "bytes_written": 0, "bytes_read": 0, "fallbacks": collections.Counter(),
          "device_aligned": 0, "device_unaligned": 0}
_reported: set = set()


def stats() -> dict:
    """What the data path did in this process: files it moved middles of,
    bytes written and read by cuFile, files or records that fell back to
    the engine's buffers, by reason, and how many middles began at a 4 KiB-
    aligned device address (``device_aligned``) or not (``device_unaligned``:
    native GDS stages those through cuFile's own buffers, slower)."""
    with _stats_lock:
        out = dict(_stats)
        out["fallbacks"] = dict(_stats["fallbacks"])
        out["mode"] = cufile.driver_mode() or ("stand-in (tests)" if STAND_IN_FOR_CPU else "")
        return out


def reset_stats() -> None:
    with _stats_lock:
        _stats.update(files=0, bytes_written=0, bytes_read=0, fallbacks=collections.Counter(), device_aligned=0,
                      device_unaligned=0)


def _count(key: str, n: int = 1) -> None:
    with _stats_lock:
        _stats[key] += n


def fall_back(path: str, reason: str, asked_for_gds: bool = True) -> None:
    """Counts a fallback to the buffers and logs its reason once (a warning
    where transfer="gds" was asked for; under "auto", information)."""
    with _stats_lock:
        _stats["fallbacks"][reason] += 1
        first = reason not in _reported
        _reported.add(reason)
    if first:
        log.log(logging.WARNING if asked_for_gds else logging.INFO,
                "fastpersist: GPUDirect Storage refused %s, which goes through the engine's buffers: %s "
                "(said once per reason; fastpersist.gds.stats() counts them)", path, reason)


def aligned_middle(offset: int, nbytes: int, min_bytes: Optional[int] = None) -> Optional[tuple]:
    """(head, middle): the bytes before the first aligned file offset of
    [offset, offset + nbytes) and the length of the aligned run after
    them, where that run is at least min_bytes (MIN_BYTES); else None."""
    start = -(-offset // ALIGNMENT) * ALIGNMENT
    stop = (offset + nbytes) // ALIGNMENT * ALIGNMENT
    if stop - start < (MIN_BYTES if min_bytes is None else min_bytes) or stop <= start:
        return None
    return start - offset, stop - start


def takes(device, transfer: str, allow_compat: bool) -> bool:
    """Whether storages on device move with this data path (raises
    GdsUnavailable for transfer="gds" where it cannot run)."""
    if device.type == "cuda":
        return cufile.transfer_for(transfer, allow_compat) == "gds"
    return STAND_IN_FOR_CPU and device.type == "cpu"


class DeviceFile:
    """One file's cuFile handle, registered once and shared by the storages
    of every GPU (a handle belongs to the file, not to a device), or, for CPU
    storages in tests, the stand-in. write()/read() move a 1-D uint8
    tensor's bytes at a file offset and raise GdsError where cuFile fails;
    the first failure closes the handle (``usable`` turns False): the rest
    of the file goes through the buffers, not through one failure per
    record. close() deregisters."""

    def __init__(self, path: str, fd: int, cuda: bool):
        self.path = path
        self._handle = None
        self._driver = None
        self._fd = fd
        if cuda:
            self._driver = cufile.driver()
            self._handle = self._driver.register(fd, path)
        else:
            _HostStandIn.register(path)
        self.usable = True
        _count("files")

    def write(self, source, offset: int) -> None:
        self._move(True, source, offset)
        _count("bytes_written", source.numel())

    def read(self, target, offset: int) -> None:
        self._move(False, target, offset)
        _count("bytes_read", target.numel())

    def _move(self, write: bool, tensor, offset: int) -> None:
        if not self.usable:
            raise cufile.GdsError(f"{self.path}: cuFile failed earlier in this file", reason="failed earlier")
        # the middle is aligned in the file; in device memory it is where the tensor's bytes are
        _count("device_aligned" if tensor.data_ptr() % ALIGNMENT == 0 else "device_unaligned")
        try:
            if self._driver is None:
                _HostStandIn.move(self._fd, write, tensor, offset, self.path)
                return
            import torch

            if not tensor.is_contiguous():
                raise ValueError("GPUDirect Storage moves contiguous bytes only")
            with torch.cuda.device(tensor.device):  # cuFile acts in the current device's context
                # queued kernels that write (save) or last used (a fresh load target's memory) these bytes go first
                torch.cuda.current_stream(tensor.device).synchronize()
                self._driver.transfer(self._handle, write, tensor.data_ptr(), tensor.numel(), offset, self.path)
        except cufile.GdsError:
            self.close()
            raise

    def close(self) -> None:
        self.usable = False
        if self._handle is not None:
            handle, self._handle = self._handle, None
            self._driver.deregister(handle)


def open_file(path: str, direct_fd: int, fd: int, cuda: bool, asked_for_gds: bool = True) -> Optional[DeviceFile]:
    """A DeviceFile for path, or None (counted and logged) where cuFile
    refuses it. Native GDS needs the O_DIRECT descriptor; the stand-in
    (cuda False) takes the buffered one."""
    use = fd
    if cuda:
        use = direct_fd if direct_fd >= 0 else fd
        if direct_fd < 0 and cufile.driver_mode().startswith("native"):
            fall_back(path, "the file could not be opened with O_DIRECT, which nvidia-fs needs", asked_for_gds)
            return None
    try:
        return DeviceFile(path, use, cuda)
    except cufile.GdsError as exc:
        fall_back(path, exc.reason, asked_for_gds)
        return None


class _HostStandIn:
    """The tests' stand-in for cuFile, for CPU storages: pwrite and pread on
    the buffered descriptor. FAIL_WRITE_AT / FAIL_READ_AT make the call
    that moves bytes at that file offset raise GdsError (a failing cuFile)."""

    FAIL_WRITE_AT: Optional[int] = None
    FAIL_READ_AT: Optional[int] = None
    REFUSE_FILES = False  # registration refused, as cuFile refuses a filesystem

    @classmethod
    def register(cls, path: str) -> None:
        if cls.REFUSE_FILES:
            raise cufile.GdsError(f"cuFileHandleRegister refused {path}: CU_FILE_IO_NOT_SUPPORTED (test stand-in)",
                                  reason="cuFileHandleRegister refused the file: CU_FILE_IO_NOT_SUPPORTED "
                                         "(test stand-in)")

    @classmethod
    def move(cls, fd: int, write: bool, tensor, offset: int, path: str) -> None:
        from . import _engine

        if (cls.FAIL_WRITE_AT if write else cls.FAIL_READ_AT) == offset:
            call = "cuFileWrite" if write else "cuFileRead"
            raise cufile.GdsError(f"{call} at offset {offset} of {path} failed (test stand-in)",
                                  reason=f"{call} failed (test stand-in)")
        view = _engine.memory_at(tensor.data_ptr(), tensor.numel())
        done = 0
        while done < len(view):
            n = (os.pwrite(fd, view[done:], offset + done) if write
                 else os.preadv(fd, [memoryview(view)[done:]], offset + done))
            if n == 0:
                raise EOFError(path)
            done += n
