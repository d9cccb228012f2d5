"""Fault injection (FASTPERSIST_FAULT_INJECT, read by the C engine when it is
created): every failure ends in the right exception or the right fallback,
the previous checkpoint survives, no temporary is left, and an engine that
failed is never handed out again."""
import errno

import pytest
import torch

import fastpersist
from fastpersist import _engine
from fastpersist.options import Options, current_options

from conftest import ENGINES, SMALL, leftovers, vanilla_load


@pytest.fixture
def inject(monkeypatch):
    """inject("write:3:EIO") makes engines created from now on fail so."""
    def arm(spec):
        if spec is None:
            monkeypatch.delenv("FASTPERSIST_FAULT_INJECT", raising=False)
        else:
            monkeypatch.setenv("FASTPERSIST_FAULT_INJECT", spec)
        _engine.clear_pool()
        _engine._open_faults_seen = 0

    arm(None)
    yield arm
    arm(None)


def checkpoint(generation):
    g = torch.Generator().manual_seed(generation)
    # 1.2 MB over 64 KiB buffers and 16 KiB requests: ~75 write requests
    return {"generation": generation, "a": torch.randn(200_000, generator=g), "b": torch.randn(100_000, generator=g)}


def assert_is(path, generation):
    loaded = vanilla_load(path)
    expected = checkpoint(generation)
    assert loaded["generation"] == generation
    assert torch.equal(loaded["a"], expected["a"]) and torch.equal(loaded["b"], expected["b"])


def idle_engines():
    return [e for idle in _engine._idle.values() for e in idle]


@pytest.mark.parametrize("spec, code", [
    ("write:3:EIO", errno.EIO),
    ("write:40:ENOSPC", errno.ENOSPC),
    ("write:1+:EIO", errno.EIO),         # every write fails: many requests in flight at once
    ("submit:2:EIO", errno.EIO),         # the kernel refuses a submission for good
    ("submit:1+:EAGAIN", errno.EAGAIN),  # a refusal that lasts fails instead of spinning
    ("open:1:EIO", errno.EIO),           # the O_DIRECT open fails otherwise than with EINVAL
    ("write:1+:EAGAIN", errno.EAGAIN),   # a transfer refused for good fails instead of retrying forever
    ("write:2+:EINTR", errno.EINTR),
])
def test_failed_write_loses_nothing_and_engine_is_dropped(folder, engine, inject, spec, code):
    path = folder / "ckpt.pt"
    fastpersist.save(checkpoint(1), path, engine=engine, **SMALL)
    before = path.read_bytes()
    inject(spec)
    with pytest.raises(OSError) as info:
        fastpersist.save(checkpoint(2), path, engine=engine, **SMALL)
    assert info.value.errno == code
    assert info.value.filename == str(path)
    assert "fastpersist" in str(info.value)
    assert path.read_bytes() == before
    assert leftovers(folder) == []
    assert idle_engines() == [] and _engine.pool_size() == 0  # the failed engine was not pooled

    inject(None)  # a new engine works
    fastpersist.save(checkpoint(3), path, engine=engine, **SMALL)
    assert_is(path, 3)


@pytest.mark.parametrize("spec", ["write:2:short", "write:1+:short", "write:5:EAGAIN", "write:3:EINTR",
                                  "submit:1:EAGAIN", "submit:2:EBUSY", "submit:1:EINTR"])
def test_transient_write_faults_are_retried(folder, engine, inject, spec):
    """Short transfers are finished, EAGAIN/EINTR completions and refused
    submissions tried again: the save succeeds with the right bytes."""
    path = folder / "ckpt.pt"
    inject(spec)
    fastpersist.save(checkpoint(4), path, engine=engine, **SMALL)
    assert_is(path, 4)
    assert leftovers(folder) == []
    assert all(e.usable for e in idle_engines())


# read:30 fails with earlier buffers already handed to load_into's copy-out thread
@pytest.mark.parametrize("spec, code", [("read:2:EIO", errno.EIO), ("read:30:EIO", errno.EIO),
                                        ("read:1+:EIO", errno.EIO)])
def test_failed_read_raises(folder, engine, inject, spec, code):
    path = folder / "ckpt.pt"
    fastpersist.save(checkpoint(5), path, **SMALL)
    inject(spec)
    with pytest.raises(OSError) as info:
        _load(path, engine)
    assert info.value.errno == code
    assert info.value.filename == str(path)
    target = {k: torch.zeros_like(v) if isinstance(v, torch.Tensor) else v for k, v in checkpoint(5).items()}
    # an engine idle for load_into too (a small file with none reads without one)
    _engine.release(_engine.acquire(current_options().replace(engine=engine, **SMALL)))
    with pytest.raises(OSError) as info:
        fastpersist.load_into(target, path, engine=engine, **SMALL)
    assert info.value.errno == code
    assert idle_engines() == []


def _load(path, engine):
    fastpersist.patch(engine=engine, **SMALL)  # load takes its options from patch()
    # an engine idle, as in a process that saved before: a small load finding
    # none reads without the engine (load.SMALL_LOAD_BYTES)
    _engine.release(_engine.acquire(current_options()))
    try:
        return fastpersist.load(path, weights_only=False)
    finally:
        fastpersist.unpatch()


@pytest.mark.parametrize("spec", ["read:1:short", "read:1+:short", "read:3:EAGAIN", "submit:1:EAGAIN"])
def test_transient_read_faults_are_retried(folder, engine, inject, spec):
    path = folder / "ckpt.pt"
    fastpersist.save(checkpoint(6), path, **SMALL)
    inject(spec)
    loaded = _load(path, engine)
    assert torch.equal(loaded["a"], checkpoint(6)["a"])
    target = {k: torch.zeros_like(v) if isinstance(v, torch.Tensor) else v for k, v in checkpoint(6).items()}
    fastpersist.load_into(target, path, engine=engine, **SMALL)
    assert torch.equal(target["b"], checkpoint(6)["b"])


def test_refused_setup_falls_back_in_order(folder, inject, log_records):
    """auto: io_uring refused -> libaio; both refused -> psync; each said once."""
    if ENGINES != ["psync", "libaio", "io_uring"]:
        pytest.skip("needs every engine usable here")
    inject("io_uring_setup:1:EPERM")
    fastpersist.save(checkpoint(7), folder / "a.pt", **SMALL)
    assert _engine._auto_kind == "libaio"
    inject("io_uring_setup:1:ENOSYS,libaio_setup:1:ENOSYS")
    fastpersist.save(checkpoint(7), folder / "b.pt", **SMALL)
    assert _engine._auto_kind == "psync"
    assert_is(folder / "a.pt", 7)
    assert_is(folder / "b.pt", 7)
    messages = [r.getMessage() for r in log_records.records if "using the" in r.getMessage()]
    assert messages == ["fastpersist: using the libaio engine (io_uring: Operation not permitted)",
                        "fastpersist: using the psync engine (io_uring: Function not implemented; "
                        "libaio: Function not implemented)"]


def test_named_engine_refused_is_an_error(inject):
    inject("io_uring_setup:1:EPERM")
    with pytest.raises(OSError) as info:
        _engine.acquire(Options(engine="io_uring", **SMALL))
    assert info.value.errno == errno.EPERM
    assert "io_uring" in str(info.value)
    assert _engine.pool_size() == 0


def test_refused_mlock_is_reported_and_harmless(folder, inject, log_records, monkeypatch):
    monkeypatch.setattr(_engine, "_memlock_reported", False)
    inject("mlock:1:ENOMEM")
    fastpersist.save(checkpoint(8), folder / "m.pt", **SMALL)
    assert_is(folder / "m.pt", 8)
    assert [e.memory_locked for e in idle_engines()] == [False]
    assert any("could not lock" in r.getMessage() and "Cannot allocate memory" in r.getMessage()
               for r in log_records.records)


def test_o_direct_refused_at_open_falls_back_to_buffered(folder, engine, inject):
    inject("open:1+:EINVAL")
    with fastpersist.FastFileWriter(folder / "b.bin", engine=engine, **SMALL) as w:
        assert not w.direct
        w.write(b"x" * 300_001)
    assert (folder / "b.bin").read_bytes() == b"x" * 300_001
    fastpersist.save(checkpoint(9), folder / "c.pt", engine=engine, **SMALL)
    assert_is(folder / "c.pt", 9)


@pytest.mark.parametrize("spec", ["write", "write:1", "write:0:EIO", "write:x:EIO", "write:1:EWHAT", "disk:1:EIO",
                                  ",".join(["write:1:EIO"] * 9)])
def test_malformed_fault_list_is_refused(inject, spec):
    inject(spec)
    with pytest.raises(OSError) as info:
        _engine.acquire(Options(engine="psync", **SMALL))
    assert info.value.errno == errno.EINVAL


def test_failed_engine_refuses_further_operations(folder, engine, inject):
    """The C engine itself refuses reuse (-ENOTRECOVERABLE), whoever holds it."""
    inject("write:1:EIO")
    e = _engine.acquire(Options(engine=engine, **SMALL))
    import os
    fd = os.open(folder / "x.bin", os.O_WRONLY | os.O_CREAT)
    try:
        e.begin(-1, fd, 0, str(folder / "x.bin"))
        with pytest.raises(OSError) as info:
            e.write(b"y" * 100_000)
            e.end()
        assert info.value.errno == errno.EIO
        e.abort()
        assert not e.usable
        with pytest.raises(OSError) as info:
            e.begin(-1, fd, 0, str(folder / "x.bin"))
        assert info.value.errno == errno.ENOTRECOVERABLE
        assert "failed earlier" in str(info.value)
    finally:
        os.close(fd)
        _engine.release(e)
    assert idle_engines() == []
