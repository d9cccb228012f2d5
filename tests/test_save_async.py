"""fastpersist.save_async: snapshot isolation, errors through wait(), order,
exit with saves in flight, fork, and the snapshot memory bound."""
import errno
import importlib
import os
import subprocess
import sys
import zipfile

import pytest
import torch

import fastpersist
from fastpersist import _engine

from conftest import fork_child, leftovers, vanilla_load

async_save = importlib.import_module("fastpersist.async_save")


def state(seed, n=2_000_000):
    g = torch.Generator().manual_seed(seed)
    return {"w": torch.randn(n, generator=g), "b": torch.arange(1000) + seed, "step": seed,
            "nested": {"h": torch.randn(3, 7, generator=g).half()}}


def assert_state(path, seed):
    loaded, expected = vanilla_load(path), state(seed)
    assert loaded["step"] == seed
    for key in ("w", "b"):
        assert torch.equal(loaded[key], expected[key])
    assert torch.equal(loaded["nested"]["h"], expected["nested"]["h"])


def records(path):
    with zipfile.ZipFile(path) as z:
        return {i.filename: z.read(i) for i in z.infolist() if not i.filename.endswith("serialization_id")}


def test_mutating_tensors_after_return_does_not_change_the_file(folder):
    obj = state(1)
    handle = fastpersist.save_async(obj, folder / "a.pt")
    obj["w"].zero_()  # at once, while the background write has hardly begun
    obj["b"].fill_(-1)
    obj["nested"]["h"].zero_()
    assert handle.result() == os.path.getsize(folder / "a.pt")
    assert handle.done()
    assert_state(folder / "a.pt", 1)
    # the same records, byte for byte, as a synchronous save of the same object
    fastpersist.save(state(1), folder / "s.pt")
    os.rename(folder / "s.pt", folder / "s2.pt")
    os.rename(folder / "a.pt", folder / "a2.pt")
    assert {k.split("/", 1)[1]: v for k, v in records(folder / "a2.pt").items()} == \
           {k.split("/", 1)[1]: v for k, v in records(folder / "s2.pt").items()}
    assert leftovers(folder) == []


def test_background_error_is_raised_by_wait_and_loses_nothing(folder, monkeypatch, caplog):
    fastpersist.save(state(1, 1000), folder / "c.pt")
    before = (folder / "c.pt").read_bytes()
    monkeypatch.setenv("FASTPERSIST_FAULT_INJECT", "write:2:EIO")
    _engine.clear_pool()
    try:
        handle = fastpersist.save_async(state(2), folder / "c.pt", engine="psync")
        with pytest.raises(OSError) as info:
            handle.wait()
    finally:
        monkeypatch.delenv("FASTPERSIST_FAULT_INJECT")
        _engine.clear_pool()
    assert info.value.errno == errno.EIO and info.value.filename == str(folder / "c.pt")
    assert handle.done()
    with pytest.raises(OSError):
        handle.result()  # asked again: the same error
    assert (folder / "c.pt").read_bytes() == before
    assert leftovers(folder) == []
    assert any("background save" in r.getMessage() and r.levelname == "ERROR" for r in caplog.records)


def test_saves_to_one_path_land_in_submission_order(folder, monkeypatch):
    order = []
    save_module = importlib.import_module("fastpersist.save")
    real = save_module.write_plan_to_path

    def spy(plan, path, opts, **kwargs):
        size = real(plan, path, opts, **kwargs)
        order.append(vanilla_load(path)["step"])
        return size

    monkeypatch.setattr(save_module, "write_plan_to_path", spy)
    handles = [fastpersist.save_async(state(i, 200_000), folder / "ckpt.pt") for i in range(4)]
    handles[-1].wait()
    assert all(h.done() for h in handles)
    assert order == [0, 1, 2, 3]
    assert_state_small = vanilla_load(folder / "ckpt.pt")
    assert assert_state_small["step"] == 3


def test_a_synchronous_save_waits_for_earlier_async_saves_to_the_same_path(folder):
    first = fastpersist.save_async(state(1, 4_000_000), folder / "ckpt.pt")
    fastpersist.save(state(2, 1000), folder / "ckpt.pt")
    assert first.done()  # it had to land first: the newer checkpoint is the one that stays
    assert vanilla_load(folder / "ckpt.pt")["step"] == 2


def test_wrong_targets_are_refused(folder):
    with pytest.raises(TypeError, match="paths"):
        fastpersist.save_async({"a": 1}, open(folder / "x.pt", "wb"))
    with pytest.raises(TypeError, match="parent folder does not exist"):
        fastpersist.save_async({"a": 1}, folder / "missing" / "x.pt")


def test_snapshot_memory_is_bounded_and_reused(folder):
    memory = async_save._writer.memory
    async_save.wait_for_all()
    async_save.release_snapshot_memory()
    assert memory.total == 0
    with pytest.raises(ValueError, match="snapshot_memory=1048576"):
        fastpersist.save_async(state(1), folder / "big.pt", snapshot_memory=1 << 20)
    for seed in (1, 2, 3):
        fastpersist.save_async(state(seed), folder / "r.pt", snapshot_memory=128 << 20).wait()
    assert memory.total == 64 << 20  # one 64 MiB arena, reused by all three
    assert_state(folder / "r.pt", 3)
    # a bound that holds one snapshot at a time: the next save waits for the previous one
    handles = [fastpersist.save_async(state(s), folder / f"q{s}.pt", snapshot_memory=64 << 20) for s in (4, 5, 6)]
    for s, h in zip((4, 5, 6), handles):
        h.wait()
        assert_state(folder / f"q{s}.pt", s)
    assert memory.total <= 64 << 20
    async_save.release_snapshot_memory()
    assert memory.total == 0


def test_exit_waits_for_saves_in_flight_and_reports_unobserved_failures(folder):
    script = (
        "import torch, fastpersist\n"
        f"fastpersist.save_async({{'w': torch.arange(40_000_000), 'step': 1}}, {str(folder / 'exit.pt')!r})\n"
        f"fastpersist.save_async({{'w': torch.arange(10)}}, {str(folder / 'fail.pt')!r}, engine='psync')\n"
        "print('returned', flush=True)\n"
    )
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300,
                         env={**os.environ, "FASTPERSIST_AUTOPATCH": "0", "FASTPERSIST_FAULT_INJECT": ""})
    assert out.returncode == 0, out.stderr
    assert "returned" in out.stdout
    assert torch.equal(vanilla_load(folder / "exit.pt")["w"], torch.arange(40_000_000))
    assert leftovers(folder) == []
    # the same with a background failure nobody waited for: said on stderr
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300,
                         env={**os.environ, "FASTPERSIST_AUTOPATCH": "0",
                              "FASTPERSIST_FAULT_INJECT": "io_uring_setup:1:EPERM,libaio_setup:1:EPERM,write:1+:EIO"})
    assert out.returncode == 0
    assert "ERROR: the background save of" in out.stderr and "nobody called wait()" in out.stderr


def test_save_async_in_a_forked_child(folder, monkeypatch):
    import threading

    fastpersist.save_async(state(1, 1000), folder / "parent.pt").wait()  # the writer thread exists
    gate = threading.Event()
    save_module = importlib.import_module("fastpersist.save")
    real = save_module.write_plan_to_path

    def held(plan, path, opts, **kwargs):  # keeps the parent's second save in flight across the fork
        if str(path).endswith("parent2.pt"):
            gate.wait(60)
        return real(plan, path, opts, **kwargs)

    monkeypatch.setattr(save_module, "write_plan_to_path", held)
    pending = fastpersist.save_async(state(3, 1000), folder / "parent2.pt")

    def child():
        fastpersist.save_async(state(2, 100_000), folder / "child.pt").wait()  # the child's own writer
        try:
            pending.wait(timeout=5)
        except RuntimeError as exc:  # the parent's save fails here instead of blocking
            assert "belongs to process" in str(exc)
            return
        raise AssertionError("the parent's pending save neither failed nor blocked in the child")

    assert not pending.done()
    pid = fork_child(child)
    _, status = os.waitpid(pid, 0)
    gate.set()
    assert os.waitstatus_to_exitcode(status) == 0
    pending.wait()
    assert vanilla_load(folder / "child.pt")["step"] == 2
    assert vanilla_load(folder / "parent2.pt")["step"] == 3
    assert leftovers(folder) == []


def _save_in_child(path):
    torch.set_num_threads(1)  # torch 2.13 hangs in a forked child's parallel ops otherwise
    fastpersist.save_async({"w": torch.arange(5_000_000), "step": 9}, path)  # returns without waiting


def test_a_multiprocessing_fork_child_exiting_with_a_save_in_flight_keeps_it(folder):
    """Such children end with os._exit, which skips atexit handlers."""
    import multiprocessing

    child = multiprocessing.get_context("fork").Process(target=_save_in_child, args=(str(folder / "mp.pt"),))
    child.start()
    child.join(120)
    assert child.exitcode == 0
    assert vanilla_load(folder / "mp.pt")["step"] == 9
    assert leftovers(folder) == []


def test_failed_saves_keep_no_engine_or_snapshot_alive(folder, monkeypatch):
    import gc

    def engines():
        gc.collect()
        return sum(type(o) is _engine.Engine for o in gc.get_objects())  # isinstance pokes deprecated torch proxies

    monkeypatch.setenv("FASTPERSIST_FAULT_INJECT", "write:1+:EIO")
    _engine.clear_pool()
    async_save.wait_for_all()
    before = engines()
    handles = [fastpersist.save_async(state(i, 1_000_000), folder / "f.pt", engine="psync") for i in range(4)]
    for h in handles:
        with pytest.raises(OSError):
            h.wait()
    monkeypatch.delenv("FASTPERSIST_FAULT_INJECT")
    _engine.clear_pool()
    assert engines() <= before  # the stored errors' tracebacks hold no engine
    memory = async_save._writer.memory
    assert sum(a.size for a in memory.free) == memory.total  # every snapshot arena came back


class _Holder:
    """A tensor inside an object the container walk does not open."""

    def __init__(self, t):
        self.t = t


def test_the_copy_overlaps_planning_and_covers_every_layout(folder, monkeypatch):
    """Tensors the container walk finds are copied during the pickling (no
    snapshot after planning); tied tensors, views at offsets, a Parameter,
    bf16 and empty tensors keep their bytes; mutating right after return
    changes nothing; a file equal to a synchronous save's."""
    after_planning = []
    real = async_save._snapshot
    monkeypatch.setattr(async_save, "_snapshot", lambda *a: (after_planning.append(1), real(*a))[1])
    g = torch.Generator().manual_seed(5)
    base = torch.randn(3_000_000, generator=g)
    obj = {"w": base, "view": base[1000:2000], "tied": base, "p": torch.nn.Parameter(torch.randn(77, generator=g)),
           "bf": torch.randn(5000, generator=g).bfloat16(), "empty": torch.zeros(0), "list": [torch.arange(9), (7,)],
           "step": 3}
    expected = {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in obj.items() if k != "list"}
    handle = fastpersist.save_async(obj, folder / "a.pt")
    base.zero_()
    obj["p"].data.zero_()
    obj["bf"].zero_()
    obj["list"][0].zero_()
    handle.wait()
    assert after_planning == []  # all found and copied by the early copy
    loaded = vanilla_load(folder / "a.pt")
    for key, value in expected.items():
        assert torch.equal(loaded[key], value) if isinstance(value, torch.Tensor) else loaded[key] == value, key
    assert torch.equal(loaded["list"][0], torch.arange(9))
    assert loaded["view"].untyped_storage().data_ptr() == loaded["w"].untyped_storage().data_ptr()  # still tied


def test_tensors_the_walk_cannot_see_are_snapshotted_after_planning(folder, monkeypatch):
    after_planning = []
    real = async_save._snapshot
    monkeypatch.setattr(async_save, "_snapshot", lambda *a: (after_planning.append(1), real(*a))[1])
    obj = {"seen": torch.arange(2_000_000, dtype=torch.float32), "hidden": _Holder(torch.arange(5.0))}
    handle = fastpersist.save_async(obj, folder / "h.pt")
    obj["seen"].zero_()
    obj["hidden"].t.zero_()
    handle.wait()
    assert after_planning == [1]
    loaded = torch.load(folder / "h.pt", weights_only=False)
    assert torch.equal(loaded["seen"], torch.arange(2_000_000, dtype=torch.float32))
    assert torch.equal(loaded["hidden"].t, torch.arange(5.0))
    async_save.wait_for_all()
    memory = async_save._writer.memory
    assert memory.free and sum(a.size for a in memory.free) == memory.total  # the early arena went back to the pool


def test_storages_copied_as_device_storages_are_into_the_snapshot(folder, monkeypatch):
    """The copy GPU storages take (torch's copy_ into the snapshot, one per
    storage, no host copy first), forced on for CPU storages captured
    while pickling: tensors changed right after return do not reach the file."""
    from fastpersist import _torch_api

    monkeypatch.setattr(_torch_api, "CAPTURE", "always")
    monkeypatch.setattr(async_save, "_COPY_AS_FROM_A_DEVICE", True)
    taken = []
    real = async_save._as_bytes
    monkeypatch.setattr(async_save, "_as_bytes", lambda s: (taken.append(s.nbytes()), real(s))[1])
    obj = state(4)
    handle = fastpersist.save_async(obj, folder / "d.pt")
    obj["w"].zero_()
    obj["b"].fill_(-1)
    obj["nested"]["h"].zero_()
    handle.wait()
    assert sorted(taken) == [3 * 7 * 2, 1000 * 8, 2_000_000 * 4]  # h, b, w: once each
    assert_state(folder / "d.pt", 4)


def test_arenas_registered_with_cuda_are_not_mapped_in_a_forked_child(tmp_path, monkeypatch):
    """Page-locked pages are copied at fork, not shared: an arena registered
    with CUDA is marked MADV_DONTFORK, and a forked child neither has it
    mapped nor reuses it (its own saves take new arenas). CUDA's register
    call is stood in for (no GPU here); the marking is the real one."""
    import gc

    from fastpersist import async_save, device_io

    from conftest import fork_child

    monkeypatch.setattr(device_io, "register_host_memory", lambda address, nbytes, what: (lambda: None))
    async_save.release_snapshot_memory()
    pool = async_save.snapshot_memory()
    held = [pool.take(1 << 20, 1 << 30)]  # one in use at the fork (DCP's staged tensors hold theirs)
    held[0].register_for(torch.device("cuda"))
    start = held[0].bytes.data_ptr()
    held[0].bytes[:4] = 7

    def mapped(address):
        with open("/proc/self/maps") as maps:
            for line in maps:
                lo, hi = (int(x, 16) for x in line.split()[0].split("-"))
                if lo <= address < hi:
                    return True
        return False

    def in_the_child():
        assert not mapped(start), "the registered arena is mapped in the forked child"
        pool.give_back(held.pop())  # the staged tensors die in the child: the arena is not reused there
        assert not pool.free
        gc.collect()
        # the child's own arena can be put where the parent's was: the parent's arena, collected
        # here, must not unmap it
        fastpersist.save_async({"x": torch.arange(1000.0)}, str(tmp_path / "child.pt")).result()
        gc.collect()
        for a in async_save.snapshot_memory().free:
            assert a.mapped_here()
            a.bytes.fill_(1)
        assert torch.equal(torch.load(tmp_path / "child.pt")["x"], torch.arange(1000.0))

    assert os.waitpid(fork_child(in_the_child), 0)[1] == 0
    assert mapped(start) and held[0].bytes[:4].tolist() == [7, 7, 7, 7]
    pool.give_back(held.pop())
