"""fastpersist writes the very bytes torch.save writes (but the random serialization id)."""
import io
import os
import pickle
import struct
import zipfile

import pytest
import torch

import fastpersist
from fastpersist import torch_format

from conftest import torch_save_setting, vanilla_load


def serialization_id(path):
    """Read without zipfile's CRC check (files saved with compute_crc32 off have CRC 0)."""
    with zipfile.ZipFile(path) as z:
        info = next(i for i in z.infolist() if i.filename.endswith(".data/serialization_id"))
    with open(path, "rb") as f:
        f.seek(info.header_offset)
        header = f.read(30)
        name_len, extra_len = struct.unpack("<HH", header[26:30])
        f.seek(info.header_offset + 30 + name_len + extra_len)
        return f.read(info.file_size).decode()


def normalized(path):
    return open(path, "rb").read()


@pytest.fixture(autouse=True)
def same_serialization_id(monkeypatch):
    """The id is random per save; fastpersist reuses the reference file's so
    that every other byte can be compared."""
    last = {}
    real_save = torch.save

    def save_and_remember(obj, f, *args, **kwargs):
        real_save(obj, f, *args, **kwargs)
        last["id"] = serialization_id(f)

    monkeypatch.setattr(torch, "save", save_and_remember)
    monkeypatch.setattr(torch_format, "new_serialization_id",
                        lambda: last.pop("id", None) or "0" * 40)


def both(obj, folder, name="ckpt.pt", **save_arguments):
    """The same save by torch.save and fastpersist.save, in two folders."""
    ref, ours = folder / "ref", folder / "ours"
    ref.mkdir(exist_ok=True)
    ours.mkdir(exist_ok=True)
    torch.save(obj, ref / name, **save_arguments)
    fastpersist.save(obj, ours / name, **save_arguments)
    return ref / name, ours / name


OBJECTS = {
    "state_dict": {"w": torch.randn(64, 33), "b": torch.arange(7), "empty": torch.zeros(0), "s": "x"},
    "shared_and_views": (lambda t: [t, t[3:], t.view(2, 50), t.t() if t.dim() == 2 else t])(torch.randn(100)),
    "no_tensors": {"epoch": 3, "names": ["a", "b"]},
    "many": [torch.full((i,), i, dtype=torch.int16) for i in range(50)],
    "module": torch.nn.Sequential(torch.nn.Linear(5, 3), torch.nn.ReLU()),
}


@pytest.mark.parametrize("key", OBJECTS)
def test_same_bytes_as_torch_save(folder, key):
    ref, ours = both(OBJECTS[key], folder)
    assert normalized(ref) == normalized(ours)


def test_storage_alignment_too_large_is_refused(folder):
    with torch_save_setting("storage_alignment", 1 << 20), pytest.raises(ValueError, match="storage_alignment"):
        fastpersist.save({"a": torch.ones(3)}, folder / "x.pt")
    assert not os.listdir(folder)


@pytest.mark.parametrize("alignment", [64, 4096, 65536])
def test_storage_alignment_is_honoured(folder, alignment):
    with torch_save_setting("storage_alignment", alignment):
        ref, ours = both({"a": torch.randn(1000), "b": torch.ones(3)}, folder)
    assert normalized(ref) == normalized(ours)
    reader = torch._C.PyTorchFileReader(str(ours))
    for record in reader.get_all_records():
        if record.startswith("data/"):
            assert reader.get_record_offset(record) % alignment == 0


def test_compute_crc32_off_writes_zero_crcs(folder):
    with torch_save_setting("compute_crc32", False):
        ref, ours = both({"a": torch.randn(1000)}, folder)
    assert normalized(ref) == normalized(ours)
    with zipfile.ZipFile(ours) as z:
        assert all(info.CRC == 0 for info in z.infolist())


def test_crc32_is_right_when_on(folder):
    _, ours = both({"a": torch.randn(100_000), "b": torch.arange(10)}, folder)
    with zipfile.ZipFile(ours) as z:
        assert z.testzip() is None  # checks every record's CRC


def test_skip_data_reserves_space_like_torch(folder):
    obj = {"a": torch.randn(5000), "b": torch.ones(10)}
    with torch.serialization.skip_data():
        ref, ours = both(obj, folder)
    assert normalized(ref) == normalized(ours)


def test_disable_byteorder_record(folder):
    obj = {"a": torch.ones(3)}
    ref, ours = both(obj, folder, "x.pt", _disable_byteorder_record=True)
    assert normalized(ref) == normalized(ours)
    with zipfile.ZipFile(ours) as z:  # torch's writer adds it last anyway
        assert [n for n in z.namelist() if n.endswith("byteorder")] == ["x/byteorder"]


@pytest.mark.parametrize("protocol", [2, 4, pickle.HIGHEST_PROTOCOL])
def test_pickle_protocols(folder, protocol):
    obj = {"a": torch.arange(5), "t": (1, 2)}
    ref, ours = both(obj, folder, pickle_protocol=protocol)
    assert normalized(ref) == normalized(ours)


@pytest.mark.parametrize("name", ["model.pt", "a.b.c", "noext", "..pt", "ünïcode.pt", "weights.tar"])
def test_archive_name_follows_torch(folder, name):
    ref, ours = both({"x": torch.ones(2)}, folder, name)
    assert zipfile.ZipFile(ref).namelist()[0] == zipfile.ZipFile(ours).namelist()[0]
    assert normalized(ref) == normalized(ours)


def test_archive_name_comes_from_destination_not_temp_file(folder):
    fastpersist.save({"x": torch.ones(2)}, folder / "final_name.pt")
    assert zipfile.ZipFile(folder / "final_name.pt").namelist()[0] == "final_name/data.pkl"


def test_serialization_id_is_fresh_per_save(folder, monkeypatch):
    monkeypatch.undo()  # the real id generator
    fastpersist.save({"x": torch.ones(2)}, folder / "a.pt")
    fastpersist.save({"x": torch.ones(2)}, folder / "b.pt")
    ids = [serialization_id(folder / f"{n}.pt") for n in "ab"]
    assert ids[0] != ids[1] and all(len(i) == 40 and i.isdigit() for i in ids)


class SparseSink:
    """Writes headers for real and leaves data as holes: a multi-GB archive in no time."""

    def __init__(self, f):
        self.f = f

    def write(self, data):
        self.f.write(bytes(data))

    def write_address(self, address, nbytes, crc):
        raise AssertionError("no data expected")

    def write_zeros(self, nbytes):
        self.f.seek(nbytes, io.SEEK_CUR)


def test_zip64_layout_past_4_gib(folder):
    """Records of 4 GiB and more and records past 4 GiB get zip64 fields that
    both Python's zipfile and torch's reader accept (layout checked byte for byte
    against torch.save on a real 4 GiB tensor during development)."""
    big = (1 << 32) + 100
    path = folder / "big.pt"
    recorder = torch_format.RecordingZipWriter()
    recorder.write_record("data.pkl", b"\x80\x02}q\x00.", 6)
    recorder.write_record_metadata("data/0", big)
    small = torch.arange(10, dtype=torch.float32).untyped_storage()  # written in a small-record batch
    recorder.records.append(torch_format.RecordSource("data/1", 40, storage=small))
    recorder.write_record("version", b"3\n", 2)
    plan = torch_format.CheckpointPlan("big", recorder.records, 64, compute_crc32=False)
    assert plan.records[2].layout.header_offset > 0xFFFFFFFF  # the layout is known before writing
    # the size is counted, not built, when planning: the count must match the bytes
    assert plan.size == plan.central_directory_offset + len(plan.central_directory())
    with open(path, "wb") as f:
        size = torch_format.write_plan(plan, SparseSink(f))
        f.truncate(size)
    assert size == plan.size == os.path.getsize(path)
    with zipfile.ZipFile(path) as z:
        infos = {i.filename: i for i in z.infolist()}
    assert infos["big/data/0"].file_size == big
    assert infos["big/data/1"].header_offset > 0xFFFFFFFF
    reader = torch._C.PyTorchFileReader(str(path))
    off0 = reader.get_record_offset("data/0")
    off1 = reader.get_record_offset("data/1")
    assert off0 % 64 == 0 and off1 % 64 == 0
    assert off1 >= off0 + big
    assert reader.get_record("data/1") == bytes(small)
    with open(path, "rb") as f:  # its data descriptor past 4 GiB: zip64's, sizes in 64 bits
        f.seek(off1 + 40)
        assert struct.unpack("<IIQQ", f.read(24)) == (0x08074B50, 0, 40, 40)
    header = open(path, "rb").read(30)
    assert struct.unpack("<I", header[:4])[0] == 0x04034B50


def test_planned_size_is_the_written_size(folder):
    """A plan counts its central directory's length without building it
    (names of several byte lengths, an empty record): the count is what is written."""
    obj = {"w": torch.randn(10, 10), "é": torch.zeros(0), "x" * 300: torch.ones(3)}
    plan = torch_format.CheckpointPlan.for_path(obj, str(folder / "ü.pt"), pickle, 2, False)
    assert plan.size == plan.central_directory_offset + len(plan.central_directory())
    fastpersist.save(obj, folder / "ü.pt")
    assert os.path.getsize(folder / "ü.pt") == plan.size


def test_files_load_with_vanilla_torch(folder):
    obj = {"w": torch.randn(10, 10)}
    fastpersist.save(obj, folder / "x.pt")
    assert torch.equal(vanilla_load(folder / "x.pt")["w"], obj["w"])
    assert os.path.getsize(folder / "x.pt") > 400
