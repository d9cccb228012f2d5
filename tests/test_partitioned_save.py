"""fastpersist.save(obj, path, group=...): N ranks (gloo on CPU, spawned
processes) write one checkpoint, each its own share of the bytes."""
import os
import zipfile

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import fastpersist
from fastpersist import distributed as fp_dist

from conftest import leftovers, vanilla_load

WORLD = 3


def state(n=1_500_000):
    g = torch.Generator().manual_seed(0)
    return {"w": torch.randn(n, generator=g), "b": torch.arange(1001), "empty": torch.zeros(0), "step": 5,
            "nested": {"h": torch.randn(7, 3, generator=g).half(), "tied": None}}


def _worker(rank, world, folder, scenario, results):
    os.environ["FASTPERSIST_AUTOPATCH"] = "0"
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{folder}/rendezvous", rank=rank, world_size=world)
    try:
        obj = state()
        dest = os.path.join(folder, "ckpt.pt")
        if scenario == "write":
            written = []
            real = fp_dist._write_range

            def spy(plan, writer, lo, hi):
                written.append((lo, hi))
                return real(plan, writer, lo, hi)

            fp_dist._write_range = spy
            fastpersist.save(obj, dest, group=dist.group.WORLD, engine=["psync", "libaio", "io_uring"][rank % 3])
            results[rank] = ("ok", written)
        elif scenario == "fail":
            if rank == 1:
                def broken(plan, writer, lo, hi):
                    raise OSError(28, "No space left on device (simulated on rank 1)")
                fp_dist._write_range = broken
            try:
                fastpersist.save(obj, dest, group=dist.group.WORLD)
                results[rank] = ("saved", None)
            except fp_dist.PartitionedSaveError as exc:
                results[rank] = ("error", str(exc))
        elif scenario == "async":
            handle = fastpersist.save_async(obj, dest, group=dist.group.WORLD)
            obj["w"].zero_()  # training goes on: the snapshot was taken
            dist.all_reduce(torch.ones(1))  # ... and so do collectives on the training group
            handle.wait()
            first_isolated = torch.equal(torch.load(dest, weights_only=True)["w"], state()["w"])
            dist.barrier()  # every rank has read the first file before the second replaces it
            second = fastpersist.save_async({**obj, "step": 6}, dest, group=dist.group.WORLD)
            results[rank] = ("ok" if first_isolated else "first save changed", second.result())
        elif scenario == "refuse":
            # rank 1 alone cannot save (its folder is missing): every rank fails, none hangs,
            # and the ranks' next saves, synchronous and asynchronous, still pair up right
            outcomes = []
            bad = os.path.join(folder, "missing", "ckpt.pt") if rank == 1 else dest
            for save in (lambda p: fastpersist.save(obj, p, group=dist.group.WORLD),
                         lambda p: fastpersist.save_async(obj, p, group=dist.group.WORLD).wait()):
                try:
                    save(bad)
                    outcomes.append("saved")
                except fp_dist.PartitionedSaveError as exc:
                    outcomes.append("rank 1: TypeError" in str(exc) and "parent folder does not exist" in str(exc))
                save(dest)
                outcomes.append(torch.load(dest, weights_only=True)["step"])
            dist.all_reduce(torch.ones(1))  # the training group is not stuck in an exchange
            results[rank] = ("ok", outcomes)
        elif scenario == "differ":
            if rank == 2:
                obj["step"] = 6
            try:
                fastpersist.save(obj, dest, group=dist.group.WORLD)
                results[rank] = ("saved", None)
            except ValueError as exc:
                results[rank] = ("error", str(exc))
    finally:
        dist.destroy_process_group()


def run(folder, scenario):
    with mp.Manager() as manager:
        results = manager.dict()
        mp.spawn(_worker, args=(WORLD, str(folder), scenario, results), nprocs=WORLD, join=True)
        return dict(results)


def records(path):
    with zipfile.ZipFile(path) as z:
        return {i.filename: z.read(i) for i in z.infolist() if not i.filename.endswith("serialization_id")}


def test_partition_is_disjoint_balanced_and_aligned():
    for size, world in [(0, 3), (1, 2), (4096, 4), (10_000_019, 3), ((1 << 32) + 7, 4)]:
        parts = fp_dist.partition(size, world)
        assert len(parts) == world and parts[0][0] == 0 and parts[-1][1] == size
        assert all(a[1] == b[0] for a, b in zip(parts, parts[1:]))
        assert all(lo % 4096 == 0 for lo, _ in parts)
        if size >= world * 4096:
            assert max(hi - lo for lo, hi in parts) - min(hi - lo for lo, hi in parts) <= 2 * 4096


def test_ranks_write_one_file_byte_equal_to_a_single_process_save(folder):
    fastpersist.save({"old": 1}, folder / "ckpt.pt")
    results = run(folder, "write")
    assert sorted(results) == list(range(WORLD))
    size = os.path.getsize(folder / "ckpt.pt")
    shares = [results[r][1] for r in range(WORLD)]
    assert [len(s) for s in shares] == [1] * WORLD  # each rank wrote one range: its own
    assert [s[0] for s in shares] == fp_dist.partition(size, WORLD)
    assert all(hi - lo > size // WORLD - 8192 for [(lo, hi)] in shares)  # balanced: every rank wrote its share
    loaded = vanilla_load(folder / "ckpt.pt")
    expected = state()
    assert torch.equal(loaded["w"], expected["w"]) and torch.equal(loaded["nested"]["h"], expected["nested"]["h"])
    assert loaded["step"] == 5
    fastpersist.save(state(), folder / "single.pt")
    ours = records(folder / "ckpt.pt")
    single = records(folder / "single.pt")
    assert {k.split("/", 1)[1]: v for k, v in ours.items()} == {k.split("/", 1)[1]: v for k, v in single.items()}
    # CRCs too: the central directories agree record for record
    with zipfile.ZipFile(folder / "ckpt.pt") as a, zipfile.ZipFile(folder / "single.pt") as b:
        def directory(z):  # the serialization id is random per save
            return [(i.CRC, i.file_size, i.header_offset) for i in z.infolist()
                    if not i.filename.endswith("serialization_id")]

        assert directory(a) == directory(b) and len(directory(a)) == len(a.infolist()) - 1
        assert a.testzip() is None
    assert leftovers(folder) == []


def test_a_failure_on_one_rank_fails_every_rank_and_loses_nothing(folder):
    fastpersist.save({"old": 1}, folder / "ckpt.pt")
    before = (folder / "ckpt.pt").read_bytes()
    results = run(folder, "fail")
    assert [results[r][0] for r in range(WORLD)] == ["error"] * WORLD
    assert all("rank 1: OSError" in results[r][1] and "No space left" in results[r][1] for r in range(WORLD))
    assert (folder / "ckpt.pt").read_bytes() == before
    assert leftovers(folder) == []


def test_save_async_with_a_group(folder):
    results = run(folder, "async")
    assert [results[r][0] for r in range(WORLD)] == ["ok"] * WORLD
    assert len({results[r][1] for r in range(WORLD)}) == 1
    loaded = vanilla_load(folder / "ckpt.pt")
    assert loaded["step"] == 6 and torch.equal(loaded["w"], torch.zeros_like(state()["w"]))
    assert leftovers(folder) == []


def test_a_refusal_on_one_rank_fails_every_rank_without_a_hang(folder):
    results = run(folder, "refuse")
    assert [results[r] for r in range(WORLD)] == [("ok", [True, 5, True, 5])] * WORLD
    assert leftovers(folder) == []


def test_ranks_with_different_state_are_refused(folder):
    results = run(folder, "differ")
    assert [results[r][0] for r in range(WORLD)] == ["error"] * WORLD
    assert all("rank(s) [2]" in results[r][1] for r in range(WORLD))
    assert not (folder / "ckpt.pt").exists() and leftovers(folder) == []


def test_group_needs_an_initialized_group(folder):
    assert not dist.is_initialized()
    for target in (folder / "x.pt", open(folder / "y.pt", "wb")):
        with pytest.raises(RuntimeError, match="initialized"):
            fastpersist.save({"a": 1}, target, group=object())
