"""The engine's ordered reserve/commit interface (a producer fills the
engine's buffer in place; the engine computes the CRC and writes) and the
streaming of storages through it, which device storages take: driven here
by CPU storages through the same Python code (torch's copy_ into the
reserved buffer), forced on by a test-only switch."""
import errno
import zlib

import numpy as np
import pytest
import torch

import fastpersist
from fastpersist import FastFileWriter, _torch_api, torch_format

from conftest import SMALL, fail_third_copy, leftovers, vanilla_load
from corpus import corpus
import test_faults
from test_faults import assert_is, checkpoint, inject  # noqa: F401 - fixture
from test_format import both, normalized, same_serialization_id  # noqa: F401 - fixture

PAYLOAD = np.random.default_rng(1).integers(0, 256, size=300_001, dtype=np.uint8).tobytes()
BUFFER = SMALL["buffer_size"]


@pytest.fixture
def streamed(monkeypatch):
    """Every storage goes through reserve/commit, as a device storage would."""
    monkeypatch.setattr(_torch_api, "CAPTURE", "always")
    monkeypatch.setattr(torch_format, "STREAM_CPU_STORAGES", True)
    calls = []
    real = torch_format.stream_storage
    monkeypatch.setattr(torch_format, "stream_storage", lambda s, n, sink, crc, *more: (calls.append(n), real(s, n, sink, crc, *more))[1])
    return calls


def fill(writer, data, crc=0, piece=50_000):
    """Appends data through reservations of at most piece bytes."""
    done = 0
    while done < len(data):
        buffer = writer.reserve(min(piece, len(data) - done))
        assert 0 < len(buffer) <= min(piece, len(data) - done, BUFFER)
        buffer[:] = data[done:done + len(buffer)]
        crc = writer.commit(len(buffer), crc)
        done += len(buffer)
    return crc


@pytest.mark.parametrize("offset", [0, 1, 4096, 5000])
def test_reserved_bytes_land_in_order_with_their_crc(tmp_path, engine, offset):
    path = tmp_path / "r.bin"
    with FastFileWriter(path, offset, engine=engine, **SMALL) as w:
        w.write(PAYLOAD[:7])  # mixed with ordinary writes, at every buffer position
        crc = fill(w, PAYLOAD[7:200_000], zlib.crc32(PAYLOAD[:7]))
        w.write_address(np.frombuffer(PAYLOAD, np.uint8)[200_000:].ctypes.data, 100_001)
        assert w.tell() == offset + len(PAYLOAD)
    assert crc == zlib.crc32(PAYLOAD[:200_000])
    assert path.read_bytes() == b"\0" * offset + PAYLOAD


def test_reservation_rules(tmp_path, engine):
    path = tmp_path / "rules.bin"
    with FastFileWriter(path, engine=engine, **SMALL) as w:
        with pytest.raises(OSError) as info:
            w.commit(1)  # nothing reserved
        assert info.value.errno == errno.EINVAL
        buffer = w.reserve(10)
        buffer[:] = b"abcdefghij"
        with pytest.raises(OSError) as info:
            w.reserve(5)  # one at a time
        assert info.value.errno == errno.EBUSY
        with pytest.raises(OSError) as info:
            w.write(b"x")  # nothing else while reserved
        assert info.value.errno == errno.EBUSY
        with pytest.raises(OSError) as info:
            w.commit(11)  # more than reserved
        assert info.value.errno == errno.EINVAL
        w.reserve(10)[:4] = b"ABCD"  # the failed commit ended the reservation
        w.commit(4)
        w.reserve(3)
        w.commit(0)  # given up: appends nothing
        w.write(b"!")
        w.reserve(100)[:2] = b"zz"  # reserved, never committed: not part of the file
    assert path.read_bytes() == b"ABCD!"


def test_max_zero_is_refused(tmp_path):
    with FastFileWriter(tmp_path / "z.bin", **SMALL) as w:
        with pytest.raises(OSError) as info:
            w.reserve(0)
        assert info.value.errno == errno.EINVAL


@pytest.mark.parametrize("key", ["corpus", "big"])
def test_streamed_save_is_torchs_file(folder, streamed, key):
    """Storages larger than a buffer, views, shared and empty storages,
    every dtype: the same bytes as torch.save (CRCs included)."""
    obj = corpus() if key == "corpus" else {"w": torch.randn(5 * BUFFER // 4 + 3), "b": torch.arange(3)}
    ref, ours = both(obj, folder, **{})
    assert streamed  # the storages went through reserve/commit
    assert normalized(ref) == normalized(ours)


def test_streamed_save_with_small_buffers(folder, streamed):
    obj = {"w": torch.randn(300_000), "i": torch.arange(70_000), "e": torch.zeros(0)}
    fastpersist.save(obj, folder / "s.pt", **SMALL)
    assert sorted(streamed) == [70_000 * 8, 300_000 * 4]
    loaded = vanilla_load(folder / "s.pt")
    assert all(torch.equal(loaded[k], v) for k, v in obj.items())


@pytest.mark.parametrize("spec, code", [("write:3:EIO", errno.EIO), ("write:1+:ENOSPC", errno.ENOSPC)])
def test_streamed_write_failure_loses_nothing(folder, engine, inject, streamed, spec, code):
    """The fault-injection test of ordinary saves, its storages streamed."""
    test_faults.test_failed_write_loses_nothing_and_engine_is_dropped(folder, engine, inject, spec, code)
    assert streamed


def test_a_failing_copy_gives_the_reservation_up(folder, streamed, monkeypatch):
    """The producer's copy raising (a device error) fails the save, keeps the
    previous file and leaves the engine usable."""
    path = folder / "ckpt.pt"
    fastpersist.save(checkpoint(1), path, **SMALL)
    before = path.read_bytes()
    restore_copy = fail_third_copy(monkeypatch)
    with pytest.raises(RuntimeError, match="device copy failed"):
        fastpersist.save(checkpoint(2), path, **SMALL)
    restore_copy()
    assert path.read_bytes() == before
    assert leftovers(folder) == []
    fastpersist.save(checkpoint(3), path, **SMALL)
    assert_is(path, 3)
