"""The torch checkpoint format, in one place: the zip layout torch.save
produces (miniz with torch's padding rules), planned whole before a byte is
written (CheckpointPlan), then written (write_plan); and its reading.

A torch checkpoint is a zip archive of stored (uncompressed) records named
``<archive>/...``. Each record has a local header whose "FB" extra field pads
the data to ``storage_alignment``; local headers carry no CRC or sizes (flag
bit 3) and a data descriptor follows the data. Records at or past 4 GiB, or
of 4 GiB or more, carry zip64 extra fields and 64-bit descriptors. The
archive ends with the central directory, a zip64 end record and locator, and
the classic end record. Every offset depends only on record names and sizes,
so the whole layout is known before a byte of tensor data is written.
"""
from __future__ import annotations

import bisect
import ctypes
import errno
import io
import secrets
import struct
import sys
import zlib
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Optional

from .errors import CheckpointError


class ByteOrderError(CheckpointError, ValueError):
    """A byteorder record that is neither 'little' nor 'big': a corrupt file
    (CheckpointError, as every other) and the ValueError torch.load raises
    for it, so code catching either catches it."""


_U32_LIMIT = 0xFFFFFFFF
_LOCAL_HEADER = struct.Struct("<IHHHHHIIIHH")
_U16 = struct.Struct("<H")
_CENTRAL_HEADER = struct.Struct("<I6H3I5H2I")
_FLAGS = 0x0808  # bit 3: sizes and CRC in the data descriptor; bit 11: UTF-8 names
_FLAGS_EMPTY = 0x0800  # miniz writes empty records with no data descriptor
_ZIP64_MADE_BY = 0x031E
_ZIP64_NEEDED = 0x002D


def archive_name_for(path: str) -> str:
    """The record prefix torch.save derives from a destination path: the file
    name without its last extension, or "archive" where torch falls back to a
    Python file object (non-ASCII names). May be empty; torch refuses those."""
    try:
        path.encode("ascii")
    except UnicodeEncodeError:
        return "archive"
    start = max(path.rfind("/"), path.rfind("\\")) + 1
    name = path[start:]
    dot = name.rfind(".")
    return name[:dot] if dot >= 0 else name


def new_serialization_id() -> str:
    """40 decimal digits, like torch's: two random 64-bit numbers, each padded to 20."""
    return f"{secrets.randbits(64):020d}{secrets.randbits(64):020d}"


_produced_version: Optional[bytes] = None


def produced_format_version() -> bytes:
    """Contents of the ``version`` record the installed torch writes (e.g. b"3\\n"),
    read once from a tiny archive written by torch itself."""
    global _produced_version
    if _produced_version is None:
        import io
        import zipfile

        from ._torch_api import empty_archive_from_torch

        with zipfile.ZipFile(io.BytesIO(empty_archive_from_torch())) as z:
            _produced_version = z.read("archive/version")
    return _produced_version


class RecordLayout:
    """Where one record sits in the archive (slots: a checkpoint has a record per storage)."""

    __slots__ = ("name", "header_offset", "data_offset", "size", "zip64", "crc")

    def __init__(self, name: str, header_offset: int, data_offset: int, size: int, zip64: bool, crc: int = 0):
        self.name = name  # full name, with the archive prefix
        self.header_offset = header_offset
        self.data_offset = data_offset
        self.size = size
        self.zip64 = zip64  # zip64 extra field and 64-bit data descriptor
        self.crc = crc

    def __eq__(self, other) -> bool:
        return isinstance(other, RecordLayout) and all(getattr(self, a) == getattr(other, a) for a in self.__slots__)

    def __repr__(self) -> str:
        return "RecordLayout(" + ", ".join(f"{a}={getattr(self, a)!r}" for a in self.__slots__) + ")"

    @property
    def flags(self) -> int:
        return _FLAGS if self.size else _FLAGS_EMPTY

    @property
    def descriptor_size(self) -> int:
        if not self.size:
            return 0
        return 24 if self.zip64 else 16

    @property
    def end(self) -> int:
        return self.data_offset + self.size + self.descriptor_size


def aligned_data_offset(header_offset: int, name_length: int, size: int, alignment: int) -> int:
    """Where torch's zip writer (and ZipLayout) puts the data of a record
    whose local header is at header_offset: after the header, the name, a
    zip64 extra field where the size or the offset needs one (4 bytes of
    field header, 16 for the sizes, 8 for the offset) and an "FB" field whose
    padding aligns the data."""
    start = header_offset + _LOCAL_HEADER.size + name_length + 4
    if size >= _U32_LIMIT or header_offset >= _U32_LIMIT:
        start += 4 + (16 if size >= _U32_LIMIT else 0) + (8 if header_offset >= _U32_LIMIT else 0)
    return start + -start % alignment


class ZipLayout:
    """Assigns offsets to records in order and builds their header bytes."""

    def __init__(self, archive_name: str, alignment: int = 64, start: int = 0):
        if not 0 < alignment <= 65536:
            # The padding's length is a 16-bit field: torch itself writes a
            # corrupt archive past this, so refuse clearly instead.
            raise ValueError(f"storage_alignment must be between 1 and 65536, got {alignment}")
        self.prefix = archive_name + "/"
        self.alignment = alignment
        self.cursor = start
        self.records: list[RecordLayout] = []

    def add(self, name: str, size: int) -> tuple[RecordLayout, bytes]:
        """Places a record at the cursor; returns it and its local header bytes."""
        full = (self.prefix + name).encode("utf-8")
        offset = self.cursor
        if size < _U32_LIMIT and offset < _U32_LIMIT:  # no zip64 field: nearly every record
            start = offset + _LOCAL_HEADER.size + len(full) + 4
            padding = -start % self.alignment
            header = _LOCAL_HEADER.pack(0x04034B50, 0, _FLAGS if size else _FLAGS_EMPTY, 0, 0, 0, 0, 0, 0, len(full),
                                        4 + padding) + full + b"FB" + _U16.pack(padding) + b"Z" * padding
            record = RecordLayout(self.prefix + name, offset, start + padding, size, False)
            self.records.append(record)
            self.cursor = start + padding + size + (16 if size else 0)
            return record, header
        zip64_extra = b""
        if size >= _U32_LIMIT or offset >= _U32_LIMIT:
            fields = b""
            if size >= _U32_LIMIT:
                fields += struct.pack("<QQ", size, 0)  # compressed size is unknown here
            if offset >= _U32_LIMIT:
                fields += struct.pack("<Q", offset)
            zip64_extra = struct.pack("<HH", 1, len(fields)) + fields
        padding = aligned_data_offset(offset, len(full), size, self.alignment) - (
            offset + _LOCAL_HEADER.size + len(full) + len(zip64_extra) + 4)
        extra = zip64_extra + b"FB" + struct.pack("<H", padding) + b"Z" * padding
        flags = _FLAGS if size else _FLAGS_EMPTY
        header = _LOCAL_HEADER.pack(0x04034B50, 0, flags, 0, 0, 0, 0, 0, 0, len(full), len(extra))
        header += full + extra
        record = RecordLayout(full.decode("utf-8"), offset, offset + len(header), size, bool(zip64_extra))
        self.records.append(record)
        self.cursor = record.end
        return record, header

    @staticmethod
    def descriptor(record: RecordLayout) -> bytes:
        """The data descriptor after the record's data, with its CRC as set now."""
        crc = record.crc
        if not record.size:
            return b""
        return (_DESCRIPTOR64 if record.zip64 else _DESCRIPTOR).pack(0x08074B50, crc, record.size, record.size)

    def central_directory_size(self) -> int:
        """The length of central_directory(), without building it."""
        total = 56 + 20 + 22  # zip64 end record, its locator, end record
        for r in self.records:
            fields = 16 * (r.size >= _U32_LIMIT) + 8 * (r.header_offset >= _U32_LIMIT)
            total += _CENTRAL_HEADER.size + len(r.name.encode("utf-8")) + (4 + fields if fields else 0)
        return total

    def central_directory(self) -> bytes:
        """Central directory and end records for the records placed so far,
        starting at the cursor (which it leaves where it is). Its length
        depends on names, sizes and offsets only, not on the CRCs."""
        cd_offset = self.cursor
        parts = []
        for r in self.records:
            name = r.name.encode("utf-8")
            big_size = r.size >= _U32_LIMIT
            big_offset = r.header_offset >= _U32_LIMIT
            fields = (struct.pack("<QQ", r.size, r.size) if big_size else b"") + (
                struct.pack("<Q", r.header_offset) if big_offset else b""
            )
            extra = struct.pack("<HH", 1, len(fields)) + fields if fields else b""
            size32 = _U32_LIMIT if big_size else r.size
            parts.append(
                _CENTRAL_HEADER.pack(
                    0x02014B50, 0, 0, r.flags, 0, 0, 0, r.crc, size32, size32, len(name), len(extra),
                    0, 0, 0, 0, _U32_LIMIT if big_offset else r.header_offset,
                )
                + name
                + extra
            )
        cd = b"".join(parts)
        count = len(self.records)
        zip64_end_offset = cd_offset + len(cd)
        zip64_end = struct.pack(
            "<IQHHIIQQQQ", 0x06064B50, 44, _ZIP64_MADE_BY, _ZIP64_NEEDED, 0, 0, count, count, len(cd), cd_offset
        )
        locator = struct.pack("<IIQI", 0x07064B50, 0, zip64_end_offset, 1)
        end = struct.pack(
            "<IHHHHIIH", 0x06054B50, 0, 0, min(count, 0xFFFF), min(count, 0xFFFF),
            min(len(cd), _U32_LIMIT), min(cd_offset, _U32_LIMIT), 0,
        )
        return cd + zip64_end + locator + end


@dataclass
class RecordSource:
    """What one record holds: bytes, a CPU storage (its memory, not a copy),
    or neither: space reserved by skip_data, written as zeros with CRC 0."""

    name: str  # without the archive prefix
    nbytes: int
    data: Optional[bytes] = None
    storage: object = None  # a torch.UntypedStorage, or a uint8 tensor (a snapshot's slice)


class RecordingZipWriter:
    """Stands in for ``torch._C.PyTorchFileWriter`` inside
    ``torch.serialization._save`` and records what torch hands it, writing
    nothing, so the whole archive can be planned before a byte is written.
    Storages reach it as torch hands them over, or captured on their device
    (see ``_torch_api.pickle_into``) and attached to their records."""

    def __init__(self):
        self.records: list[RecordSource] = []

    def write_record(self, name: str, data, nbytes: int) -> None:
        import torch

        if isinstance(data, (torch.UntypedStorage, torch.TypedStorage)):
            storage = data.untyped() if isinstance(data, torch.TypedStorage) else data
            self.records.append(RecordSource(name, nbytes, storage=storage))
            return
        if isinstance(data, str):
            data = data.encode("utf-8")
        self.records.append(RecordSource(name, nbytes, data=bytes(memoryview(data).cast("B")[:nbytes])))

    def write_record_metadata(self, name: str, nbytes: int) -> None:
        self.records.append(RecordSource(name, nbytes))

    def record_plain_pickle(self, plain, alignment: int, disable_byteorder_record: bool) -> None:
        """The records torch's _save hands over for a pickle plain_pickle
        wrote, in its order: the pickle, format version, storage alignment,
        byte order, then each storage (on its device) under its key."""
        self.write_record("data.pkl", plain.data, len(plain.data))
        self.write_record(".format_version", "1", 1)
        self.write_record(".storage_alignment", str(alignment), len(str(alignment)))
        if not disable_byteorder_record:
            self.write_record("byteorder", sys.byteorder, len(sys.byteorder))
        for key, storage in plain.storages.items():
            self.records.append(RecordSource(f"data/{key}", storage.nbytes(), storage=storage))

    def attach(self, storages: dict) -> bool:
        """Gives each storage record written as metadata only its captured
        storage (by key, ``data/<key>``); False, changing nothing, where one has none."""
        found = []
        for r in self.records:
            if r.data is None and r.storage is None and r.nbytes:
                storage = storages.get(r.name[5:]) if r.name.startswith("data/") else None
                if storage is None or storage.nbytes() != r.nbytes:
                    return False
                found.append((r, storage))
        for r, storage in found:
            r.storage = storage
        return True


@dataclass
class PlannedRecord:
    source: RecordSource
    layout: RecordLayout
    header: bytes  # local header, padding included


class CheckpointPlan:
    """A whole checkpoint laid out before a byte is written: every record's
    header, data offset and size, where the central directory starts and how
    long the file is. The CRC-32s of byte records are known at once; those of
    storages once their bytes have been written (``set_crc``).

    Build one with :meth:`for_path` (torch's own pickling of an object) or from
    record sources directly."""

    def __init__(self, archive_name: str, sources: list, alignment: int, compute_crc32: bool, start: int = 0):
        self.compute_crc32 = compute_crc32
        self._layout = ZipLayout(archive_name, alignment, start)
        self.records = [PlannedRecord(src, *self._layout.add(src.name, src.nbytes)) for src in sources]
        for r in self.records:
            if r.source.data is not None and compute_crc32:
                r.layout.crc = zlib.crc32(r.source.data)
        self.central_directory_offset = self._layout.cursor
        self.size = self.central_directory_offset + self._layout.central_directory_size()

    @classmethod
    def for_path(cls, obj, path: str, pickle_module, pickle_protocol: int, disable_byteorder_record: bool,
                 serialization_id: Optional[str] = None, start: int = 0) -> "CheckpointPlan":
        """Pickles obj as torch.save does (plain_pickle, or torch's own
        pickling, ``torch.serialization._save``) and plans
        the archive torch.save would write to path: the same records, named
        after the path as torch names them, in the same order. Every save
        path comes through here, so torch's own checks and API-usage log do too."""
        return cls._for_archive(obj, archive_name_for(path), pickle_module, pickle_protocol,
                                disable_byteorder_record, serialization_id, start)

    @classmethod
    def for_stream(cls, obj, pickle_module, pickle_protocol: int, disable_byteorder_record: bool) -> "CheckpointPlan":
        """for_path's plan for ``torch.save(obj, f)`` with a file object f:
        the records named "archive/...", as torch names them there."""
        return cls._for_archive(obj, "archive", pickle_module, pickle_protocol, disable_byteorder_record)

    @classmethod
    def _for_archive(cls, obj, archive_name: str, pickle_module, pickle_protocol: int, disable_byteorder_record: bool,
                     serialization_id: Optional[str] = None, start: int = 0) -> "CheckpointPlan":
        from . import gc_pause, plain_pickle
        from ._torch_api import check_dill_version, log_api_usage, pickle_into, save_settings

        log_api_usage("torch.save")
        check_dill_version(pickle_module)

        compute_crc32, alignment = save_settings()
        recorder = RecordingZipWriter()
        if plain_pickle.ENABLED and plain_pickle.applies(pickle_module, pickle_protocol):
            with gc_pause.paused():  # only fastpersist's code runs: plain_pickle calls no __reduce__
                plain = plain_pickle.dump(obj)
                if plain is not None:
                    recorder.record_plain_pickle(plain, alignment, disable_byteorder_record)
                    return cls._planned(recorder, archive_name, alignment, compute_crc32, serialization_id, start)
        captured = pickle_into(obj, recorder, pickle_module, pickle_protocol, disable_byteorder_record)
        if captured is not None and not recorder.attach(captured):  # a record with no storage: torch's own path
            recorder = RecordingZipWriter()
            pickle_into(obj, recorder, pickle_module, pickle_protocol, disable_byteorder_record, capture=False)
        return cls._planned(recorder, archive_name, alignment, compute_crc32, serialization_id, start)

    @classmethod
    def _planned(cls, recorder, archive_name: str, alignment: int, compute_crc32: bool,
                 serialization_id: Optional[str], start: int) -> "CheckpointPlan":
        # records torch's zip writer adds when it closes the archive
        version = produced_format_version()
        recorder.write_record("version", version, len(version))
        if not any(r.name == "byteorder" for r in recorder.records):
            recorder.write_record("byteorder", sys.byteorder, len(sys.byteorder))  # even when disabled
        sid = (serialization_id or new_serialization_id()).encode("ascii")
        recorder.write_record(".data/serialization_id", sid, len(sid))
        return cls(archive_name, recorder.records, alignment, compute_crc32, start)

    def set_serialization_id(self, serialization_id: str) -> None:
        """Replaces the id (the same length: the layout does not move)."""
        data = serialization_id.encode("ascii")
        for r in self.records:
            if r.source.name == ".data/serialization_id":
                if len(data) != r.source.nbytes:
                    raise ValueError(f"a serialization id of {len(data)} bytes cannot replace one of {r.source.nbytes}")
                r.source.data = data
                self.set_crc(r, zlib.crc32(data))

    def set_crc(self, record: PlannedRecord, crc: int) -> None:
        record.layout.crc = crc if self.compute_crc32 else 0

    def descriptor(self, record: PlannedRecord) -> bytes:
        return ZipLayout.descriptor(record.layout)

    def central_directory(self) -> bytes:
        """Central directory and end records, with the CRCs as set now."""
        return self._layout.central_directory()


STREAM_CPU_STORAGES = False  # tests: CPU storages take the device storages' path


def stream_storage(storage, nbytes: int, sink, crc: Optional[int], copiers: Optional[dict] = None) -> Optional[int]:
    """Writes a storage (on any device) to the sink without a host copy of
    it: through the engine's buffers, its aligned middle with GPUDirect
    Storage where the transfer option takes it (device_io.write_storage)."""
    from . import plain_pickle, device_io

    return device_io.write_storage(device_io.byte_view(storage)[:nbytes], sink, crc, copiers)


def write_plan(plan: CheckpointPlan, sink) -> int:
    """Writes a planned checkpoint to ``sink`` in file order, storages
    straight from their memory with their CRC-32 computed while copying;
    returns the archive's size. ``sink`` needs ``write(bytes)``,
    ``write_address(address, nbytes, crc)`` (returns the updated CRC when crc
    is not None) and ``write_zeros(nbytes)``."""
    copiers: dict = {}  # stream_storage's, per device
    batch = _SmallRecords(sink, plan.compute_crc32)  # three engine calls a record cost ~6 us
    batching = getattr(sink, "BATCHES_SMALL_RECORDS", True)
    for r in plan.records:
        src = r.source
        storage = src.storage
        if batching and storage is not None and 0 < src.nbytes <= SMALL_RECORD and storage.device.type == "cpu" \
                and not STREAM_CPU_STORAGES:
            plan.set_crc(r, batch.add_record(r.header, storage.data_ptr(), src.nbytes, r.layout.zip64))
            continue
        batch.flush()
        sink.write(r.header)
        if src.data is not None:
            sink.write(src.data)
        elif storage is not None:
            if src.nbytes:
                crc = 0 if plan.compute_crc32 else None
                if storage.device.type == "cpu" and not STREAM_CPU_STORAGES:
                    crc = sink.write_address(storage.data_ptr(), src.nbytes, crc)
                elif hasattr(sink, "reserve"):
                    crc = stream_storage(storage, src.nbytes, sink, crc, copiers)
                else:
                    host = storage.cpu()  # held until written: its memory is read after data_ptr() returns
                    crc = sink.write_address(host.data_ptr(), src.nbytes, crc)
                    del host
                plan.set_crc(r, crc or 0)
        else:
            sink.write_zeros(src.nbytes)
        sink.write(plan.descriptor(r))
    if batching:
        batch.add_bytes(plan.central_directory())
        batch.flush()
    else:
        sink.write(plan.central_directory())
    return plan.size


class StreamSink:
    """write_plan's sink over a file object, written as torch's zip writer
    writes one: sequentially from where it stands, by its ``write`` (given
    memoryviews, as torch gives it), with no seek, flush or fsync of its
    own: the stream and its durability are the caller's."""

    # a stream's write() copies anyway: gathering small records in a batch first would copy them twice
    BATCHES_SMALL_RECORDS = False

    def __init__(self, stream):
        self.stream = stream
        from . import _engine

        self._engine = _engine

    def write(self, data) -> None:
        view = memoryview(data).cast("B").toreadonly()  # read-only, as torch's views are
        if not isinstance(self.stream, io.RawIOBase):
            self.stream.write(view)  # what it returns is its own (a compressor's output count): torch ignores it
            return
        while len(view):  # a raw stream may write less: its count says how much (io.RawIOBase.write)
            n = self.stream.write(view)
            if n is None:
                raise BlockingIOError(errno.EAGAIN, f"{self.stream!r} is non-blocking and took none of "
                                                    f"{len(view)} bytes")
            if type(n) is not int or n >= len(view):
                return
            if n <= 0:
                raise OSError(errno.EIO, f"{self.stream!r}.write() wrote nothing of {len(view)} bytes")
            view = view[n:]

    def write_address(self, address: int, nbytes: int, crc: Optional[int] = None) -> Optional[int]:
        view = memoryview((ctypes.c_ubyte * nbytes).from_address(address)).cast("B")
        self.write(view)
        if crc is None:
            return None
        # the engine's CRC (ISA-L where installed: 20 GB/s here against zlib's 4) is worth loading
        # its module for (~1 ms, once) from a MiB on
        if nbytes >= _ENGINE_CRC_FROM and (nbytes >= 1 << 20 or self._engine.loaded()):
            return self._engine.crc32_at(address, nbytes, crc)
        return zlib.crc32(view, crc)

    def write_zeros(self, nbytes: int) -> None:
        zeros = bytes(min(nbytes, 1 << 20))
        while nbytes:
            n = min(nbytes, len(zeros))
            self.write(zeros[:n] if n < len(zeros) else zeros)
            nbytes -= n


class _SmallRecords:
    """Small records' headers and bytes gathered in one buffer (each
    storage copied once, its CRC-32 taken from the copy) and written to the
    sink by one call per SMALL_BATCH bytes."""

    def __init__(self, sink, compute_crc32: bool):
        self.sink = sink
        self.compute_crc32 = compute_crc32
        self.buffer = None
        self.used = 0
        # the engine's CRC (ISA-L where installed: 1.7 us for 64 KiB against zlib's 15) once a save has loaded it
        from . import _engine

        self.crc32_at = _engine.crc32_at if _engine.loaded() else None

    def _room(self, n: int) -> int:
        """Where the next n bytes go in the buffer (the batch written out first where they do not fit)."""
        if self.buffer is None:
            self.buffer = bytearray(max(SMALL_BATCH, n))
            self.view = memoryview(self.buffer)
            self.address = ctypes.addressof(ctypes.c_char.from_buffer(self.buffer))
        elif self.used + n > len(self.buffer):
            self.flush()
            if n > len(self.buffer):
                self.view.release()
                self.buffer = None
                return self._room(n)
        start = self.used
        self.used += n
        return start

    def add_bytes(self, data: bytes) -> None:
        start = self._room(len(data))
        self.view[start:start + len(data)] = data

    def add_record(self, header: bytes, address: int, nbytes: int, zip64: bool) -> int:
        """A whole record (nbytes > 0): its header, the nbytes at address and
        its data descriptor (ZipLayout.descriptor's bytes); returns the data's
        CRC-32 (0 when CRCs are off). One place in the buffer for all three."""
        descriptor = _DESCRIPTOR64 if zip64 else _DESCRIPTOR
        size = len(header)
        start = self._room(size + nbytes + descriptor.size)
        view = self.view
        view[start:start + size] = header
        start += size
        ctypes.memmove(self.address + start, address, nbytes)
        crc = 0
        if self.compute_crc32:
            if nbytes >= _ENGINE_CRC_FROM and self.crc32_at is not None:
                crc = self.crc32_at(self.address + start, nbytes)
            else:
                crc = zlib.crc32(view[start:start + nbytes])
        descriptor.pack_into(view, start + nbytes, 0x08074B50, crc, nbytes, nbytes)
        return crc

    def flush(self) -> None:
        if self.used:
            self.sink.write(self.view[:self.used])
            self.used = 0


# CPU storages of at most SMALL_RECORD bytes are copied (with their headers) into
# batches of about SMALL_BATCH bytes and written by one call each
SMALL_RECORD = 64 << 10
SMALL_BATCH = 1 << 20
_ENGINE_CRC_FROM = 4 << 10  # below it, zlib's call costs less than the engine's
_DESCRIPTOR = struct.Struct("<IIII")  # a data descriptor: signature, CRC-32, sizes (ZipLayout.descriptor)
_DESCRIPTOR64 = struct.Struct("<IIQQ")


# ---------------------------------------------------------------------------
# reading
#
# fastpersist reads checkpoints without torch's reader, so the archive must be
# accepted or refused exactly where torch.load (2.13) accepts or refuses it:
# miniz 3.0.2 as torch builds it (mz_zip_reader_init and what extracting a
# record checks; CRC checks compiled out) and caffe2's PyTorchStreamReader
# (archive prefix, version record, serialization id, record lookup) plus
# torch.load's own checks (record listing, byte order). The conditions below
# restate theirs field by field; tests/test_archive_parity.py mutates every
# header field of real checkpoints and compares both readers.


def view_end(tensor) -> int:
    """Bytes from the start of a tensor's storage to the end of its view: what
    its data record must hold at least. A pickle states shape, stride and
    offset apart from the record's size, so a corrupt one can point past it."""
    last = tensor.storage_offset() + sum((s - 1) * st for s, st in zip(tensor.shape, tensor.stride()))
    return (last + 1) * tensor.element_size()


_EOCD = struct.Struct("<IHHHHIIH")
_ZIP64_LOCATOR = struct.Struct("<IIQI")
_ZIP64_EOCD = struct.Struct("<IQHHIIQQQQ")
_EOCD_SIG = b"PK\x05\x06"
_ZIP64_LOCATOR_SIG = 0x07064B50
_ZIP64_EOCD_SIG = 0x06064B50
_CENTRAL_SIG = 0x02014B50
_LOCAL_SIG = 0x04034B50
_U64 = (1 << 64) - 1
_MAX_LISTED_NAME = 511  # torch lists names through a 512-byte buffer (MZ_ZIP_MAX_ARCHIVE_FILENAME_SIZE)
_ENCRYPTED_OR_PATCH = 0x0001 | 0x0020 | 0x0040  # refused when a record is read
_MASKED_LOCAL_HEADERS = 0x2000  # refused when the archive is opened
_DOS_DIRECTORY = 0x10
_MIN_VERSION, _MAX_VERSION = 1, 10  # kMin/kMaxSupportedFileFormatVersion of torch 2.13


def _eocd_search_start(size: int) -> int:
    """Lowest offset miniz searches for the end record. It reads 4096-byte
    blocks backwards from the end, each overlapping the next by 3 bytes, and
    stops after the block at the file's start or the first one starting
    0xFFFF + 22 or more bytes before the end. The step back is computed
    unsigned: from a block starting less than 4093 bytes into the file it
    lands before the file's start and the read fails, so the search ends
    there too (torch.load then raises OSError or a miniz read error)."""
    start = max(size - 4096, 0)
    while start >= 4093 and size - start < 0xFFFF + _EOCD.size:
        start -= 4093
    return start


class _Lazy:
    """A message part formatted only if an error needs it (code that runs once per record or tensor)."""

    __slots__ = ("_make",)

    def __init__(self, make):
        self._make = make

    def __str__(self) -> str:
        return self._make()

    def __format__(self, spec: str) -> str:
        return format(self._make(), spec)


def _lower(name: bytes) -> bytes:
    """miniz compares names with ASCII-only case folding."""
    return name.translate(_ASCII_LOWER)


_ASCII_LOWER = bytes(range(256)).maketrans(bytes(range(65, 91)), bytes(range(97, 123)))


def _parse_cxx_version(text: bytes):
    """std::stoull(text) as torch's reader calls it, then read as a signed
    64-bit number; None where stoull throws invalid_argument, "range" where
    it throws out_of_range."""
    text = text.split(b"\0", 1)[0]  # a C string from here on
    at = 0
    while at < len(text) and text[at] in b" \t\n\v\f\r":
        at += 1
    negative = at < len(text) and text[at] == ord("-")
    if at < len(text) and text[at] in b"+-":
        at += 1
    digits = at
    while at < len(text) and 48 <= text[at] <= 57:
        at += 1
    if at == digits:
        return None
    value = int(text[digits:at])
    if value > _U64:
        return "range"
    if negative:
        value = -value & _U64
    return value - (1 << 64) if value >= 1 << 63 else value


class RecordEntry:
    """One record of an archive, as its central directory describes it."""

    # slots: an archive has a record per tensor, and every object a load keeps
    # alive counts towards the interpreter's next full garbage collection
    __slots__ = ("name", "header_offset", "size", "crc", "compressed", "full_name", "compressed_size", "method",
                 "flags", "directory", "stat_problem", "_data_offset", "_problem")

    def __init__(self, name: str, header_offset: int, size: int, crc: int, compressed: bool, *,
                 full_name: bytes = b"", compressed_size: Optional[int] = None, method: Optional[int] = None,
                 flags: int = 0, directory: bool = False, stat_problem: str = ""):
        self.name = name  # without the archive prefix
        self.header_offset = header_offset
        self.size = size  # the bytes torch's reader returns for it (the uncompressed size)
        self.crc = crc
        self.compressed = compressed
        self.full_name = full_name or name.encode("utf-8")
        self.compressed_size = size if compressed_size is None else compressed_size
        self.method = (8 if compressed else 0) if method is None else method
        self.flags = flags
        self.directory = directory  # miniz extracts nothing from "directories"
        self.stat_problem = stat_problem  # why miniz cannot describe it (a short zip64 field), if it cannot
        self._data_offset = -1
        self._problem = ""  # why its data cannot be located, once that was tried and failed

    @property
    def data_offset(self) -> int:
        """Where its bytes start in the file (ArchiveIndex.resolve finds it);
        -1 before that. Raises CheckpointError where resolving failed."""
        if self._data_offset < 0 and self._problem:
            raise CheckpointError(self._problem)
        return self._data_offset

    @data_offset.setter
    def data_offset(self, value: int) -> None:
        self._data_offset = value

    def __repr__(self) -> str:
        return (f"RecordEntry({self.name!r}, header_offset={self.header_offset}, size={self.size}, "
                f"crc={self.crc:#010x}, method={self.method}, data_offset={self._data_offset})")


class _CentralEntry:
    """The fields of one central directory header that torch's reader uses."""

    __slots__ = ("index", "position", "name", "flags", "method", "crc", "external_attr",
                 "header_offset", "size", "compressed_size", "stat_problem")


class ArchiveIndex:
    """The records of a torch zip checkpoint and where their bytes are.

    ``read`` accepts exactly the archives torch.load opens and refuses the
    others with CheckpointError; every offset and size read from the file is
    checked against the file's size before it is used, so a truncated or
    lying file never makes fastpersist read out of bounds or allocate what
    the file does not hold.

    ``records`` answers lookups the way torch's reader does (ASCII case
    folded, the first match of miniz's sorted binary search) and iterates
    over the names torch lists.
    """

    def __init__(self, path: str, file_size: int):
        self.path = path
        self.file_size = file_size
        self.prefix = ""  # "archive/"
        self._prefix_bytes = b""
        self._entries: list[_CentralEntry] = []
        self._sorted: list[int] = []  # entry indices in miniz's search order
        self._sorted_keys: list[bytes] = []
        self._by_key: Optional[dict] = None  # folded name -> entry index, where no two names fold alike
        self._records: dict[int, RecordEntry] = {}
        self.listed: list[str] = []  # what torch's get_all_records returns
        self.central_directory_offset = file_size
        self._found: dict[str, Optional[int]] = {}  # lookup's answers by name
        self._listing: Optional[list] = None

    @property
    def records(self) -> "_Records":
        """The records by name (a view made on each use: held by the index,
        it would make a reference cycle that keeps every index alive until
        the next garbage collection)."""
        return _Records(self)

    def _error(self, message: str) -> CheckpointError:
        return CheckpointError(f"{self.path}: {message}")

    @classmethod
    def read(cls, read_at, file_size: int, path: str) -> "ArchiveIndex":
        """Opens the archive the way torch.load does: end records, central
        directory, record names, and (for the archives fastpersist reads
        itself) the version, serialization id and byte order records.
        read_at(offset, n) -> bytes."""
        index = cls(path, file_size)
        index._parse(read_at)
        if not (index.is_torchscript or index.has_compressed_records):  # else torch.load reads it
            index._check_opening_records(read_at)
        return index

    def _read_exact(self, read_at, offset: int, n: int, what: str) -> bytes:
        if offset < 0 or n < 0 or offset + n > self.file_size:
            raise self._error(f"{what} at bytes {offset}..{offset + n} lies outside the file "
                              f"({self.file_size} bytes); it is truncated or corrupt")
        data = read_at(offset, n)
        if len(data) != n:
            raise self._error(f"{what}: the file ended after {len(data)} of {n} bytes at offset {offset} "
                              "(did it shrink while being read?)")
        return data

    # -- opening: miniz's mz_zip_reader_init ---------------------------------
    def _parse(self, read_at) -> None:
        size = self.file_size
        if size < _EOCD.size:
            raise self._error(f"{size} bytes is too short for a torch checkpoint")
        start = _eocd_search_start(size)
        tail = self._read_exact(read_at, start, size - start, "end of archive")
        at = tail.rfind(_EOCD_SIG, 0, size - _EOCD.size - start + 4)
        if at < 0:
            raise self._error("no zip end-of-archive record; the file is truncated or not a torch checkpoint")
        eocd_offset = start + at
        (_, disk, cd_disk, entries_on_disk, count, cd_size, cd_offset, _) = _EOCD.unpack_from(tail, at)

        zip64 = None
        locator_offset = eocd_offset - _ZIP64_LOCATOR.size
        if eocd_offset >= _ZIP64_LOCATOR.size + _ZIP64_EOCD.size:
            locator = _ZIP64_LOCATOR.unpack(
                self._read_exact(read_at, locator_offset, _ZIP64_LOCATOR.size, "zip64 locator"))
            if locator[0] == _ZIP64_LOCATOR_SIG:
                end64_offset = locator[2]
                if end64_offset > size - _ZIP64_EOCD.size:
                    raise self._error(f"the zip64 locator at offset {locator_offset} points at offset "
                                      f"{end64_offset}, past the end of the file; it is corrupt")
                end64 = _ZIP64_EOCD.unpack(
                    self._read_exact(read_at, end64_offset, _ZIP64_EOCD.size, "zip64 end record"))
                if end64[0] == _ZIP64_EOCD_SIG:  # otherwise the classic end record alone counts
                    zip64 = (locator, end64, end64_offset)
        if zip64 is not None:
            locator, end64, end64_offset = zip64
            (_, record_size, _, _, disk, cd_disk, entries_on_disk, count, cd_size, cd_offset) = end64
            where = f"the zip64 end record at offset {end64_offset}"
            if record_size < _ZIP64_EOCD.size - 12:
                raise self._error(f"{where} claims to be {record_size} bytes long, less than its fields")
            if locator[3] != 1:
                raise self._error(f"the zip64 locator at offset {locator_offset} says the archive spans "
                                  f"{locator[3]} disks; torch reads single-disk archives only")
            if count > _U32_LIMIT or entries_on_disk > _U32_LIMIT:
                raise self._error(f"{where} claims {max(count, entries_on_disk)} records, more than torch's "
                                  "reader supports; it is corrupt")
            if cd_size > _U32_LIMIT:
                raise self._error(f"{where} claims a central directory of {cd_size} bytes, more than torch's "
                                  "reader supports; it is corrupt")
        else:
            where = f"the end record at offset {eocd_offset}"
        if count != entries_on_disk:
            raise self._error(f"{where} counts {count} records in all but {entries_on_disk} on this disk; "
                              "torch reads single-disk archives only")
        if (disk | cd_disk) and (disk != 1 or cd_disk != 1):
            raise self._error(f"{where} names disk {disk} and central directory disk {cd_disk}; "
                              "torch reads single-disk archives only")
        if cd_size < count * _CENTRAL_HEADER.size:
            raise self._error(f"{where} claims {count} records in a central directory of {cd_size} bytes")
        if cd_offset + cd_size > size:
            raise self._error(f"the central directory claims bytes {cd_offset}..{cd_offset + cd_size}, past the "
                              f"end of the file ({size} bytes); it is truncated or corrupt")
        if not count:
            raise self._error("the archive does not contain any records")
        cd = self._read_exact(read_at, cd_offset, cd_size, "central directory")
        self.central_directory_offset = cd_offset
        self._parse_central_directory(cd, count, cd_offset, disk)
        self._sort()
        self._list_records()

    def _parse_central_directory(self, cd: bytes, count: int, cd_offset: int, this_disk: int) -> None:
        pos = 0
        for i in range(count):
            where = _Lazy(lambda i=i, at=cd_offset + pos: f"central directory record {i} (offset {at})")
            left = len(cd) - pos
            if left < _CENTRAL_HEADER.size:
                raise self._error(f"the central directory ends after {i} of {count} records")
            (sig, _, _, flags, method, time, _, crc, csize, usize, name_len, extra_len, comment_len,
             disk, _, external_attr, header_offset) = _CENTRAL_HEADER.unpack_from(cd, pos)
            if sig != _CENTRAL_SIG:
                raise self._error(f"{where} is corrupt (no central directory signature)")
            name = cd[pos + 46:pos + 46 + name_len]
            zip64 = bool(extra_len) and max(csize, usize, header_offset) == _U32_LIMIT
            if zip64:
                if 46 + name_len + extra_len > left:
                    raise self._error(f"{where} runs past the end of the central directory")
                extra = cd[pos + 46 + name_len:pos + 46 + name_len + extra_len]
                values = self._zip64_values(extra, where)
                # torch's reader takes these from all the extra bytes after the
                # zip64 field's header, whatever the field's own length says
                if values is not None:
                    if usize == _U32_LIMIT and len(values) >= 8:
                        usize, values = int.from_bytes(values[:8], "little"), values[8:]
                    if csize == _U32_LIMIT and len(values) >= 8:
                        csize, values = int.from_bytes(values[:8], "little"), values[8:]
                    if header_offset == _U32_LIMIT and len(values) >= 8:
                        header_offset = int.from_bytes(values[:8], "little")
            if csize != _U32_LIMIT and usize != _U32_LIMIT:
                # miniz tests method and modification time as one 32-bit word here
                if (method == 0 and time == 0 and usize != csize) or (usize and not csize):
                    raise self._error(f"{where} ('{name.decode('utf-8', 'replace')}') claims {usize} bytes "
                                      f"stored in {csize}; it is corrupt")
            if disk == 0xFFFF or (disk != this_disk and disk != 1):
                raise self._error(f"{where} starts on disk {disk}; torch reads single-disk archives only")
            if csize != _U32_LIMIT and (header_offset + 30 + csize) & _U64 > self.file_size:
                raise self._error(f"record '{name.decode('utf-8', 'replace')}' claims {csize} bytes at offset "
                                  f"{header_offset}, past the end of the file ({self.file_size} bytes); "
                                  "it is truncated or corrupt")
            if flags & _MASKED_LOCAL_HEADERS:
                raise self._error(f"{where} has masked local headers (flags {flags:#06x}), which torch "
                                  "does not support")
            total = _CENTRAL_HEADER.size + name_len + extra_len + comment_len
            if total > left:
                raise self._error(f"{where} runs past the end of the central directory")
            e = _CentralEntry()
            e.index, e.position, e.name, e.flags, e.crc = i, cd_offset + pos, name, flags, crc
            e.method = method
            e.external_attr = external_attr
            if zip64:
                self._describe(e, cd[pos:pos + total], where)
            else:  # what _describe finds without zip64 values (nearly every record)
                e.stat_problem = ""
                e.size, e.compressed_size, e.header_offset = usize, csize, header_offset
            self._entries.append(e)
            pos += total

    def _zip64_values(self, extra: bytes, where: str) -> Optional[bytes]:
        """The bytes after the zip64 field's header (and after it, to the end of
        the extra data), or None without one; refuses malformed extra fields."""
        pos = 0
        while pos < len(extra):
            if len(extra) - pos < 4:
                raise self._error(f"{where} has a truncated extra field")
            tag, length = struct.unpack_from("<HH", extra, pos)
            if length + 4 > len(extra) - pos:
                raise self._error(f"{where} has an extra field of {length} bytes running past its extra data")
            if tag == 1:
                return extra[pos + 4:]
            pos += 4 + length
        return None

    def _describe(self, e: _CentralEntry, header: bytes, where: str) -> None:
        """What miniz's file stat says about a record (used when it is read):
        sizes and offset with zip64 values taken from within the zip64 field."""
        (_, _, _, _, _, _, _, _, csize, usize, name_len, extra_len, _, _, _, _,
         header_offset) = _CENTRAL_HEADER.unpack_from(header)
        e.stat_problem = ""
        if max(csize, usize, header_offset) == _U32_LIMIT and extra_len:
            extra = header[46 + name_len:46 + name_len + extra_len]
            pos = 0
            while pos < len(extra):  # well formed: _zip64_values checked the same walk
                tag, length = struct.unpack_from("<HH", extra, pos)
                if tag == 1:
                    field = extra[pos + 4:pos + 4 + length]
                    wanted = [usize == _U32_LIMIT, csize == _U32_LIMIT, header_offset == _U32_LIMIT]
                    if len(field) < 8 * sum(wanted):
                        e.stat_problem = (f"{where}: its zip64 extra field holds {len(field)} bytes, too few for "
                                          f"the {sum(wanted)} 64-bit values it must carry")
                        break
                    values = iter(struct.iter_unpack("<Q", field[:8 * sum(wanted)]))
                    if wanted[0]:
                        usize = next(values)[0]
                    if wanted[1]:
                        csize = next(values)[0]
                    if wanted[2]:
                        header_offset = next(values)[0]
                    break
                pos += 4 + length
        e.size, e.compressed_size, e.header_offset = usize, csize, header_offset

    def _sort(self) -> None:
        """The order miniz's binary search walks: its in-place heap sort of
        the case-folded names (which fixes which of two equal names is found)."""
        keys = [_lower(e.name) for e in self._entries]
        self._sorted_keys = keys
        by_key = dict(zip(keys, range(len(keys))))
        if len(by_key) == len(keys):  # no ties: any sort gives miniz's order (0.1 ms, not 0.5, at 110 records)
            self._sorted = sorted(range(len(keys)), key=keys.__getitem__)
            self._by_key = by_key  # and its search finds what a dict does
            return

        def less(a: int, b: int) -> bool:
            return keys[a] < keys[b]  # bytewise, a proper prefix first: miniz's order

        order = list(range(len(self._entries)))

        def sift(root: int, end: int) -> None:
            while True:
                child = 2 * root + 1
                if child >= end:
                    return
                if child + 1 < end and less(order[child], order[child + 1]):
                    child += 1
                if not less(order[root], order[child]):
                    return
                order[root], order[child] = order[child], order[root]
                root = child

        n = len(order)
        if n > 1:
            for start in range((n - 2) // 2, -1, -1):
                sift(start, n)
            for end in range(n - 1, 0, -1):
                order[0], order[end] = order[end], order[0]
                sift(0, end)
        self._sorted = order

    def _find(self, full_name: bytes) -> Optional[int]:
        """miniz's binary search for a name (a C string: it ends at a NUL)."""
        key = _lower(full_name.split(b"\0", 1)[0])
        if self._by_key is not None:
            return self._by_key.get(key)
        lo, hi = 0, len(self._sorted) - 1
        while lo <= hi:
            mid = lo + (hi - lo) // 2
            candidate = self._sorted_keys[self._sorted[mid]]
            if candidate == key:
                return self._sorted[mid]
            if candidate < key:
                lo = mid + 1
            else:
                hi = mid - 1
        return None

    def _list_records(self) -> None:
        """PyTorchStreamReader's archive prefix (from the first record) and
        torch.load's listing of every record, which refuses names outside it."""
        first = self._entries[0].name
        slash = first.find(b"/")
        if slash < 0:
            raise self._error(f"record '{first.decode('utf-8', 'replace')}' is not inside an archive folder, "
                              "as torch's are")
        self._prefix_bytes = first[:slash + 1]
        self.prefix = self._prefix_bytes.decode("utf-8", "replace")
        prefix, n = self._prefix_bytes.split(b"\0", 1)[0], len(self._prefix_bytes)
        # where no two names fold alike, a name listed whole is found as its own record: lookup's answer is known
        found = self._found if self._by_key is not None and prefix == self._prefix_bytes else None
        for i, e in enumerate(self._entries):
            listed = e.name[:_MAX_LISTED_NAME].split(b"\0", 1)[0]  # a C string of at most 511 bytes
            if listed[:n] != prefix[:n]:  # strncmp over the prefix's length
                raise self._error(f"record '{e.name.decode('utf-8', 'replace')}' is not inside the archive folder "
                                  f"'{self.prefix}' of the first record")
            try:
                short = listed[n:].decode("utf-8")
            except UnicodeDecodeError:
                raise self._error(f"record name {e.name!r} is not UTF-8; torch.load cannot list it") from None
            if not short.endswith(".debug_pkl"):
                self.listed.append(short)
            if found is not None and len(listed) == len(e.name):
                found[short] = i

    def _record(self, i: int) -> RecordEntry:
        r = self._records.get(i)
        if r is None:
            e = self._entries[i]
            # RecordEntry's fields set directly: its keyword arguments cost a microsecond a record
            r = RecordEntry.__new__(RecordEntry)
            r.name = e.name[len(self._prefix_bytes):].decode("utf-8", "replace")
            r.header_offset, r.size, r.crc, r.full_name = e.header_offset, e.size, e.crc, e.name
            r.compressed_size, r.method, r.compressed, r.flags = e.compressed_size, e.method, e.method != 0, e.flags
            r.directory = e.name.endswith(b"/") or bool(e.external_attr & _DOS_DIRECTORY)
            r.stat_problem, r._data_offset, r._problem = e.stat_problem, -1, ""
            self._records[i] = r
        return r

    def lookup(self, name: str) -> Optional[RecordEntry]:
        """The record torch's reader finds for name (prefix added), or None."""
        try:
            i = self._found[name]
        except KeyError:  # each name searched once: a load asks for each record's several times
            i = self._found[name] = self._find(self._prefix_bytes + name.encode("utf-8", "surrogatepass"))
        return None if i is None else self._record(i)

    def listing(self) -> list:
        """(name, record) of every listed name torch's reader finds, each
        record once, in the listing's order: what ``records`` iterates over."""
        if self._listing is None:
            seen, listing = set(), []
            for name in self.listed:
                r = self.lookup(name)
                if r is not None and id(r) not in seen:
                    seen.add(id(r))
                    listing.append((name, r))
            self._listing = listing
        return self._listing

    # -- what PyTorchStreamReader and torch.load read on opening -------------
    def _check_opening_records(self, read_at) -> None:
        sid = self.lookup(".data/serialization_id")
        if sid is not None:
            text = self.read_record(read_at, sid)
            try:
                text.decode("utf-8")
            except UnicodeDecodeError:
                raise self._error("the .data/serialization_id record is not UTF-8 text; "
                                  "torch.load refuses the file") from None
        version = self.lookup(".data/version") or self.lookup("version")
        if version is None:
            raise self._error("the archive has no version record; it is not a torch checkpoint")
        text = self.read_record(read_at, version)
        value = _parse_cxx_version(text)
        if value is None or value == "range":
            raise self._error(f"the version record holds {text[:40]!r}, which is not a version number")
        if not _MIN_VERSION <= value <= _MAX_VERSION:
            raise self._error(f"the file's format version is {value}; torch 2.13 reads versions "
                              f"{_MIN_VERSION} to {_MAX_VERSION}")
        order = self.lookup("byteorder")
        if order is not None:
            value = self.read_record(read_at, order)
            if value not in (b"little", b"big"):  # torch.load's own check (a ValueError there)
                raise ByteOrderError(f"{self.path}: Unknown endianness type: {value[:40].decode(errors='replace')} "
                                     "(the byteorder record holds neither 'little' nor 'big'); the file is corrupt")

    # -- reading a record: what miniz checks before it extracts one ----------
    def _locate(self, read_at, r: RecordEntry) -> int:
        """The offset of r's bytes, after the checks torch's reader makes
        when it extracts r; raises CheckpointError where it refuses."""
        if r.stat_problem:
            raise self._error(r.stat_problem)
        if r.directory or not r.compressed_size:
            # miniz extracts nothing and torch hands out uninitialised memory
            if r.size:
                why = "is marked as a directory" if r.directory else "claims 0 stored bytes"
                raise self._error(f"record '{r.name}' {why} but holds {r.size} bytes; torch.load would read none of "
                                  "them (it returns uninitialised memory), so the file is corrupt")
            return self._lenient_data_offset(read_at, r)
        if r.flags & _ENCRYPTED_OR_PATCH:
            raise self._error(f"record '{r.name}' is encrypted or a patch (flags {r.flags:#06x}); torch cannot read it")
        if r.method not in (0, 8):
            raise self._error(f"record '{r.name}' uses compression method {r.method}, which torch cannot read")
        start = r.header_offset
        header = read_at(start, _LOCAL_HEADER.size) if 0 <= start <= self.file_size - _LOCAL_HEADER.size else b""
        if len(header) != _LOCAL_HEADER.size:  # _read_exact's message
            header = self._read_exact(read_at, start, _LOCAL_HEADER.size, f"local header of '{r.name}'")
        fields = _LOCAL_HEADER.unpack(header)
        if fields[0] != _LOCAL_SIG:
            raise self._error(f"record '{r.name}': no local header at offset {r.header_offset}; the file is corrupt")
        data_offset = r.header_offset + _LOCAL_HEADER.size + fields[9] + fields[10]
        end = max((data_offset + r.compressed_size) & _U64, data_offset + r.size)
        if end > self.file_size:
            raise self._error(f"record '{r.name}' claims {max(r.size, r.compressed_size)} bytes at offset "
                              f"{data_offset}, but the file ends at {self.file_size}; it is truncated or corrupt")
        return data_offset

    def _lenient_data_offset(self, read_at, r: RecordEntry) -> int:
        """Where an empty record's (unread) bytes would start."""
        if 0 <= r.header_offset and r.header_offset + _LOCAL_HEADER.size <= self.file_size:
            header = read_at(r.header_offset, _LOCAL_HEADER.size)
            if len(header) == _LOCAL_HEADER.size:
                fields = _LOCAL_HEADER.unpack(header)
                return min(r.header_offset + _LOCAL_HEADER.size + fields[9] + fields[10], self.file_size)
        return min(max(r.header_offset, 0), self.file_size)

    def read_record(self, read_at, r: RecordEntry) -> bytes:
        self.resolve(read_at, [r])
        if not r.size:
            return b""
        return self._read_exact(read_at, r.data_offset, r.size, f"record '{r.name}'")

    def resolve(self, read_at, names=None, strict: Optional[bool] = None) -> None:
        """Finds where the data of `names` (records or names; all records when
        None) starts, from local headers, with the checks torch's reader
        makes before reading a record; those refuse with CheckpointError.
        With names=None (or strict=False) nothing is refused: a record torch
        would refuse to read raises only when its data_offset is used."""
        if strict is None:
            strict = names is not None
        for item in (self.records.values() if names is None else names):
            r = item if isinstance(item, RecordEntry) else self.entry(item)
            if r._data_offset >= 0:
                continue
            try:
                r.data_offset = self._locate(read_at, r)
            except CheckpointError as exc:
                r._problem = str(exc)
                if strict:
                    raise

    def entry(self, name: str) -> RecordEntry:
        r = self.lookup(name)
        if r is None:
            raise self._error(f"record '{name}' not found in the archive")
        return r

    def by_data_offset(self) -> dict:
        """Records with bytes, by where those start (once resolved)."""
        return {r._data_offset: r for r in self.records.values() if r._data_offset >= 0 and r.size}

    def data_span(self) -> Optional[tuple]:
        """(start, end) of the file from the local header of the first
        storage record (``data/<key>``) to the header of the first record
        after the last of them (or the central directory): where torch's
        writer puts every storage's bytes. None without storage bytes."""
        storages = [r for r in self.records.values() if r.name.startswith("data/") and r.size]
        if not storages:
            return None
        start = min(r.header_offset for r in storages)
        last = max(r.header_offset for r in storages)
        after = [e.header_offset for e in self._entries if e.header_offset > last]
        end = min(after) if after else self.central_directory_offset
        return (start, end) if start < end <= self.file_size else None

    @property
    def is_torchscript(self) -> bool:
        return "constants.pkl" in self.listed  # torch.load's test, on its listing

    @property
    def has_compressed_records(self) -> bool:
        return any(e.method != 0 for e in self._entries)

    @property
    def has_checksums(self) -> bool:
        """False when torch saved it with compute_crc32=False (every CRC is 0)."""
        return any(r.crc for r in self.records.values() if r.size)


class _Records(Mapping):
    """The records of an ArchiveIndex by name: lookups as torch's reader
    makes them, iteration over the names torch lists that it can find."""

    def __init__(self, index: ArchiveIndex):
        self._index = index

    def __getitem__(self, name: str) -> RecordEntry:
        r = self._index.lookup(name) if isinstance(name, str) else None
        if r is None:
            raise KeyError(name)
        return r

    def __contains__(self, name) -> bool:
        return isinstance(name, str) and self._index.lookup(name) is not None

    def __iter__(self):
        return (name for name, _ in self._index.listing())

    def values(self):
        return [r for _, r in self._index.listing()]

    def items(self):
        return list(self._index.listing())

    def __len__(self) -> int:
        return len(self._index.listing())


class TorchArchiveReader:
    """Stands in for ``torch._C.PyTorchFileReader`` inside
    ``torch.serialization._load``, answering from an ArchiveIndex;
    read_at(offset, n) fetches bytes (from memory already read, or the file)."""

    def __init__(self, index: ArchiveIndex, read_at, storage=None, source: str = "the checkpoint",
                 read_file_into=None):
        self.index = index
        self._source = source  # named in errors: the file's path
        self._read_at = read_at
        self._storage = storage  # the whole file as one UntypedStorage, when it has been read
        # read_file_into(address, offset, nbytes): the file's own bytes into memory, for storages of their own
        self._read_file_into = read_file_into
        # the byte spans of the image handed out as slices, by get_storage_from_record and by storage_for_key
        # (their own: storage_for_key's loads are dropped, not mixed with the other's, when they fail)
        self._handed_out = _Spans()
        self._handed_out_ahead = _Spans()
        self._checksummed: Optional[bool] = None  # has_checksums, asked once
        self._guessed: dict = {}  # record name -> (record, data offset guessed by storage_for_key)

    def has_record(self, name: str) -> bool:
        return self.index.lookup(name) is not None

    def get_all_records(self) -> list:
        return list(self.index.listed)

    @property
    def records_checked(self) -> bool:
        """Whether get_record checks each record against its CRC-32 (the
        archive has them)."""
        if self._checksummed is None:
            self._checksummed = self.index.has_checksums
        return self._checksummed

    def get_record(self, name: str) -> bytes:
        """A byte record (data.pkl, version, byteorder), checked against its
        CRC-32 where the archive has them: torch.load checks none, so a
        flipped byte in the pickle would otherwise load whatever it unpickles
        to. These records are small; tensor data is checked with verify=True."""
        r = self.index.entry(name)
        data = self.index.read_record(self._read_at, r)
        if self.records_checked and zlib.crc32(data) != r.crc:
            raise CheckpointError(f"{self._source}: record '{name}' fails its CRC-32 check ({r.size} bytes at "
                                  f"offset {r.data_offset}); the file is corrupt (torch.load does not check "
                                  "CRCs and may load it into different objects)")
        return data

    def get_record_offset(self, name: str) -> int:
        r = self.index.entry(name)
        self.index.resolve(self._read_at, [r])
        return r.data_offset

    def get_record_header_offset(self, name: str) -> int:
        return self.index.entry(name).header_offset

    def get_record_offset_no_read(self, header_offset: int, name: str, size: int, alignment: int) -> int:
        return self.get_record_offset(name)  # the index knows; no need to compute it

    def serialization_id(self) -> str:
        r = self.index.lookup(".data/serialization_id")
        if r is None:
            return ""
        return self.index.read_record(self._read_at, r).decode("utf-8")  # checked on opening

    def get_storage_from_record(self, name: str, nbytes: int, storage_type):
        """A uint8 tensor over the record: a slice of the whole-file storage, no copy."""
        import torch

        return torch.empty(0, dtype=torch.uint8).set_(self._record_storage(name, nbytes))

    def storage_for_key(self, key: str, nbytes: int, alignment: int):
        """The UntypedStorage over record data/<key> (a slice of the file's),
        for a load that builds tensors while the file is still being read:
        the record's local header, which says where its data starts, may not
        be read yet, and reading it then waits behind the whole file's read
        (110 small reads took 19 ms of a 25 ms 50 MB load here). So the data
        is taken where torch's writer puts it; predictions_hold() checks
        every such guess against the local headers once the file is read."""
        offset = self._guess_data_offset("data/" + key, nbytes, alignment)
        if not nbytes:
            return _empty_storage()
        if not self._handed_out_ahead.claim(offset, nbytes):
            # two keys naming one record ("a" and "A"; "0" and "0\0z"), or records sharing bytes: torch
            # gives each key a copy, which cannot be taken while the bytes are still being read
            raise SharedRecordBytes(f"data/{key} shares bytes with a record handed out before")
        return _slice_storage(self._storage, offset, nbytes)

    def layout_offset_for_key(self, key: str, nbytes: int, alignment: int) -> int:
        """Where the data of record data/<key> starts, for a layout that
        reads none of it; guessed as in storage_for_key while the local
        headers are still being fetched."""
        return self._guess_data_offset("data/" + key, nbytes, alignment)

    def _guess_data_offset(self, name: str, nbytes: int, alignment: int) -> int:
        r = self.index.entry(name)
        self._check_size(r, nbytes)
        if r._data_offset >= 0:  # its local header was read already
            return r._data_offset
        offset = aligned_data_offset(r.header_offset, len(r.full_name), r.size, alignment)
        if offset + nbytes > self.index.file_size:
            raise self.index._error(f"record '{name}' cannot be where torch's writer puts it")
        self._guessed[r.name] = (r, offset)
        return offset

    def _check_size(self, r: RecordEntry, nbytes: int) -> None:
        if r.stat_problem:
            raise self.index._error(r.stat_problem)
        if nbytes != r.size:  # torch.load's check too
            raise self.index._error(f"record '{r.name}' holds {r.size} bytes, but the pickle says {nbytes}; "
                                    "the file is corrupt")

    def predictions_hold(self) -> bool:
        """Whether every data offset storage_for_key guessed is the one the
        record's local header gives (read_at reads them from memory by now)."""
        self.index.resolve(self._read_at, [r for r, _ in self._guessed.values()], strict=False)
        return all(r._data_offset == offset for r, offset in self._guessed.values())

    def guessed_records(self) -> dict:
        """{guessed data offset: record}, the layout's places before predictions_hold confirms them."""
        return {offset: r for r, offset in self._guessed.values() if r.size}

    def _record_storage(self, name: str, nbytes: int):
        """A slice of the file's storage, or a storage of its own, read from
        the file: without a file image (read_file_into alone), and for a
        record asked for again under another key (names are found whatever
        their ASCII case: "data/a" and "data/A" are one record; "data/0\\0z"
        is "data/0", as a C string; two directory entries may name one
        local header, or records overlap). torch's own
        reader gives every key a copy, and torch swaps a big-endian file's
        storages in place, key by key: two slices of one image would be
        swapped twice (as they are by torch.load(mmap=True)).

        Every storage handed out is fixed in size, as torch's record
        storages are: set_ grows a resizable storage to fit whatever view
        the pickle asks for, and the bytes past the record would be the
        allocator's (another object's freed memory), where torch refuses
        the file ("Trying to resize storage that is not resizable")."""
        if self._storage is None and self._read_file_into is None:
            raise RuntimeError("this reader has no file image to take storages from (a layout-only load)")
        r = self.index.entry(name)
        self._check_size(r, nbytes)
        self.index.resolve(self._read_at, [r])
        if not nbytes:
            return _empty_storage()
        if self._storage is not None and self._handed_out.claim(r.data_offset, nbytes):
            return self._storage[r.data_offset:r.data_offset + nbytes]
        if self._read_file_into is None:  # the image as read (right while nothing has swapped it in place)
            return fixed_size(self._storage[r.data_offset:r.data_offset + nbytes].clone())
        import torch

        storage = torch.UntypedStorage(nbytes)
        self._read_file_into(storage.data_ptr(), r.data_offset, nbytes)
        return fixed_size(storage)


class SharedRecordBytes(Exception):
    """storage_for_key was asked for bytes it has handed out already."""


class _Spans:
    """Byte spans [start, start + n) handed out, none overlapping another."""

    def __init__(self):
        self._starts: list = []
        self._ends: list = []

    def claim(self, start: int, n: int) -> bool:
        """Records [start, start + n) and says True where it overlaps no
        span recorded; else records nothing and says False."""
        i = bisect.bisect_right(self._starts, start)
        if (i and self._ends[i - 1] > start) or (i < len(self._starts) and self._starts[i] < start + n):
            return False
        self._starts.insert(i, start)
        self._ends.insert(i, start + n)
        return True


def _slice_storage(storage, offset: int, nbytes: int):
    """storage[offset:offset + nbytes] of a CPU UntypedStorage, by the C
    slice itself: UntypedStorage.__getitem__ first asks for the device in
    Python (0.9 us a slice instead of 0.3)."""
    global _storage_getitem
    if _storage_getitem is None:
        import torch

        _storage_getitem = torch._C.StorageBase.__getitem__
    return _storage_getitem(storage, slice(offset, offset + nbytes))


_storage_getitem = None


def _empty_storage():
    """An empty storage as torch's reader gives one: no data pointer, so
    torch's _load shares it with no other reference (each takes its own
    dtype), where an empty slice of the file's storage would point into it;
    and fixed in size, so that no view can grow it."""
    import torch

    return fixed_size(torch.UntypedStorage(0))


def fixed_size(storage):
    """storage as one that cannot be resized (a slice of it, which keeps
    it alive): what torch's reader hands its rebuild, so that a view
    reaching past the storage is refused by set_ instead of growing it
    over uninitialized memory."""
    return storage[0:storage.nbytes()]


__all__ = [
    "ArchiveIndex",
    "CheckpointError",
    "RecordEntry",
    "TorchArchiveReader",
    "CheckpointPlan",
    "PlannedRecord",
    "RecordLayout",
    "RecordSource",
    "RecordingZipWriter",
    "ZipLayout",
    "archive_name_for",
    "fixed_size",
    "new_serialization_id",
    "produced_format_version",
    "write_plan",
]
