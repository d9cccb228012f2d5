"""fastpersist.load (and the patched torch.load) of a file object: a plain
file opened read-only at its start is read by its path, through fastpersist;
every other file object goes to the original torch.load, which reads it."""
import gzip
import importlib
import io
import os
import struct
import zipfile

import pytest
import torch

import fastpersist
from fastpersist.patching import original_save

from corpus import assert_same, corpus

load_module = importlib.import_module("fastpersist.load")  # the module; the package's "load" is the function


@pytest.fixture
def routes(monkeypatch):
    """Which loads fastpersist read itself (the paths it opened) and which went to the original torch.load."""
    seen = {"fastpersist": [], "original": []}
    real_open = load_module._CheckpointImage.open.__func__
    monkeypatch.setattr(load_module._CheckpointImage, "open",
                        classmethod(lambda cls, path, options: seen["fastpersist"].append(path)
                                    or real_open(cls, path, options)))
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
        assert_same(fastpersist.load(f, weights_only=False), obj)
        assert f.tell() == 0
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
