"""fastpersist's archive parser against torch's reader, field by field.

Every field of the end record, the zip64 end record and locator, each
central directory header (with its name and zip64 extra field) and each
local header of small real checkpoints is overwritten with several values
(0, 1, all ones, one more, one less), and the file is loaded by vanilla
torch.load and by fastpersist.load. They must agree: both return the same
objects, or both refuse. fastpersist refuses with a CheckpointError naming
the file, or with torch's own error where torch's code raised it (torch's
unpickler and _load checks run on the bytes fastpersist hands them, and
archives with compressed records are delegated to torch.load). Where torch
refuses, fastpersist.load_into must refuse too and leave its target as it was.

The deliberate differences are DIRECTORY below and byte records (data.pkl,
.format_version, byteorder, ...) whose bytes fail their CRC-32: torch reads
whatever is there, fastpersist refuses the file (is_byte_record_crc_refusal). FASTPERSIST_PARITY_REPORT=1
prints every mutation with both outcomes.
"""
import os
import struct
import traceback
import zipfile
from dataclasses import dataclass

import pytest
import torch

import fastpersist
from fastpersist import CheckpointError
from fastpersist.patching import original_save

from conftest import vanilla_load
from corpus import assert_same

# Deliberate difference: a record whose central directory entry marks it as a
# directory (DOS attribute bit 0x10, or a name ending in '/') but which holds
# bytes. miniz extracts nothing from a "directory" (nor from a record with 0
# stored bytes, which takes two changed fields to get past its checks), so
# torch.load hands out the record's buffer uninitialised: tensors full of
# whatever the allocator left there, or a pickle, version or byte order that
# fails at random. There is nothing to agree with; fastpersist refuses such a
# record when it is read (CheckpointError), instead of returning either
# garbage or bytes torch never reads. (The other difference, by design:
# fastpersist.load(verify=True) checks the CRC-32s torch ignores.)
DIRECTORY = "directory"

EOCD = (("signature", 0, 4), ("disk", 4, 2), ("cd_disk", 6, 2), ("entries_on_disk", 8, 2),
        ("entries", 10, 2), ("cd_size", 12, 4), ("cd_offset", 16, 4), ("comment_length", 20, 2))
ZIP64_END = (("signature", 0, 4), ("record_size", 4, 8), ("made_by", 12, 2), ("needed", 14, 2),
             ("disk", 16, 4), ("cd_disk", 20, 4), ("entries_on_disk", 24, 8), ("entries", 32, 8),
             ("cd_size", 40, 8), ("cd_offset", 48, 8))
ZIP64_LOCATOR = (("signature", 0, 4), ("cd_disk", 4, 4), ("end_offset", 8, 8), ("disks", 16, 4))
CENTRAL = (("signature", 0, 4), ("made_by", 4, 2), ("needed", 6, 2), ("flags", 8, 2), ("method", 10, 2),
           ("time", 12, 2), ("date", 14, 2), ("crc", 16, 4), ("compressed_size", 20, 4), ("size", 24, 4),
           ("name_length", 28, 2), ("extra_length", 30, 2), ("comment_length", 32, 2), ("disk_start", 34, 2),
           ("internal_attr", 36, 2), ("external_attr", 38, 4), ("header_offset", 42, 4))
LOCAL = (("signature", 0, 4), ("needed", 4, 2), ("flags", 6, 2), ("method", 8, 2), ("time", 10, 2),
         ("date", 12, 2), ("crc", 14, 4), ("compressed_size", 18, 4), ("size", 22, 4), ("name_length", 26, 2),
         ("extra_length", 28, 2))


@dataclass
class Field:
    where: str  # "central[data/0]"
    name: str
    offset: int  # in the file
    size: int


def structures(data: bytes) -> list:
    """Every header field of an archive, found by walking it as written."""
    fields = []

    def add(where, base, layout):
        fields.extend(Field(where, name, base + at, size) for name, at, size in layout)

    eocd = data.rfind(b"PK\x05\x06")
    add("end", eocd, EOCD)
    count, cd_size, cd_offset = struct.unpack_from("<HII", data, eocd + 10)
    if data[eocd - 20:eocd - 16] == b"PK\x06\x07":
        add("zip64_locator", eocd - 20, ZIP64_LOCATOR)
        end64 = struct.unpack_from("<Q", data, eocd - 12)[0]
        add("zip64_end", end64, ZIP64_END)
        count, cd_size, cd_offset = struct.unpack_from("<QQQ", data, end64 + 32)
    pos = cd_offset
    for _ in range(count):
        name_len, extra_len, comment_len = struct.unpack_from("<HHH", data, pos + 28)
        name = data[pos + 46:pos + 46 + name_len].decode()
        short = name.split("/", 1)[1]
        add(f"central[{short}]", pos, CENTRAL)
        fields.append(Field(f"central[{short}]", "name", pos + 46, name_len))
        extra = pos + 46 + name_len
        if extra_len:  # the zip64 field: tag, length, then 64-bit values
            fields += [Field(f"central[{short}]", "zip64_tag", extra, 2),
                       Field(f"central[{short}]", "zip64_length", extra + 2, 2)]
            fields += [Field(f"central[{short}]", f"zip64_value{i}", extra + 4 + 8 * i, 8)
                       for i in range(struct.unpack_from("<H", data, extra + 2)[0] // 8)]
        header = struct.unpack_from("<I", data, pos + 42)[0]
        if extra_len:
            header = struct.unpack_from("<Q", data, extra + 4 + 16)[0]
        add(f"local[{short}]", header, LOCAL)
        local_name_len, local_extra_len = struct.unpack_from("<HH", data, header + 26)
        fields.append(Field(f"local[{short}]", "name", header + 30, local_name_len))
        if local_extra_len >= 4:
            fields += [Field(f"local[{short}]", "extra_tag", header + 30 + local_name_len, 2),
                       Field(f"local[{short}]", "extra_length", header + 32 + local_name_len, 2)]
        pos += 46 + name_len + extra_len + comment_len
    return fields


def mutations(data: bytes, field: Field):
    """(label, mutated file, expected difference or None) for one field."""
    original = data[field.offset:field.offset + field.size]
    if field.name == "name":
        slash = original.find(b"/") + 1
        letter = next(i for i in range(slash, len(original)) if chr(original[i]).isalpha())
        variants = {
            "letter case flipped": (letter, original[letter] ^ 0x20),  # torch's lookups fold case
            "last byte +1": (len(original) - 1, (original[-1] + 1) & 0xFF),
            "NUL after prefix": (slash, 0),
            "0xFF after prefix": (slash, 0xFF),  # not UTF-8
            "prefix slash replaced": (slash - 1, ord("x")),
            "ends with /": (len(original) - 1, ord("/")),  # another name: torch does not find it
        }
        for label, (at, value) in variants.items():
            mutated = bytearray(data)
            mutated[field.offset + at] = value
            yield f"{field.where}.name {label}", bytes(mutated), None
        return
    value = int.from_bytes(original, "little")
    top = (1 << 8 * field.size) - 1
    for new in sorted({0, 1, top, (value + 1) & top, (value - 1) & top} - {value}):
        mutated = bytearray(data)
        mutated[field.offset:field.offset + field.size] = new.to_bytes(field.size, "little")
        directory = field.where.startswith("central") and field.name == "external_attr" and new & 0x10
        yield f"{field.where}.{field.name}={new:#x} (was {value:#x})", bytes(mutated), \
            DIRECTORY if directory else None


# -- the seeds ---------------------------------------------------------------


def state():
    return {"w": torch.arange(6, dtype=torch.float32), "i": torch.ones(2, 3, dtype=torch.int64), "step": 3}


def target():
    """Tensors shaped like state()'s, for load_into."""
    return {"w": torch.zeros(6), "i": torch.zeros(2, 3, dtype=torch.int64), "step": 0}


def torch_seed(folder) -> bytes:
    """torch.save's layout: zip64 end records, data descriptors, FB padding."""
    path = folder / "seed.pt"
    original_save()(state(), path)
    return path.read_bytes()


def classic_seed(folder) -> bytes:
    """The same records written by Python's zipfile: only the classic end
    record (so its fields are the ones read), sizes in the local headers, and
    an archive comment."""
    path = folder / "classic.pt"
    with zipfile.ZipFile(folder / "seed.pt") as src, zipfile.ZipFile(path, "w") as dst:
        for info in src.infolist():
            dst.writestr(info.filename, src.read(info))
        dst.comment = b"fastpersist"
    return path.read_bytes()


def zip64_seed(folder) -> bytes:
    """torch.save's file with every central directory entry carrying its sizes
    and offset in a zip64 extra field (0xFFFFFFFF in the 32-bit fields), as
    writers do for archives past 4 GiB."""
    data = (folder / "seed.pt").read_bytes()
    eocd = data.rfind(b"PK\x05\x06")
    end64 = struct.unpack_from("<Q", data, eocd - 12)[0]
    count, cd_size, cd_offset = struct.unpack_from("<QQQ", data, end64 + 32)
    pos, entries = cd_offset, []
    for _ in range(count):
        header = bytearray(data[pos:pos + 46])
        name_len, extra_len, comment_len = struct.unpack_from("<HHH", header, 28)
        assert extra_len == comment_len == 0
        csize, usize = struct.unpack_from("<II", header, 20)
        offset = struct.unpack_from("<I", header, 42)[0]
        struct.pack_into("<II", header, 20, 0xFFFFFFFF, 0xFFFFFFFF)
        struct.pack_into("<I", header, 42, 0xFFFFFFFF)
        struct.pack_into("<H", header, 30, 28)
        entries.append(bytes(header) + data[pos + 46:pos + 46 + name_len]
                       + struct.pack("<HHQQQ", 1, 24, usize, csize, offset))
        pos += 46 + name_len
    cd = b"".join(entries)
    end64_record = bytearray(data[end64:end64 + 56])
    struct.pack_into("<Q", end64_record, 40, len(cd))
    locator = bytearray(data[eocd - 20:eocd])
    struct.pack_into("<Q", locator, 8, cd_offset + len(cd))
    end = bytearray(data[eocd:])
    struct.pack_into("<I", end, 12, len(cd))
    rebuilt = data[:cd_offset] + cd + bytes(end64_record) + bytes(locator) + bytes(end)
    (folder / "zip64.pt").write_bytes(rebuilt)
    return rebuilt


SEEDS = {"torch": torch_seed, "classic": classic_seed, "zip64": zip64_seed}


# -- outcomes ------------------------------------------------------------------


def origin(exc: BaseException) -> str:
    """The file of the innermost Python frame the exception passed through."""
    frames = traceback.extract_tb(exc.__traceback__)
    return frames[-1].filename if frames else ""


def from_fastpersist(exc: BaseException) -> bool:
    return os.sep + "fastpersist" + os.sep in origin(exc)


def acceptable_refusal(exc: BaseException, path) -> str:
    """'' where exc is how fastpersist may refuse path, else why not: its own
    refusals are CheckpointErrors naming the file (load_into's key and shape
    checks are RuntimeErrors naming it); anything else must have been raised
    by torch's code."""
    if isinstance(exc, CheckpointError) or (from_fastpersist(exc) and isinstance(exc, RuntimeError)
                                            and str(exc).startswith("Error(s) in loading state_dict")):
        return "" if str(path) in str(exc) else f"the error does not name the file: {exc!r}"
    if from_fastpersist(exc):
        return f"fastpersist raised {type(exc).__name__} rather than CheckpointError: {exc!r} at {origin(exc)}"
    return ""


def outcome(fn):
    try:
        return fn(), None
    except Exception as exc:  # noqa: BLE001 - the comparison is the point
        return None, exc


def unchanged(t) -> bool:
    fresh = target()
    return all(torch.equal(t[k], fresh[k]) for k in ("w", "i")) and t["step"] == 0


def is_byte_record_crc_refusal(error, path) -> bool:
    """fastpersist's refusal of a pickle, version or byte-order record whose
    bytes (as read from where the headers place them) fail its CRC-32."""
    import re

    return isinstance(error, CheckpointError) and re.fullmatch(
        rf"{re.escape(str(path))}: record '(?!data/)[^']+' fails its CRC-32 check .*", str(error), re.S) is not None


def compare(path, label, data, difference, report) -> list:
    """Problems with one mutation (empty when both readers agree)."""
    path.write_bytes(data)
    expected, torch_error = outcome(lambda: vanilla_load(path))
    got, fp_error = outcome(lambda: fastpersist.load(path, weights_only=False))
    if report:
        print(f"{label}: torch {'ok' if torch_error is None else repr(torch_error)[:120]} | "
              f"fastpersist {'ok' if fp_error is None else repr(fp_error)[:120]}")
    if difference == DIRECTORY:
        if not isinstance(fp_error, CheckpointError) or "directory" not in str(fp_error):
            return [f"{label}: fastpersist should refuse a directory entry holding bytes, got {fp_error!r}"]
        torch_error = torch_error or fp_error  # torch's outcome is whatever memory held: not compared
    elif torch_error is None and fp_error is None:
        try:
            assert_same(expected, got)
        except AssertionError:
            return [f"{label}: both load it, with different results"]
        return []
    elif torch_error is None:
        if is_byte_record_crc_refusal(fp_error, path):
            return []
        return [f"{label}: torch loads it, fastpersist refuses: {fp_error!r}"]
    elif fp_error is None:
        return [f"{label}: torch refuses ({torch_error!r}), fastpersist loads it"]
    else:
        why = acceptable_refusal(fp_error, path)
        if why:
            return [f"{label}: {why}"]
    # torch refuses: so must load_into, before writing anything
    t = target()
    _, into_error = outcome(lambda: fastpersist.load_into(t, path))
    if into_error is None:
        return [f"{label}: torch refuses ({torch_error!r}), load_into loads it"]
    why = acceptable_refusal(into_error, path)
    if why:
        return [f"{label} (load_into): {why}"]
    if not unchanged(t):
        return [f"{label}: load_into refused ({into_error!r}) but changed its target"]
    return []


# Which fields each seed mutates: all of torch.save's own layout; the classic
# end record (read only where there are no zip64 end records), one central
# entry and the local headers of the classic seed; the zip64 fields of every
# central entry of the zip64 seed.
def selected(seed: str, field: Field) -> bool:
    if seed == "torch":
        return True
    if seed == "classic":
        return field.where in ("end", "central[data.pkl]") or field.where.startswith("local[data/")
    return field.where.startswith("central") and (
        field.name.startswith("zip64") or field.name in ("compressed_size", "size", "header_offset",
                                                         "extra_length", "time"))


@pytest.mark.parametrize("seed", list(SEEDS))
def test_every_header_field(tmp_path, seed):
    torch_seed(tmp_path)
    data = SEEDS[seed](tmp_path)
    path = tmp_path / "mutated.pt"
    report = os.environ.get("FASTPERSIST_PARITY_REPORT") == "1"
    # the pristine seed loads the same through both
    assert compare(path, f"{seed} as written", data, None, report) == []
    assert_same(fastpersist.load(path, weights_only=False), state())
    problems, tried = [], 0
    for field in structures(data):
        if selected(seed, field):
            for label, mutated, difference in mutations(data, field):
                tried += 1
                problems += compare(path, f"{seed}: {label}", mutated, difference, report)
    assert tried > 50
    assert not problems, f"{len(problems)} of {tried} mutations disagree:\n" + "\n".join(problems)


def test_multidisk_end_record_refused(tmp_path):
    """The reported bug: a flipped disk number in the end record (of an archive
    without zip64 end records, where it is read) made torch.load refuse the
    file while fastpersist.load and load_into returned data."""
    torch_seed(tmp_path)
    data = bytearray(classic_seed(tmp_path))
    eocd = data.rfind(b"PK\x05\x06")
    data[eocd + 4] ^= 0x01
    path = tmp_path / "multidisk.pt"
    path.write_bytes(bytes(data))
    with pytest.raises(RuntimeError, match="multidisk"):
        vanilla_load(path)
    with pytest.raises(CheckpointError, match=r"multidisk\.pt.*disk 1.*single-disk"):
        fastpersist.load(path)
    t = target()
    with pytest.raises(CheckpointError, match="single-disk"):
        fastpersist.load_into(t, path)
    assert unchanged(t)


def test_lookups_fold_case_like_torchs(tmp_path):
    """miniz finds records whatever their ASCII case: so does fastpersist."""
    torch_seed(tmp_path)
    data = (tmp_path / "seed.pt").read_bytes()
    for old, new in ((b"seed/data.pkl", b"seed/DATA.PKL"), (b"seed/byteorder", b"seed/ByteOrder"),
                     (b"seed/version", b"seed/VERSION")):
        data = data.replace(old, new)  # central and local names alike
    path = tmp_path / "upper.pt"
    path.write_bytes(data)
    assert_same(fastpersist.load(path, weights_only=False), vanilla_load(path))
    t = target()
    fastpersist.load_into(t, path)
    assert_same(t, state())


@pytest.mark.parametrize("version, accepted", [
    (b"1", True), (b"10", True), (b" +3\n", True), (b"3junk", True), (b"-18446744073709551615", True),
    (b"0", False), (b"11", False), (b"-3", False), (b"x3", False), (b"", False), (b"\x003", False),
    (b"99999999999999999999999", False),
])
def test_version_record_read_like_torchs(tmp_path, version, accepted):
    """PyTorchStreamReader's std::stoull of the version record, and its range."""
    torch_seed(tmp_path)
    path = tmp_path / "v.pt"
    with zipfile.ZipFile(tmp_path / "seed.pt") as src, zipfile.ZipFile(path, "w") as dst:
        for info in src.infolist():
            dst.writestr(info.filename, version if info.filename.endswith("/version") else src.read(info))
    if accepted:
        assert_same(fastpersist.load(path, weights_only=False), vanilla_load(path))
    else:
        with pytest.raises(Exception):
            vanilla_load(path)
        with pytest.raises(CheckpointError, match=r"v\.pt: .*version"):
            fastpersist.load(path)
        t = target()
        with pytest.raises(CheckpointError, match="version"):
            fastpersist.load_into(t, path)
        assert unchanged(t)


@pytest.mark.parametrize("junk, opens", [(1, True), (100, True), (4000, True), (65535, False), (66000, False),
                                         (69562, True), (69563, False), (80000, False)])
def test_bytes_after_the_end_record(tmp_path, junk, opens):
    """miniz looks for the end record in 4 KiB blocks stepping back 4093 bytes
    from the end of the file. It gives up after the block that starts 0xFFFF
    + 22 or more bytes before the end, and a step back from a block starting
    less than 4093 bytes into the file wraps (unsigned) and fails to read. So
    with junk after the end record, whether the file opens depends on where
    the blocks fall: the seed's end record is the first 22 bytes of the 17th
    block with 69562 junk bytes, out of reach with 69563, and behind a failing
    step with 65535 (the seed being under 4 KiB)."""
    data = torch_seed(tmp_path)
    assert len(data) < 4000
    data += bytes(range(256)) * (junk // 256) + b"\x01" * (junk % 256)
    path = tmp_path / "junk.pt"
    problems = compare(path, f"{junk} bytes after the end record", data, None, report=False)
    assert not problems, problems
    refused = outcome(lambda: fastpersist.load(path, weights_only=False))[1]
    assert (refused is None) == opens, refused


def rewritten(folder, name, records) -> bytes:
    """An archive of (name, bytes) records in this order, by Python's zipfile."""
    import warnings

    path = folder / name
    with warnings.catch_warnings(), zipfile.ZipFile(path, "w") as dst:
        warnings.simplefilter("ignore")  # "Duplicate name"
        for record_name, payload in records:
            dst.writestr(record_name, payload)
    return path.read_bytes()


@pytest.mark.parametrize("copies, order", [(2, "after"), (2, "before"), (3, "after"), (4, "around"),
                                           (5, "around"), (7, "after")])
def test_which_of_equal_names_is_read(tmp_path, copies, order):
    """Records whose names are equal but for ASCII case: torch's reader finds
    one of them by binary search over miniz's heap sort of the names, so
    which one depends on the order and number of records. fastpersist must
    read the same one."""
    torch_seed(tmp_path)
    with zipfile.ZipFile(tmp_path / "seed.pt") as src:
        records = [(i.filename, src.read(i)) for i in src.infolist()]
    at = next(i for i, (n, _) in enumerate(records) if n.endswith("/data/0"))
    name, payload = records[at]
    spellings = [name.replace("data/0", v) for v in ("data/0", "DATA/0", "Data/0", "dATA/0", "daTa/0", "DaTa/0",
                                                      "DAta/0")]
    copies_of = [(spellings[k], struct.pack("<6f", *([float(k + 1)] * 6))) for k in range(1, copies)]
    if order == "after":
        records[at + 1:at + 1] = copies_of
    elif order == "before":
        records[1:1] = copies_of  # after data.pkl: the first record names the archive
    else:
        records[1:1] = copies_of[: len(copies_of) // 2]
        records.extend(copies_of[len(copies_of) // 2:])
    data = rewritten(tmp_path, "dup.pt", records)
    path = tmp_path / "mutated.pt"
    problems = compare(path, f"{copies} spellings of data/0, {order}", data, None, report=False)
    assert not problems, problems
