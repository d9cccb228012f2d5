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


# ---------------------------------------------------------------------------
# reading


class CheckpointError(RuntimeError):
    """A checkpoint file is truncated, corrupt or not what it claims to be.

    A RuntimeError, like the errors torch.load raises for broken archives,
    so code that catches those keeps working."""


_EOCD = struct.Struct("<IHHHHIIH")
_ZIP64_LOCATOR = struct.Struct("<IIQI")
_ZIP64_EOCD = struct.Struct("<IQHHIIQQQQ")
_MAX_EOCD_SEARCH = _EOCD.size + 0xFFFF  # the end record plus the longest comment


@dataclass
class RecordEntry:
    """One record of an archive, as its central directory describes it."""

    name: str  # without the archive prefix
    header_offset: int
    size: int
    crc: int
    compressed: bool
    data_offset: int = -1  # known once the local header is read (ArchiveIndex.resolve)


class ArchiveIndex:
    """The records of a torch zip checkpoint and where their bytes are.

    Every offset and size read from the file is checked against the file's
    size before it is used, so a truncated or lying file raises
    CheckpointError instead of reading out of bounds or allocating what the
    file does not hold.
    """

    def __init__(self, path: str, file_size: int, prefix: str, records: dict):
        self.path = path
        self.file_size = file_size
        self.prefix = prefix  # "archive/"
        self.records: dict[str, RecordEntry] = records

    def _error(self, message: str) -> CheckpointError:
        return CheckpointError(f"{self.path}: {message}")

    @classmethod
    def read(cls, read_at, file_size: int, path: str) -> "ArchiveIndex":
        """Parses the end records and the central directory; read_at(offset, n) -> bytes."""
        index = cls(path, file_size, "", {})
        index._parse(read_at)
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

    def _parse(self, read_at) -> None:
        size = self.file_size
        if size < _EOCD.size:
            raise self._error(f"{size} bytes is too short for a torch checkpoint")
        tail_start = max(0, size - _MAX_EOCD_SEARCH)
        tail = self._read_exact(read_at, tail_start, size - tail_start, "end of archive")
        at = tail.rfind(b"PK\x05\x06")
        while at >= 0 and at + _EOCD.size > len(tail):
            at = tail.rfind(b"PK\x05\x06", 0, at)
        if at < 0:
            raise self._error("no zip end-of-archive record; the file is truncated or not a torch checkpoint")
        eocd_offset = tail_start + at
        (_, _, _, _, count, cd_size, cd_offset, _) = _EOCD.unpack_from(tail, at)
        locator_offset = eocd_offset - _ZIP64_LOCATOR.size
        if locator_offset >= 0 and read_at(locator_offset, 4) == b"PK\x06\x07":
            _, _, end64_offset, _ = _ZIP64_LOCATOR.unpack(
                self._read_exact(read_at, locator_offset, _ZIP64_LOCATOR.size, "zip64 locator"))
            if end64_offset + _ZIP64_EOCD.size > locator_offset:
                raise self._error(f"the zip64 end record's offset {end64_offset} is past the end records")
            fields = _ZIP64_EOCD.unpack(self._read_exact(read_at, end64_offset, _ZIP64_EOCD.size, "zip64 end record"))
            if fields[0] != 0x06064B50:
                raise self._error(f"no zip64 end record at offset {end64_offset}")
            count, cd_size, cd_offset = fields[7], fields[8], fields[9]
            cd_end_limit = end64_offset
        else:
            cd_end_limit = eocd_offset
        if cd_offset + cd_size > cd_end_limit:
            raise self._error(f"the central directory claims bytes {cd_offset}..{cd_offset + cd_size}, "
                              f"past the end records at {cd_end_limit}; the file is truncated or corrupt")
        if count * _CENTRAL_HEADER.size > cd_size:
            raise self._error(f"the central directory claims {count} records in {cd_size} bytes")
        cd = self._read_exact(read_at, cd_offset, cd_size, "central directory")
        self._parse_central_directory(cd, count, cd_offset)

    def _parse_central_directory(self, cd: bytes, count: int, cd_offset: int) -> None:
        pos = 0
        entries = []
        for i in range(count):
            if pos + _CENTRAL_HEADER.size > len(cd):
                raise self._error(f"the central directory ends after {i} of {count} records")
            (sig, _, _, _, method, _, _, crc, csize, usize, name_len, extra_len, comment_len,
             _, _, _, header_offset) = _CENTRAL_HEADER.unpack_from(cd, pos)
            if sig != 0x02014B50:
                raise self._error(f"central directory record {i} at offset {cd_offset + pos} is corrupt")
            pos += _CENTRAL_HEADER.size
            if pos + name_len + extra_len + comment_len > len(cd):
                raise self._error(f"central directory record {i} runs past the directory")
            name = cd[pos:pos + name_len].decode("utf-8", "replace")
            extra = cd[pos + name_len:pos + name_len + extra_len]
            pos += name_len + extra_len + comment_len
            usize, csize, header_offset = self._zip64_fields(name, extra, usize, csize, header_offset)
            if method == 0 and csize != usize:
                raise self._error(f"record '{name}' is stored with {csize} bytes but claims {usize}")
            if header_offset + _LOCAL_HEADER.size + csize > cd_offset:
                raise self._error(f"record '{name}' claims {csize} bytes at offset {header_offset}, past the "
                                  f"start of the central directory at {cd_offset}; the file is truncated or corrupt")
            entries.append((name, header_offset, csize if method else usize, crc, method != 0))
        if not entries:
            raise self._error("the archive has no records")
        first = entries[0][0]
        slash = first.find("/")
        if slash < 0:
            raise self._error(f"record '{first}' is not inside an archive folder, as torch's are")
        self.prefix = first[:slash + 1]
        for name, header_offset, size, crc, compressed in entries:
            if name.startswith(self.prefix):
                short = name[len(self.prefix):]
                self.records[short] = RecordEntry(short, header_offset, size, crc, compressed)

    def _zip64_fields(self, name: str, extra: bytes, usize: int, csize: int, header_offset: int):
        pos = 0
        while pos + 4 <= len(extra):
            tag, length = struct.unpack_from("<HH", extra, pos)
            body = extra[pos + 4:pos + 4 + length]
            pos += 4 + length
            if tag != 1:
                continue
            values = [v for (v,) in struct.iter_unpack("<Q", body[: len(body) // 8 * 8])]
            try:
                if usize == _U32_LIMIT:
                    usize = values.pop(0)
                if csize == _U32_LIMIT:
                    csize = values.pop(0)
                if header_offset == _U32_LIMIT:
                    header_offset = values.pop(0)
            except IndexError:
                raise self._error(f"record '{name}' has a short zip64 extra field") from None
        return usize, csize, header_offset

    def resolve(self, read_at, names=None) -> None:
        """Finds where the data of each record (or of `names`) starts, from its local header."""
        for name in (self.records if names is None else names):
            r = self.records[name]
            if r.data_offset >= 0:
                continue
            header = self._read_exact(read_at, r.header_offset, _LOCAL_HEADER.size, f"local header of '{name}'")
            fields = _LOCAL_HEADER.unpack(header)
            if fields[0] != 0x04034B50:
                raise self._error(f"record '{name}': no local header at offset {r.header_offset}")
            data_offset = r.header_offset + _LOCAL_HEADER.size + fields[9] + fields[10]
            if data_offset + r.size > self.file_size:
                raise self._error(f"record '{name}' claims {r.size} bytes at offset {data_offset}, "
                                  f"but the file ends at {self.file_size}; it is truncated or corrupt")
            r.data_offset = data_offset

    def entry(self, name: str) -> RecordEntry:
        try:
            return self.records[name]
        except KeyError:
            raise self._error(f"record '{name}' not found in the archive") from None

    def by_data_offset(self) -> dict:
        return {r.data_offset: r for r in self.records.values() if r.data_offset >= 0}

    @property
    def is_torchscript(self) -> bool:
        return "constants.pkl" in self.records

    @property
    def has_compressed_records(self) -> bool:
        return any(r.compressed for r in self.records.values())

    @property
    def has_checksums(self) -> bool:
        """False when torch saved it with compute_crc32=False (every CRC is 0)."""
        return any(r.crc for r in self.records.values() if r.size)


class TorchArchiveReader:
    """Stands in for ``torch._C.PyTorchFileReader`` inside
    ``torch.serialization._load``, answering from an ArchiveIndex;
    read_at(offset, n) fetches bytes (from memory already read, or the file)."""

    def __init__(self, index: ArchiveIndex, read_at, storage=None):
        self.index = index
        self._read_at = read_at
        self._storage = storage  # the whole file as one UntypedStorage, when it has been read

    def has_record(self, name: str) -> bool:
        return name in self.index.records

    def get_all_records(self) -> list:
        return list(self.index.records)

    def get_record(self, name: str) -> bytes:
        r = self.index.entry(name)
        self.index.resolve(self._read_at, [name])
        return self._read_at(r.data_offset, r.size)

    def get_record_offset(self, name: str) -> int:
        r = self.index.entry(name)
        self.index.resolve(self._read_at, [name])
        return r.data_offset

    def get_record_header_offset(self, name: str) -> int:
        return self.index.entry(name).header_offset

    def get_record_offset_no_read(self, header_offset: int, name: str, size: int, alignment: int) -> int:
        return self.get_record_offset(name)  # the index knows; no need to compute it

    def serialization_id(self) -> str:
        if not self.has_record(".data/serialization_id"):
            return ""
        return self.get_record(".data/serialization_id").decode("ascii", "replace")

    def get_storage_from_record(self, name: str, nbytes: int, storage_type):
        """A uint8 tensor over the record: a slice of the whole-file storage, no copy."""
        import torch

        if self._storage is None:
            raise RuntimeError("this reader has no file image to take storages from (a layout-only load)")
        r = self.index.entry(name)
        if nbytes != r.size:  # torch.load's check too
            raise self.index._error(f"record '{name}' holds {r.size} bytes, but the pickle says {nbytes}; "
                                    "the file is corrupt")
        offset = self.get_record_offset(name)
        return torch.empty(0, dtype=torch.uint8).set_(self._storage[offset:offset + nbytes])


__all__ = [
    "ArchiveIndex",
    "CheckpointError",
    "RecordEntry",
    "TorchArchiveReader",
    "RecordLayout",
    "TorchZipWriter",
    "ZipLayout",
    "archive_name_for",
    "new_serialization_id",
    "produced_format_version",
    "save_records",
]
