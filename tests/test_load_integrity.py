"""Broken files: truncated, empty, bit-flipped, lying headers. Each raises a
clear fastpersist.CheckpointError naming the file (and the record), never a
crash, a hang or an allocation the file does not justify."""
import io
import random
import re
import struct
import zlib

import pytest
import torch

import fastpersist
from fastpersist import load_memory
from fastpersist import CheckpointError
from fastpersist.patching import original_load, original_save
from fastpersist.torch_format import ArchiveIndex


def checkpoint(folder, name="c.pt", **save_kwargs):
    path = folder / name
    original_save()({"w": torch.randn(300, 100), "b": torch.arange(100), "step": 7}, path, **save_kwargs)
    return path


def target(step=None):
    """Tensors shaped like checkpoint()'s, to load_into."""
    t = {"w": torch.zeros(300, 100), "b": torch.zeros(100, dtype=torch.long)}
    if step is not None:
        t["step"] = step
    return t


def index_of(path):
    data = path.read_bytes()
    index = ArchiveIndex.read(lambda o, n: data[o:o + n], len(data), str(path))
    index.resolve(lambda o, n: data[o:o + n])
    return index


def test_empty_file(folder):
    (folder / "empty.pt").write_bytes(b"")
    with pytest.raises(CheckpointError, match="empty.pt.*empty"):
        fastpersist.load(folder / "empty.pt")
    with pytest.raises(CheckpointError, match="empty"):
        fastpersist.load_into({}, folder / "empty.pt")


@pytest.mark.parametrize("keep", [4, 100, 0.5, -1, -22, -23])
def test_truncated_files(folder, keep):
    path = checkpoint(folder)
    data = path.read_bytes()
    cut = int(len(data) * keep) if isinstance(keep, float) else keep % len(data)
    path.write_bytes(data[:cut])
    with pytest.raises(CheckpointError, match="c.pt"):
        fastpersist.load(path)
    with pytest.raises(CheckpointError, match="c.pt"):
        fastpersist.load_into(target(), path)


def test_file_shrinking_during_the_read(folder, monkeypatch):
    """Cut after load measured the file, before its bytes are read: the read
    comes up short, and the memory taken for it goes back to the pool."""
    import importlib

    load_module = importlib.import_module("fastpersist.load")
    monkeypatch.setenv("FASTPERSIST_LOAD_MEMORY_SECONDS", "600")  # kept, however slow this machine is
    path = checkpoint(folder)
    real_start_reading = load_module._CheckpointImage.start_reading

    def cut_then_read(image):
        with open(path, "r+b") as f:
            f.truncate(image.size // 2)
        return real_start_reading(image)

    monkeypatch.setattr(load_module._CheckpointImage, "start_reading", cut_then_read)
    load_module.release_load_memory()
    with pytest.raises(CheckpointError, match=r"c.pt: the file ended before its \d+ bytes were read"):
        fastpersist.load(path)
    assert len(load_memory._freed_images.kept()) == 1


@pytest.mark.parametrize("old, new, message", [
    # the storage: 200 elements, the record holds 100 (refused as the layout reads it, as torch.load refuses it)
    (b"cpuq\x06Kd", b"cpuq\x06K\xc8", "lie.pt: record 'data/0' holds 800 bytes, but the pickle says 1600; "),
    # the view: from element 10, 100 long, past the storage's end
    (b"QK\x00Kd", b"QK\x0aKd", "lie.pt: a tensor's view reaches past its storage's record (torch.load refuses "
                                "the file: Trying to resize storage that is not resizable); "),
])
def test_pickle_pointing_past_its_record(folder, old, new, message):
    """A pickle whose tensor reaches beyond its data record: load_into refuses
    it before writing anything, instead of reading a neighbour's bytes."""
    path = folder / "lie.pt"
    original_save()({"w": torch.arange(100)}, path)
    data = path.read_bytes()
    assert data.count(old) == 1  # torch 2.13's pickle of this dict
    data = bytearray(data.replace(old, new))
    start, size = _pickle_start(bytes(data))
    _set_crc(data, "data.pkl", zlib.crc32(bytes(data[start:start + size])))  # crafted: its CRC matches
    path.write_bytes(bytes(data))
    dst = torch.full((100,), 7)
    with pytest.raises(CheckpointError, match=re.escape(message + "the file is corrupt")):
        fastpersist.load_into({"w": dst}, path)
    assert (dst == 7).all()


def test_bit_flip_in_tensor_data_is_caught_by_verify(folder):
    path = checkpoint(folder)
    record = index_of(path).records["data/0"]
    data = bytearray(path.read_bytes())
    data[record.data_offset + 1234] ^= 0x10
    path.write_bytes(bytes(data))
    loaded = fastpersist.load(path)  # like torch.load, no check by default
    assert loaded["w"].shape == (300, 100)
    with pytest.raises(CheckpointError, match=r"record 'data/0' fails its CRC-32"):
        fastpersist.load(path, verify=True)
    with pytest.raises(CheckpointError, match=r"record 'data/0' fails its CRC-32"):
        fastpersist.load_into(target(step=0), path, verify=True)


def test_verify_passes_on_intact_files_and_refuses_files_without_checksums(folder):
    path = checkpoint(folder)
    assert fastpersist.load(path, verify=True)["step"] == 7
    fastpersist.load_into(target(step=0), path, verify=True)
    from torch.utils.serialization import config

    config.save.compute_crc32 = False
    try:
        path = checkpoint(folder, "nocrc.pt")
    finally:
        config.save.compute_crc32 = True
    assert fastpersist.load(path)["step"] == 7
    with pytest.raises(CheckpointError, match="without CRC-32"):
        fastpersist.load(path, verify=True)


def test_verify_needs_a_path(folder):
    path = checkpoint(folder)
    with pytest.raises(ValueError, match="verify=True needs a path"):  # a buffer is torch.load's to read
        fastpersist.load(io.BytesIO(open(path, "rb").read()), verify=True)


def _central_entry_offset(data: bytes, name: bytes) -> int:
    at = 0
    while True:
        at = data.index(b"PK\x01\x02", at + 1)
        name_len = struct.unpack_from("<H", data, at + 28)[0]
        if data[at + 46:at + 46 + name_len].endswith(name):
            return at


def test_record_claiming_more_bytes_than_the_file_holds(folder):
    path = checkpoint(folder)
    data = bytearray(path.read_bytes())
    at = _central_entry_offset(bytes(data), b"/data/0")
    struct.pack_into("<II", data, at + 20, 0x7FFFFFF0, 0x7FFFFFF0)  # compressed and uncompressed size
    path.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match="'.*data/0' claims 2147483632 bytes"):
        fastpersist.load(path)
    with pytest.raises(CheckpointError, match="data/0"):
        fastpersist.load_into(target(), path)


def test_local_header_offset_past_the_end(folder):
    path = checkpoint(folder)
    data = bytearray(path.read_bytes())
    at = _central_entry_offset(bytes(data), b"/data/1")
    struct.pack_into("<I", data, at + 42, len(data) + 100)
    path.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match="data/1"):
        fastpersist.load(path)


def test_pickle_asking_for_more_than_the_record(folder):
    """The pickle says the storage has more elements than its record holds."""
    path = checkpoint(folder)
    import zipfile

    with zipfile.ZipFile(path) as z:
        records = {i.filename: z.read(i) for i in z.infolist()}
    pkl_name = next(n for n in records if n.endswith("data.pkl"))
    data_name = next(n for n in records if n.endswith("/data/1"))
    records[data_name] = records[data_name][:400]  # 50 of the 100 int64 elements
    with zipfile.ZipFile(folder / "short.pt", "w") as z:
        for name, payload in records.items():
            z.writestr(name, payload)
    assert pkl_name
    with pytest.raises(CheckpointError, match="short.pt"):
        fastpersist.load_into(target(), folder / "short.pt")
    with pytest.raises(RuntimeError):  # torch.load refuses it too, in its own words
        fastpersist.load(folder / "short.pt")


def test_random_damage_to_the_archive_structure(folder):
    """Bytes flipped in the central directory and end records: loading either
    works or raises a clear error; it never crashes or reads out of bounds."""
    path = checkpoint(folder)
    pristine = path.read_bytes()
    cd_start = _central_entry_offset(pristine, b"data.pkl")
    rng = random.Random(1234)
    outcomes = {"loaded": 0, "refused": 0}
    for _ in range(300):
        data = bytearray(pristine)
        for _ in range(rng.randint(1, 4)):
            data[rng.randrange(cd_start, len(data))] ^= 1 << rng.randrange(8)
        path.write_bytes(bytes(data))
        try:
            fastpersist.load(path, weights_only=True)
            outcomes["loaded"] += 1
        except CheckpointError as exc:  # fastpersist's own refusal names the file
            assert str(path) in str(exc)
            outcomes["refused"] += 1
        except (RuntimeError, ValueError, pickle_errors()) as exc:  # torch's unpickler, in its words
            assert str(exc)
            outcomes["refused"] += 1
    assert outcomes["refused"] > 50


def pickle_errors():
    import pickle

    return pickle.UnpicklingError


def test_errors_are_runtime_errors_like_torchs():
    assert issubclass(CheckpointError, RuntimeError)


# -- a damaged pickle -------------------------------------------------------------


def _pickle_start(data: bytes) -> tuple[int, int]:
    """Where the data.pkl record's bytes start in the file, and its size."""
    index = index_of_bytes(data)
    r = next(r for name, r in index.records.items() if name == "data.pkl")
    return r.data_offset, r.size


def index_of_bytes(data: bytes):
    index = ArchiveIndex.read(lambda o, n: data[o:o + n], len(data), "bytes")
    index.resolve(lambda o, n: data[o:o + n])
    return index


def _outcome(call):
    try:
        call()
        return "loaded"
    except Exception:  # noqa: BLE001 - each side's refusal, whatever its type
        return "refused"


@pytest.mark.parametrize("crc32", [True, False], ids=["with CRCs", "without CRCs"])
def test_a_damaged_pickle_that_torch_refuses_is_refused(folder, crc32):
    """One-byte damage anywhere in data.pkl: wherever torch.load refuses the
    file, fastpersist.load and load_into refuse it too (the C unpickler took
    opcodes and storage globals that torch's refuses: 3 in 400 loaded). With
    CRCs in the archive every damaged pickle is refused, naming the record."""
    from torch.utils.serialization import config

    config.save.compute_crc32 = crc32
    try:
        path = folder / "sd.pt"
        model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.LayerNorm(3))
        original_save()(model.state_dict(), path)
    finally:
        config.save.compute_crc32 = True
    pristine = path.read_bytes()
    start, size = _pickle_start(pristine)
    rng = random.Random(7)
    refused = {"torch.load": 0, "torch.load + load_state_dict": 0}

    def fresh():
        return torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.LayerNorm(3))

    for n in range(300):
        data = bytearray(pristine)
        data[start + rng.randrange(size)] ^= 1 << rng.randrange(8)
        path.write_bytes(bytes(data))
        # load_into puts tensors where the target's are: torch.load's counterpart maps to that device
        pairs = {"torch.load": (lambda: original_load()(path, weights_only=True),
                                lambda: fastpersist.load(path, weights_only=True)),
                 "torch.load + load_state_dict": (
                     lambda: fresh().load_state_dict(original_load()(path, weights_only=True, map_location="cpu")),
                     lambda: fastpersist.load_into(fresh(), path))}
        for what, (theirs, ours) in pairs.items():
            if _outcome(theirs) == "refused":
                refused[what] += 1
                assert _outcome(ours) == "refused", f"damage {n}: {what} refuses it, fastpersist loaded it"
            elif crc32:
                assert _outcome(ours) == "refused", f"damage {n}: a corrupt pickle loaded"
    assert min(refused.values()) > 100


def test_a_pickle_failing_its_crc_names_the_file_and_record(folder):
    path = checkpoint(folder)
    data = bytearray(path.read_bytes())
    start, size = _pickle_start(bytes(data))
    at = bytes(data).index(b"torch\nFloatStorage", start)  # the storage global's module: torch ignores it
    data[at + 4] = ord("s")  # "torcs"
    path.write_bytes(bytes(data))
    assert original_load()(path, weights_only=False)["step"] == 7  # torch: no complaint
    for load in (lambda: fastpersist.load(path), lambda: fastpersist.load(path, weights_only=False),
                 lambda: fastpersist.load_into(target(), path)):
        with pytest.raises(CheckpointError, match=rf"{re.escape(str(path))}: record 'data.pkl' fails its CRC-32 check"):
            load()


def test_the_c_unpickler_refuses_storage_globals_torch_refuses(folder):
    """A file saved without CRCs goes to torch's unpickler alone; with a CRC
    that matches, a storage global outside torch's own classes still goes to
    torch's unpickler, which refuses it as torch.load does."""
    from fastpersist import _torch_api

    path = checkpoint(folder)
    data = bytearray(path.read_bytes())
    at = bytes(data).index(b"torch\nFloatStorage")
    data[at + 4] = ord("s")
    start, size = _pickle_start(bytes(data))
    _set_crc(data, "data.pkl", zlib.crc32(bytes(data[start:start + size])))  # a CRC that matches the damage
    path.write_bytes(bytes(data))
    with pytest.raises(Exception) as theirs:
        original_load()(path, weights_only=True)
    with pytest.raises(type(theirs.value)) as ours:
        fastpersist.load(path, weights_only=True)
    assert "torcs.FloatStorage" in str(ours.value)
    assert ("torch", "FloatStorage") in _torch_api._STORAGE_GLOBALS


def _set_crc(data: bytearray, name: str, crc: int) -> None:
    """Writes crc into the central directory entry and local header of record `name`."""
    index = index_of_bytes(bytes(data))
    r = index.records[name]
    for offset in (r.header_offset + 14, _central_entry_offset(bytes(data), f"/{name}".encode()) + 16):
        data[offset:offset + 4] = struct.pack("<I", crc)
