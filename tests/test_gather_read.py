"""read_pipeline.pread_extents (one thread) reads runs of nearby extents with
one preadv each, and lands every byte where a pread per extent would."""
import ctypes
import os

import pytest
import torch

import fastpersist
from fastpersist import read_pipeline


def _file(tmp_path, nbytes: int):
    data = os.urandom(nbytes)
    path = tmp_path / "data.bin"
    path.write_bytes(data)
    return path, data


def _read(path, wanted, checksums=False):
    buffers = [ctypes.create_string_buffer(n) for _, n in wanted]
    extents = [(ctypes.addressof(b), offset, n) for b, (offset, n) in zip(buffers, wanted)]
    fd = os.open(path, os.O_RDONLY)
    try:
        crcs = read_pipeline.pread_extents(fd, str(path), extents, checksums)
    finally:
        os.close(fd)
    return [b.raw for b in buffers], crcs


@pytest.fixture
def preadv_calls(monkeypatch):
    calls = []
    real = os.preadv

    def counting(fd, buffers, offset, *args):
        calls.append(len(buffers))
        return real(fd, buffers, offset, *args)

    monkeypatch.setattr(os, "preadv", counting)
    return calls


def test_extents_with_gaps_land_in_place_in_one_call(tmp_path, preadv_calls):
    path, data = _file(tmp_path, 1 << 20)
    wanted = [(100 + i * 1000, 700) for i in range(300)]  # 300 pieces, 300-byte gaps
    got, crcs = _read(path, wanted, checksums=True)
    assert got == [data[o:o + n] for o, n in wanted]
    assert preadv_calls == [599]  # the pieces and the gaps between them
    import zlib
    assert crcs == {(o, n): zlib.crc32(data[o:o + n]) for o, n in wanted}


def test_runs_split_at_large_gaps_overlaps_and_the_iovec_limit(tmp_path, preadv_calls):
    path, data = _file(tmp_path, 4 << 20)
    wanted = [(i * 100, 50) for i in range(1000)]  # more pieces than one call takes
    wanted += [(3 << 20, 4096), (3 << 20, 4096), (3 << 20, 100), ((3 << 20) + 50, 200)]  # tied, overlapping
    got, _ = _read(path, wanted)
    assert got == [data[o:o + n] for o, n in wanted]
    assert len(preadv_calls) >= 4 and max(preadv_calls) < 1024


def test_a_file_that_ends_early(tmp_path):
    path, data = _file(tmp_path, 10_000)
    with pytest.raises(EOFError):
        _read(path, [(0, 100), (200, 100), (9_950, 100)])


def test_an_optimizer_state_load_into_reads_in_a_few_calls(tmp_path, preadv_calls):
    model = torch.nn.Sequential(*[torch.nn.Linear(8, 8) for _ in range(60)])
    opt = torch.optim.Adam(model.parameters())
    model(torch.randn(2, 8)).sum().backward()
    opt.step()
    path = tmp_path / "opt.pt"
    fastpersist.save(opt.state_dict(), path)
    target = opt.state_dict()
    for state in target["state"].values():
        for value in state.values():
            value.zero_()
    preadv_calls.clear()
    fastpersist.load_into(target, path)
    expected = torch.load(path)
    for key, state in expected["state"].items():
        for name, value in state.items():
            assert torch.equal(target["state"][key][name], value)
    assert len(preadv_calls) < 10  # 360 tensors


def test_a_failed_page_cache_read_names_the_file_and_offset(tmp_path, monkeypatch):
    import errno

    path = tmp_path / "f.bin"
    path.write_bytes(bytes(range(256)) * 64)
    out = bytearray(4096)
    address = ctypes.addressof(ctypes.c_char.from_buffer(out))

    def failing(fd, buffers, offset):
        raise OSError(errno.EIO, os.strerror(errno.EIO))

    monkeypatch.setattr(read_pipeline.os, "preadv", failing)
    fd = os.open(path, os.O_RDONLY)
    try:
        with pytest.raises(OSError) as raised:
            read_pipeline.pread_extents(fd, str(path), [(address, 8192, 4096)], False)
    finally:
        os.close(fd)
    assert raised.value.errno == errno.EIO and raised.value.filename == str(path)
    assert "offset 8192" in str(raised.value)
