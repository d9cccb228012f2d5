"""The engine's pull read (read_begin / read_next / read_release / read_end:
the engine hands a filled buffer to a consumer and reads into it again only
once released) and the loads built on it (device_io.read_into), which a
load to a GPU takes: driven here by CPU tensors through the same Python
code (plain copies in place of host-to-device copies), forced on by a
test-only switch. The GPU itself is tested in tests/test_gpu.py."""
import collections
import errno
import importlib
import os
import zlib

import numpy as np
import pytest
import torch

import fastpersist
from fastpersist import _engine, _torch_api, device_io, read_pipeline
from fastpersist.fileio import reading_engine
from fastpersist.options import Options

from conftest import SMALL, vanilla_load
from corpus import assert_same, corpus
from test_faults import idle_engines, inject  # noqa: F401 - fixture

load_module = importlib.import_module("fastpersist.load")
BUFFER = SMALL["buffer_size"]
DATA = np.random.default_rng(7).integers(0, 256, size=5 * BUFFER + 1234, dtype=np.uint8).tobytes()


@pytest.fixture
def data_file(tmp_path):
    path = tmp_path / "data.bin"
    path.write_bytes(DATA)
    fd = os.open(path, os.O_RDONLY)
    yield str(path), fd
    os.close(fd)


@pytest.fixture(params=["engine", "staged"])
def through_buffers(monkeypatch, request):
    """Every fastpersist.load and load_into reads as a load to a GPU does
    (device_io pieces, read_pipeline.read_pieces), with the source taken as
    the device (the engine's pull interface) or as the page cache (staged
    through host buffers by parallel readers); returns the reads' piece counts."""
    monkeypatch.setattr(load_module, "STREAM_LOADS", True)
    calls = []
    from_page_cache = request.param == "staged"
    monkeypatch.setattr(read_pipeline, "through_page_cache", lambda *a, **k: from_page_cache)
    staged_read = read_pipeline._staged_read
    monkeypatch.setattr(read_pipeline, "_staged_read",
                        lambda fd, path, pieces, *a, **k: (calls.append(len(pieces)), staged_read(fd, path, pieces, *a, **k))[1])
    real, deliver, inside = device_io.read_into, device_io.PullRead.deliver, []

    def read_into(*args, **kwargs):
        calls.append(len(args[4]))
        inside.append(True)
        try:
            return real(*args, **kwargs)
        finally:
            inside.pop()

    def delivered(self, pieces, *args, **kwargs):
        if not inside:  # load_into begins its pull read before it knows the pieces, and hands them over later
            calls.append(len(pieces))
        return deliver(self, pieces, *args, **kwargs)

    monkeypatch.setattr(device_io, "read_into", read_into)
    monkeypatch.setattr(device_io.PullRead, "deliver", delivered)
    return calls


def pull(e, hold: int = 0):
    """Everything a pull read hands over, as (bytes, offset); releases each
    buffer once `hold` later ones have been handed over."""
    out, held = [], collections.deque()
    while True:
        got = e.read_next()
        if got is None:
            break
        index, address, length, offset = got
        assert 0 < length <= BUFFER
        out.append((bytes(_engine.memory_at(address, length)), offset))
        held.append(index)
        if len(held) > hold:
            e.read_release(held.popleft())
    e.read_end()
    return out


@pytest.mark.parametrize("offset, length", [(0, len(DATA)), (1, 3 * BUFFER), (4095, 10), (BUFFER, BUFFER),
                                            (len(DATA) - 5, 5), (100, 0)])
def test_pull_read_hands_over_the_range_in_order(data_file, engine, offset, length):
    path, fd = data_file
    with reading_engine(path, Options(engine=engine, **SMALL)) as (e, direct_fd):
        e.read_begin(direct_fd, fd, offset, length, path)
        pieces = pull(e)
    assert b"".join(p for p, _ in pieces) == DATA[offset:offset + length]
    assert [o for _, o in pieces] == [offset + sum(len(p) for p, _ in pieces[:i]) for i in range(len(pieces))]


def test_pull_read_stops_at_the_end_of_the_file(data_file, engine):
    path, fd = data_file
    with reading_engine(path, Options(engine=engine, **SMALL)) as (e, direct_fd):
        e.read_begin(direct_fd, fd, len(DATA) - 100, 10 * BUFFER, path)
        pieces = pull(e)
    assert b"".join(p for p, _ in pieces) == DATA[-100:]



@pytest.mark.parametrize("queue_depth", [2, 6])
@pytest.mark.parametrize("hold", [0, 1])
def test_pull_read_with_fewer_request_slots_than_its_buffers_need(data_file, engine, queue_depth, hold):
    """A buffer needs 4 requests here. The read never waits for request
    slots when it starts or when a buffer is released (a buffer with too
    few slots free is issued by read_next once they free up), and a free
    buffer waiting for slots is not a consumer holding every buffer (EBUSY)."""
    path, fd = data_file
    with reading_engine(path, Options(engine=engine, **dict(SMALL, queue_depth=queue_depth))) as (e, direct_fd):
        e.read_begin(direct_fd, fd, 0, len(DATA), path)
        pieces = pull(e, hold=hold)
    assert b"".join(p for p, _ in pieces) == DATA

def test_buffers_held_by_the_consumer_are_not_read_into(data_file):
    """With both buffers held nothing can be read ahead (EBUSY); what was
    handed over stays intact until released, in order."""
    path, fd = data_file
    with reading_engine(path, Options(**SMALL)) as (e, direct_fd):
        e.read_begin(direct_fd, fd, 0, len(DATA), path)
        first, second = e.read_next(), e.read_next()
        with pytest.raises(OSError) as info:
            e.read_next()
        assert info.value.errno == errno.EBUSY
        with pytest.raises(OSError) as info:
            e.read_release(second[0])  # not the oldest
        assert info.value.errno == errno.EINVAL
        e.read_release(first[0])
        third = e.read_next()
        assert third[0] == first[0] and third[3] == 2 * BUFFER
        assert bytes(_engine.memory_at(second[1], second[2])) == DATA[BUFFER:2 * BUFFER]
        assert bytes(_engine.memory_at(third[1], third[2])) == DATA[2 * BUFFER:3 * BUFFER]
        e.read_release(second[0])
        e.read_release(third[0])
        rest = pull(e, hold=1)
    assert b"".join(p for p, _ in rest) == DATA[3 * BUFFER:]


def test_pull_read_rules(data_file):
    path, fd = data_file
    with reading_engine(path, Options(**SMALL)) as (e, direct_fd):
        for call in (e.read_next, e.read_end, lambda: e.read_release(0)):
            with pytest.raises(OSError) as info:
                call()  # no pull read going on
            assert info.value.errno == errno.EINVAL
        e.read_begin(direct_fd, fd, 0, len(DATA), path)
        with pytest.raises(OSError) as info:
            e.read_release(0)  # nothing handed over yet
        assert info.value.errno == errno.EINVAL
        with pytest.raises(OSError) as info:
            e.read_begin(direct_fd, fd, 0, 10, path)  # one at a time
        assert info.value.errno == errno.EBUSY
        with pytest.raises(OSError) as info:
            e.pread_into(direct_fd, fd, 0, 0, 0)  # nothing else meanwhile
        assert info.value.errno == errno.EBUSY
        e.read_next()
        e.read_end()  # ends with a buffer still held
        buf = bytearray(10)
        assert e.pread_into(direct_fd, fd, _address(buf), 10, 3) == 10 and bytes(buf) == DATA[3:13]


def _address(buf: bytearray) -> int:
    import ctypes

    return ctypes.addressof((ctypes.c_char * len(buf)).from_buffer(buf))


@pytest.mark.parametrize("spec, code", [("read:2:EIO", errno.EIO), ("read:1+:ENOSPC", errno.ENOSPC)])
def test_a_failed_read_is_raised_and_the_engine_dropped(data_file, engine, inject, spec, code):
    path, fd = data_file
    inject(spec)
    e = _engine.acquire(Options(engine=engine, **SMALL))
    try:
        with pytest.raises(OSError) as info:
            e.read_begin(-1, fd, 0, len(DATA), path)  # psync reads as it queues: its error can come here
            pull(e)
        assert info.value.errno == code
        assert not e.usable
    finally:
        _engine.release(e)
    assert e not in idle_engines()


def test_read_into_copies_pieces_with_their_crcs(data_file, engine):
    """Pieces at any alignment, sharing bytes, across buffers, empty."""
    path, fd = data_file
    spans = [(0, 10), (7, 2 * BUFFER), (7, 2 * BUFFER), (3 * BUFFER - 1, 2), (len(DATA) - 1000, 1000), (50, 0)]
    pieces = [device_io.Piece(o, n, torch.empty(n, dtype=torch.uint8)) for o, n in spans]
    with reading_engine(path, Options(engine=engine, **SMALL)) as (e, direct_fd):
        crcs = device_io.read_into(e, direct_fd, fd, path, pieces, checksums=True)
        for p in pieces:
            assert bytes(p.target.numpy()) == DATA[p.offset:p.offset + p.nbytes]
            if p.nbytes:
                assert crcs[p.offset, p.nbytes] == zlib.crc32(DATA[p.offset:p.offset + p.nbytes])
        with pytest.raises(EOFError):
            device_io.read_into(e, direct_fd, fd, path, [device_io.Piece(len(DATA) - 10, 20, torch.empty(20, dtype=torch.uint8))])
        assert e.usable  # the file's end is no failure of the engine


def test_a_failing_copy_ends_the_read(data_file, monkeypatch):
    """The consumer's copy raising (a device error; here the copy of a
    buffer into CPU memory) ends the pull read; the engine stays usable."""
    path, fd = data_file
    pieces = [device_io.Piece(0, len(DATA), torch.empty(len(DATA), dtype=torch.uint8))]
    real_copy_many, calls = device_io._engine.copy_many, []

    def copy_many(*args, **kwargs):
        calls.append(1)
        if len(calls) == 3:
            raise RuntimeError("device copy failed")
        return real_copy_many(*args, **kwargs)

    with reading_engine(path, Options(**SMALL)) as (e, direct_fd):
        monkeypatch.setattr(device_io._engine, "copy_many", copy_many)
        with pytest.raises(RuntimeError, match="device copy failed"):
            device_io.read_into(e, direct_fd, fd, path, pieces)
        monkeypatch.setattr(device_io._engine, "copy_many", real_copy_many)
        assert e.usable
        device_io.read_into(e, direct_fd, fd, path, pieces)
    assert bytes(pieces[0].target.numpy()) == DATA


# -- loads through the pull read ----------------------------------------------

@pytest.mark.parametrize("map_location", [None, "cpu", torch.device("cpu"), {"cpu": "cpu"}])
@pytest.mark.parametrize("weights_only", [True, False])
def test_load_through_buffers_is_torchs_result(tmp_path, through_buffers, map_location, weights_only):
    obj = corpus()
    path = tmp_path / "c.pt"
    torch.save(obj, path)
    ours = fastpersist.load(path, map_location=map_location, weights_only=weights_only)
    assert through_buffers
    assert_same(vanilla_load(path, map_location=map_location), ours)


def test_load_through_buffers_keeps_storages_shared(tmp_path, through_buffers):
    w = torch.randn(100, 100)
    path = tmp_path / "s.pt"
    torch.save({"w": w, "tied": w, "view": w[3:5, 1:7], "e": torch.zeros(0)}, path)
    out = fastpersist.load(path)
    assert out["tied"].data_ptr() == out["w"].data_ptr()
    assert out["view"].untyped_storage().data_ptr() == out["w"].untyped_storage().data_ptr()
    assert torch.equal(out["view"], w[3:5, 1:7])
    assert through_buffers == [1]  # one storage for w, its tie and its view (the empty tensor reads nothing)


def test_load_through_buffers_verifies(tmp_path, through_buffers):
    path = tmp_path / "v.pt"
    torch.save({"a": torch.randn(50_000), "b": torch.arange(7)}, path)
    assert torch.equal(fastpersist.load(path, verify=True)["b"], torch.arange(7))
    raw = bytearray(path.read_bytes())
    raw[raw.index(torch.arange(7).numpy().tobytes()) + 3] ^= 1
    path.write_bytes(bytes(raw))
    with pytest.raises(fastpersist.CheckpointError, match="fails its CRC-32"):
        fastpersist.load(path, verify=True)


def test_load_through_buffers_of_a_truncated_file(tmp_path, through_buffers, monkeypatch):
    """The file shrinking after its index was read: a clear error, not zeros."""
    path = tmp_path / "t.pt"
    torch.save({"a": torch.randn(300_000)}, path)
    real = read_pipeline.read_pieces

    def shrink_first(*args, **kwargs):
        os.truncate(path, 600_000)
        return real(*args, **kwargs)

    monkeypatch.setattr(read_pipeline, "read_pieces", shrink_first)
    with pytest.raises(fastpersist.CheckpointError, match="ended before"):
        fastpersist.load(path)


def test_what_takes_the_path_through_buffers(tmp_path, through_buffers):
    """Callable map_locations, and pickles whose rebuild functions read
    map_location themselves, keep torch's path; so do CPU loads unless forced."""
    path = tmp_path / "p.pt"
    torch.save({"a": torch.arange(5)}, path)
    assert torch.equal(fastpersist.load(path, map_location=lambda s, loc: s)["a"], torch.arange(5))
    assert through_buffers == []
    assert _torch_api.pickle_reads_map_location(b"...torch._utils\n_rebuild_wrapper_subclass\n...")
    assert not _torch_api.pickle_reads_map_location(path.read_bytes())
    load_module.STREAM_LOADS = False
    fastpersist.load(path)
    fastpersist.load(path, map_location={"cuda:0": "cuda:0"})  # no CUDA location in the file, with CUDA or not
    assert through_buffers == []
    if torch.cuda.is_available():
        fastpersist.load(path, map_location={"cpu": "cuda:0"})  # the file's location, renamed to a CUDA one
        assert len(through_buffers) == 1


def test_restore_targets_follow_torch():
    assert _torch_api.restore_target(None, "cuda:1") == "cuda:1"
    assert _torch_api.restore_target("cuda", "cpu") == "cuda"
    assert _torch_api.restore_target(torch.device("cuda", 2), "cpu") == "cuda:2"
    assert _torch_api.restore_target({"cuda:0": "cpu"}, "cuda:0") == "cpu"
    assert _torch_api.restore_target({"cuda:0": "cpu"}, "cuda:1") == "cuda:1"
    assert _torch_api.cuda_restore_device("cpu") is None
    assert _torch_api.cuda_restore_device("cudagraph") is None
    if not torch.cuda.is_available():
        with pytest.raises(RuntimeError, match="torch.cuda.is_available.. is False"):
            _torch_api.cuda_restore_device("cuda:0")  # torch's own words


def test_load_into_through_buffers(tmp_path, through_buffers):
    sd = {"w": torch.randn(300, 200), "b": torch.arange(10.0), "nc": torch.randn(6, 4), "x": torch.randn(70_000)}
    path = tmp_path / "li.pt"
    torch.save(sd, path)
    target = {"w": torch.zeros(300, 200), "b": torch.zeros(10), "nc": torch.zeros(4, 6).t(), "x": torch.zeros(70_000)}
    fastpersist.load_into(target, path, verify=True, **SMALL)
    assert through_buffers == [4]  # three tensors in place, one staged
    assert all(torch.equal(target[k], sd[k]) for k in sd)
