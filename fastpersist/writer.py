"""FastFileWriter: a write-only file object over the I/O engine."""
from __future__ import annotations

import contextlib
import io
import logging
import os
from typing import Optional

from . import _engine, gds
from .fileio import open_direct
from .options import Options, current_options

log = logging.getLogger("fastpersist")


class FastFileWriter(io.RawIOBase):
    """Writes ``path`` sequentially from ``offset`` through the engine's
    page-locked double buffers with O_DIRECT.

    Several writers may fill disjoint ranges of one file at once (threads,
    processes or ranks): only whole aligned blocks go through O_DIRECT, the
    unaligned edges of each range through the page cache. ``close()`` waits
    for every write and, with the ``fsync`` option, makes the file durable.

    ``exclusive=True`` creates the file and fails if it exists (or if a
    symlink lies at the name); ``truncate=True`` empties an existing file
    first; ``create=False`` fails unless the file exists.

    ``sole_writer=True`` declares that no other writer touches the file while
    this one is open: the writer then extends the file ahead of its writes
    with fallocate (which lets the filesystem run O_DIRECT writes
    concurrently) and, on close, cuts the file to exactly where this writer
    ended, which would cut off bytes another writer put beyond that point.
    Leave it False (the default) whenever writers share a file.
    ``expected_size`` (the file's size when known, as a planned checkpoint's
    is) bounds that extension: allocating 256 MiB ahead and cutting it off
    again costs a 1 MB save about a tenth of its time. It also sizes a new
    engine's buffers to what the file can use (see _engine.acquire).
    """

    PREALLOCATE_STEP = 256 << 20

    def __init__(self, path, offset: int = 0, *, truncate: bool = False, exclusive: bool = False,
                 sole_writer: bool = False, create: bool = True, options: Optional[Options] = None,
                 expected_size: int = 0, **overrides):
        super().__init__()
        self.options = (options or current_options()).replace(**overrides)
        self.path = os.fspath(path)
        if offset < 0:
            raise ValueError(f"offset must be >= 0, got {offset}")
        flags = os.O_WRONLY | os.O_CLOEXEC | (os.O_CREAT if create or exclusive else 0)
        flags |= os.O_EXCL if exclusive else 0
        flags |= os.O_TRUNC if truncate else 0
        self._engine: Optional[_engine.Engine] = None
        self._device_files: dict = {}  # is CUDA's -> gds.DeviceFile, or None (cuFile refused the file)
        self._gds_takes: dict = {}  # device -> whether GPUDirect Storage moves its storages
        self._expected_size, self._sole_writer = expected_size, sole_writer
        self._buffered_fd = os.open(self.path, flags, 0o666)
        self._direct_fd = -1
        try:
            if self.options.direct:
                self._direct_fd = open_direct(self.path, os.O_WRONLY, same_as=self._buffered_fd)
            self._engine = _engine.acquire(self.options, max(0, expected_size - offset))  # a small file's: small
            self._engine.begin(self._direct_fd, self._buffered_fd, offset, self.path,
                               self._preallocation_step(expected_size - offset) if sole_writer else 0)
        except BaseException:
            self._release()
            if exclusive:  # the file is new and ours: leave nothing behind
                with contextlib.suppress(OSError):
                    os.unlink(self.path)
            raise

    def _preallocation_step(self, expected_bytes: int) -> int:
        if expected_bytes <= 0:
            return self.PREALLOCATE_STEP
        return min(self.PREALLOCATE_STEP, -(-expected_bytes // 4096) * 4096)

    # -- io.RawIOBase ---------------------------------------------------
    def writable(self) -> bool:
        return True

    def write(self, data) -> int:
        self._check_open()
        return self._engine.write(data)

    def tell(self) -> int:
        self._check_open()
        return self._engine.tell()

    def flush(self) -> None:
        """Buffered bytes are written by close(); flush() exists for file-like callers."""
        if self.closed:
            raise ValueError(f"I/O operation on closed FastFileWriter for {self.path}")

    def close(self) -> None:
        if self.closed:
            return
        try:
            if self._engine is not None:
                self._engine.end()
                if self.options.fsync:
                    os.fsync(self._buffered_fd)
        except BaseException:
            self.abort()
            raise
        self._release()
        super().close()

    # -- beyond a file object -------------------------------------------
    def write_address(self, address: int, nbytes: int, crc: Optional[int] = None) -> Optional[int]:
        """Writes nbytes of host memory at address; returns the updated CRC-32 if crc is given."""
        self._check_open()
        return self._engine.write_address(address, nbytes, crc)

    def write_zeros(self, nbytes: int) -> None:
        self._check_open()
        self._engine.write_zeros(nbytes)

    def reserve(self, max_bytes: int):
        """A writable buffer of at most max_bytes in the engine's memory: the
        file's next bytes once filled and commit()ed."""
        self._check_open()
        return _engine.memory_at(*self._engine.reserve(max_bytes))

    def commit(self, nbytes: int, crc: Optional[int] = None) -> Optional[int]:
        """Appends nbytes of the reservation; returns the updated CRC-32 if crc is given."""
        self._check_open()
        return self._engine.commit(nbytes, crc)

    def device_file(self, device) -> Optional["gds.DeviceFile"]:
        """This file's GPUDirect Storage handle for storages on device, or
        None where they go through the engine's buffers (the transfer
        option; a file cuFile refused, or failed in). One handle serves
        every GPU. Raises GdsUnavailable for transfer="gds" where GDS
        cannot run."""
        self._check_open()
        takes = self._gds_takes.get(device)
        if takes is None:
            takes = self._gds_takes[device] = gds.takes(device, self.options.transfer, self.options.allow_gds_compat)
        if not takes:
            return None
        cuda = device.type == "cuda"
        if cuda not in self._device_files:
            self._device_files[cuda] = gds.open_file(self.path, self._direct_fd, self._buffered_fd, cuda,
                                                     self.options.transfer == "gds")
        device_file = self._device_files[cuda]
        return device_file if device_file is not None and device_file.usable else None

    def write_outside(self, nbytes: int, write) -> None:
        """The file's next nbytes are written by write(offset) instead of the
        engine (GPUDirect Storage writes a record's middle): the stream ends
        at its offset, which must be 4096-aligned, and begins again after the
        nbytes. Where write raises, the stream begins again at the offset,
        so the caller may send the bytes through the buffers after all."""
        self._check_open()
        offset = self._engine.tell()
        if offset % 4096:
            raise ValueError(f"write_outside at offset {offset} of {self.path}: not 4096-aligned")
        self._engine.end()  # a sole writer's end cuts the file at the offset: allocate the bytes again
        if self._sole_writer:
            with contextlib.suppress(OSError):  # a filesystem without fallocate: writes extend the file
                os.posix_fallocate(self._buffered_fd, offset, nbytes)
        try:
            write(offset)
        except BaseException as exc:
            try:
                self._begin_at(offset)
            except BaseException as again:
                raise again from exc
            raise
        self._begin_at(offset + nbytes)

    def _begin_at(self, offset: int) -> None:
        step = self._preallocation_step(self._expected_size - offset) if self._sole_writer else 0
        self._engine.begin(self._direct_fd, self._buffered_fd, offset, self.path, step)

    @property
    def io_engine(self):
        """The engine writing the file (device_io registers its buffers with CUDA)."""
        return self._engine

    @property
    def engine(self) -> str:
        return self._engine.kind if self._engine else ""

    @property
    def direct(self) -> bool:
        """True while whole blocks still go through O_DIRECT."""
        return self._engine is not None and self._direct_fd >= 0 and self._engine.direct()

    @property
    def fd(self) -> int:
        return self._buffered_fd

    def abort(self) -> None:
        """Stops without writing what is still buffered; closes the file."""
        if self._engine is not None:
            self._engine.abort()
        self._release()
        if not self.closed:
            super().close()

    def _release(self) -> None:
        for device_file in self._device_files.values():
            if device_file is not None:
                device_file.close()
        self._device_files.clear()
        if self._engine is not None:
            _engine.release(self._engine)
            self._engine = None
        for fd in (self._direct_fd, self._buffered_fd):
            if fd >= 0:
                os.close(fd)
        self._direct_fd = self._buffered_fd = -1

    def _check_open(self) -> None:
        if self.closed or self._engine is None:
            raise ValueError(f"I/O operation on closed FastFileWriter for {self.path}")

    def __repr__(self) -> str:
        return f"<FastFileWriter {self.path!r} engine={self.engine or 'closed'}>"
