"""The torch checkpoint format, in one place: the zip layout torch.save
produces (miniz with torch's padding rules), written as a stream.

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

import secrets
import sys
import struct
import zlib
from dataclasses import dataclass
from typing import Optional

_U32_LIMIT = 0xFFFFFFFF
_LOCAL_HEADER = struct.Struct("<IHHHHHIIIHH")
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

        import torch

        buf = io.BytesIO()
        writer = torch._C.PyTorchFileWriter(buf)
        writer.write_end_of_file()
        with zipfile.ZipFile(io.BytesIO(buf.getvalue())) as z:
            _produced_version = z.read("archive/version")
    return _produced_version


@dataclass
class RecordLayout:
    """Where one record sits in the archive."""

    name: str  # full name, with the archive prefix
    header_offset: int
    data_offset: int
    size: int
    zip64: bool  # zip64 extra field and 64-bit data descriptor
    crc: int = 0

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
        zip64_extra = b""
        if size >= _U32_LIMIT or offset >= _U32_LIMIT:
            fields = b""
            if size >= _U32_LIMIT:
                fields += struct.pack("<QQ", size, 0)  # compressed size is unknown here
            if offset >= _U32_LIMIT:
                fields += struct.pack("<Q", offset)
            zip64_extra = struct.pack("<HH", 1, len(fields)) + fields
        start = offset + _LOCAL_HEADER.size + len(full) + len(zip64_extra) + 4
        padding = -start % self.alignment
        extra = zip64_extra + b"FB" + struct.pack("<H", padding) + b"Z" * padding
        flags = _FLAGS if size else _FLAGS_EMPTY
        header = _LOCAL_HEADER.pack(0x04034B50, 0, flags, 0, 0, 0, 0, 0, 0, len(full), len(extra))
        header += full + extra
        record = RecordLayout(full.decode("utf-8"), offset, offset + len(header), size, bool(zip64_extra))
        self.records.append(record)
        self.cursor = record.end
        return record, header

    @staticmethod
    def descriptor(record: RecordLayout, crc: int) -> bytes:
        record.crc = crc
        if not record.size:
            return b""
        if record.zip64:
            return struct.pack("<IIQQ", 0x08074B50, crc, record.size, record.size)
        return struct.pack("<IIII", 0x08074B50, crc, record.size, record.size)

    def central_directory(self) -> bytes:
        """Central directory and end records, for the records placed so far."""
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
        self.cursor += len(cd) + len(zip64_end) + len(locator) + len(end)
        return cd + zip64_end + locator + end


class TorchZipWriter:
    """Stands in for ``torch._C.PyTorchFileWriter`` inside
    ``torch.serialization._save``: every record is laid out by ZipLayout and
    streamed to ``sink`` as it arrives, storages straight from their memory.

    ``sink`` needs ``write(bytes)``, ``write_address(address, nbytes, crc)``
    (returns the updated CRC when crc is not None) and ``write_zeros(nbytes)``.
    """

    def __init__(self, sink, archive_name: str, alignment: int, compute_crc32: bool, start: int = 0):
        self.sink = sink
        self.layout = ZipLayout(archive_name, alignment, start)
        self.compute_crc32 = compute_crc32
        self.finished = False

    # -- the PyTorchFileWriter methods torch.serialization._save calls ------
    def write_record(self, name: str, data, nbytes: int) -> None:
        import torch

        if isinstance(data, str):
            data = data.encode("utf-8")
        if isinstance(data, (torch.UntypedStorage, torch.TypedStorage)):
            self._write_storage(name, data.untyped() if isinstance(data, torch.TypedStorage) else data, nbytes)
            return
        data = memoryview(data).cast("B")[:nbytes]
        record, header = self.layout.add(name, nbytes)
        crc = zlib.crc32(data) if self.compute_crc32 else 0
        self.sink.write(header)
        self.sink.write(data)
        self.sink.write(ZipLayout.descriptor(record, crc))

    def write_record_metadata(self, name: str, nbytes: int) -> None:
        """skip_data: the record's space is reserved (zeros), its CRC is 0."""
        record, header = self.layout.add(name, nbytes)
        self.sink.write(header)
        self.sink.write_zeros(nbytes)
        self.sink.write(ZipLayout.descriptor(record, 0))

    def _write_storage(self, name: str, storage, nbytes: int) -> None:
        if storage.device.type != "cpu":  # torch's _save moves storages to the CPU first
            storage = storage.cpu()
        record, header = self.layout.add(name, nbytes)
        self.sink.write(header)
        crc = 0
        if nbytes:
            result = self.sink.write_address(storage.data_ptr(), nbytes, 0 if self.compute_crc32 else None)
            crc = result if self.compute_crc32 else 0
        self.sink.write(ZipLayout.descriptor(record, crc))

    # -- end of archive -----------------------------------------------------
    def finish(self, serialization_id: Optional[str] = None) -> int:
        """Writes the records torch adds at the end and the central directory;
        returns the archive's size."""
        self.write_record("version", produced_format_version(), len(produced_format_version()))
        if not any(r.name == self.layout.prefix + "byteorder" for r in self.layout.records):
            # torch's writer adds it even under _disable_byteorder_record
            self.write_record("byteorder", sys.byteorder, len(sys.byteorder))
        sid = (serialization_id or new_serialization_id()).encode("ascii")
        self.write_record(".data/serialization_id", sid, len(sid))
        self.sink.write(self.layout.central_directory())
        self.finished = True
        return self.layout.cursor


def torch_save_settings() -> tuple[bool, int]:
    """torch's compute_crc32 and storage_alignment settings."""
    from torch.utils.serialization import config

    return bool(config.save.compute_crc32), int(config.save.storage_alignment)


def save_records(obj, sink, archive_name: str, pickle_module, pickle_protocol: int,
                 disable_byteorder_record: bool, start: int = 0) -> int:
    """Runs torch's own pickling (``torch.serialization._save``) with a
    TorchZipWriter over ``sink``; returns the archive size."""
    import torch.serialization

    compute_crc32, alignment = torch_save_settings()
    writer = TorchZipWriter(sink, archive_name, alignment, compute_crc32, start)
    torch.serialization._save(obj, writer, pickle_module, pickle_protocol, disable_byteorder_record)
    return writer.finish()


__all__ = [
    "RecordLayout",
    "TorchZipWriter",
    "ZipLayout",
    "archive_name_for",
    "new_serialization_id",
    "produced_format_version",
    "save_records",
]
