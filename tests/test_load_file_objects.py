"""fastpersist.load (and the patched torch.load) of a file object: a plain
file opened read-only at its start is read by its path, through fastpersist;
every other file object goes to the original torch.load, which reads it."""
import gzip
import importlib
import io
import os
import pickle
import struct
import zipfile

import pytest
import torch

import fastpersist
from fastpersist.patching import original_load, original_save

from corpus import assert_same, corpus

load_module = importlib.import_module("fastpersist.load")  # the module; the package's "load" is the function


@pytest.fixture
def routes(monkeypatch):
    """Which loads fastpersist read itself (the paths it opened) and which went to the original torch.load."""
    seen = {"fastpersist": [], "original": []}
    real_open = load_module._CheckpointImage.open.__func__
    monkeypatch.setattr(load_module._CheckpointImage, "open",
                        classmethod(lambda cls, path, options, fd=None: seen["fastpersist"].append(path)
                                    or real_open(cls, path, options, fd)))
    real_original = fastpersist._torch_api._original_load
    monkeypatch.setattr(fastpersist._torch_api, "_original_load",
                        lambda *a, **k: seen["original"].append(a[0]) or real_original(*a, **k))
    return seen


@pytest.fixture
def checkpoint(tmp_path):
    obj = corpus()
    path = tmp_path / "c.pt"
    original_save()(obj, path)
    return obj, path


def test_a_file_opened_for_reading_is_read_by_its_path(checkpoint, routes):
    obj, path = checkpoint
    with open(path, "rb") as f:
        original_load()(f, weights_only=False)
        torch_leaves = f.tell()
    routes["original"].clear()
    with open(path, "rb") as f:
        assert_same(fastpersist.load(f, weights_only=False), obj)
        assert f.tell() == torch_leaves  # where torch's reader, reading the object, leaves it
    with open(path, "rb", buffering=0) as f:
        assert_same(fastpersist.load(f, weights_only=False), obj)
    assert routes["fastpersist"] == [str(path)] * 2 and routes["original"] == []


def test_fsspecs_local_file_is_read_by_its_path(checkpoint, routes):
    fsspec = pytest.importorskip("fsspec")
    obj, path = checkpoint
    with fsspec.filesystem("file").open(str(path), "rb") as f:  # what Lightning hands torch.load
        assert_same(fastpersist.load(f, weights_only=False), obj)
    assert routes["fastpersist"] == [str(path)] and routes["original"] == []


def test_the_patched_torch_load_reads_an_open_file_through_fastpersist(checkpoint, routes):
    obj, path = checkpoint
    was = fastpersist.is_patched()
    fastpersist.patch()
    try:
        with open(path, "rb") as f:
            got = torch.load(f, weights_only=False)
    finally:
        if not was:
            fastpersist.unpatch()
    assert_same(got, obj)
    assert routes["fastpersist"] == [str(path)]


def test_other_file_objects_are_read_by_torch(checkpoint, routes, tmp_path):
    obj, path = checkpoint
    data = path.read_bytes()
    with gzip.open(tmp_path / "c.pt.gz", "wb") as g:
        g.write(data)
    for buffering in (-1, 0):
        with open(path, "r+b", buffering=buffering) as f:  # open for writing: its unflushed bytes are the object's
            assert_same(fastpersist.load(f, weights_only=False), obj)
    with gzip.open(tmp_path / "c.pt.gz", "rb") as f:  # a wrapper: its name and descriptor are the compressed file's
        assert_same(fastpersist.load(f, weights_only=False), obj)
    assert_same(fastpersist.load(io.BytesIO(data), weights_only=False), obj)
    with open(tmp_path / "two.bin", "wb") as f:
        f.write(b"x" * 100 + data)
    with open(tmp_path / "two.bin", "rb") as f:
        f.seek(100)  # not at its start: torch reads from where it stands
        assert_same(fastpersist.load(f, weights_only=False), obj)
    assert routes["fastpersist"] == [] and len(routes["original"]) == 5


def test_a_file_whose_name_now_names_another_is_read_from_the_object(checkpoint, routes, tmp_path):
    obj, path = checkpoint
    with open(path, "rb") as f:
        os.rename(path, tmp_path / "moved.pt")
        original_save()({"other": torch.zeros(3)}, path)  # a new file at the old name
        assert_same(fastpersist.load(f, weights_only=False), obj)  # the opened file's checkpoint, not the new one
    assert routes["fastpersist"] == [] and len(routes["original"]) == 1


def test_verify_reads_an_open_file_and_finds_a_flipped_byte(checkpoint, tmp_path):
    obj, path = checkpoint
    data = bytearray(path.read_bytes())
    with open(path, "rb") as f:
        assert_same(fastpersist.load(f, weights_only=False, verify=True), obj)
    with zipfile.ZipFile(path) as z:
        info = z.getinfo("c/data/0")
    name_len, extra_len = struct.unpack_from("<HH", data, info.header_offset + 26)
    data[info.header_offset + 30 + name_len + extra_len] ^= 0xFF  # the first byte of a storage's data
    (tmp_path / "bad.pt").write_bytes(bytes(data))
    with open(tmp_path / "bad.pt", "rb") as f, pytest.raises(fastpersist.CheckpointError):
        fastpersist.load(f, weights_only=False, verify=True)


def test_a_buffered_reader_of_another_class_is_read_by_torch(checkpoint, routes):
    """A subclass may read otherwise (decrypt, count): only the object reads it."""
    obj, path = checkpoint

    class Counting(io.BufferedReader):
        reads = 0

        def read(self, *args):
            Counting.reads += 1
            return super().read(*args)

    with Counting(io.FileIO(path, "rb")) as f:
        assert_same(fastpersist.load(f, weights_only=False), obj)
    assert routes["fastpersist"] == [] and len(routes["original"]) == 1 and Counting.reads > 0


@pytest.fixture
def renamed_over_after_the_check(monkeypatch, tmp_path):
    """Once fastpersist has matched a file object to its name, another
    checkpoint is renamed over that name (a concurrent atomic save)."""
    incoming = tmp_path / "incoming.pt"
    original_save()({"w": torch.full((4,), 2.0)}, incoming)
    real = load_module._path_of_file_object

    def matched_then_replaced(f):
        path = real(f)
        if path is not None and incoming.exists():
            os.replace(incoming, path)
        return path

    monkeypatch.setattr(load_module, "_path_of_file_object", matched_then_replaced)
    return incoming


def test_an_open_file_is_read_from_its_descriptor_though_its_name_is_replaced(tmp_path, renamed_over_after_the_check):
    path = tmp_path / "latest.pt"
    original_save()({"w": torch.ones(4)}, path)
    with open(path, "rb") as f:
        got = fastpersist.load(f)
    assert not renamed_over_after_the_check.exists()  # the rename happened
    assert torch.equal(got["w"], torch.ones(4))


def test_a_refused_file_stays_refused_though_its_name_is_replaced(tmp_path, renamed_over_after_the_check):
    import fractions

    path = tmp_path / "latest.pt"
    original_save()({"w": torch.ones(4), "f": fractions.Fraction(1, 3)}, path)
    with open(path, "rb") as f, pytest.raises(pickle.UnpicklingError):
        fastpersist.load(f, weights_only=True)
    assert not renamed_over_after_the_check.exists()
