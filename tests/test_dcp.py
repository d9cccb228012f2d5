"""fastpersist.dcp: torch.distributed.checkpoint's StorageWriter and
StorageReader on the engine. Same files as DCP's FileSystemWriter, read by
its FileSystemReader and reading what it wrote; commits that never tear the
previous checkpoint; dcp.async_save staging in snapshot memory; gloo ranks
with DTensor state, resharding from 2 ranks to 4."""
import gc
import os
import warnings

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.multiprocessing as mp
from torch.distributed.checkpoint.api import CheckpointException

from fastpersist import _torch_api, async_save, dcp as fp_dcp, gds, release, torch_format
from fastpersist.dcp import FastPersistReader, FastPersistWriter


@pytest.fixture(autouse=True)
def _quiet_dcp():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # DCP warns about no_dist and overwriting on every call
        yield


def state(seed=0):
    g = torch.Generator().manual_seed(seed)
    wide = torch.randn(64, 300, generator=g)
    return {
        "model": {"w": torch.randn(700, 513, generator=g), "b": torch.arange(1001, dtype=torch.int64),
                  "h": torch.randn(33, 7, generator=g).to(torch.bfloat16), "scalar": torch.tensor(2.5),
                  "empty": torch.zeros(0, 4), "view": wide[:, 10:20], "flags": torch.rand(50, generator=g) > 0.5},
        "optim": {"step": 7, "lr": 3e-4, "name": "adamw", "moments": [torch.randn(100, generator=g), torch.ones(3)]},
    }


def zeros_like(sd):
    if isinstance(sd, torch.Tensor):
        return torch.zeros_like(sd)
    if isinstance(sd, dict):
        return {k: zeros_like(v) for k, v in sd.items()}
    if isinstance(sd, list):
        return [zeros_like(v) for v in sd]
    return None if isinstance(sd, str) else 0


def assert_same(a, b):
    if isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and torch.equal(a, b)
    elif isinstance(a, dict):
        assert a.keys() == b.keys()
        for k in a:
            assert_same(a[k], b[k])
    elif isinstance(a, list):
        assert len(a) == len(b)
        for x, y in zip(a, b):
            assert_same(x, y)
    else:
        assert a == b


def save(sd, writer):
    dcp.save(sd, storage_writer=writer, no_dist=True)


def load(path, reader_type, like):
    out = zeros_like(like)
    dcp.load(out, storage_reader=reader_type(path), no_dist=True)
    return out


def files(path):
    release.wait_for_releases()
    return sorted(os.listdir(path))


def test_fastpersist_writes_what_the_stock_reader_reads_and_reads_what_the_stock_writer_wrote(tmp_path):
    sd = state()
    save(sd, FastPersistWriter(tmp_path / "fp"))
    save(sd, dcp.FileSystemWriter(tmp_path / "stock"))
    assert files(tmp_path / "fp") == files(tmp_path / "stock") == [".metadata", "__0_0.distcp"]
    for folder, reader in [("fp", dcp.FileSystemReader), ("stock", FastPersistReader), ("fp", FastPersistReader)]:
        assert_same(load(tmp_path / folder, reader, sd), sd)


def _records(path, info):
    """Every record of the torch.save archive at info's range, but the random serialization id."""
    with open(path, "rb") as f:
        f.seek(info.offset)
        blob = f.read(info.length)
    index = torch_format.ArchiveIndex.read(lambda o, n: blob[o:o + n], len(blob), path)
    index.resolve(lambda o, n: blob[o:o + n])
    return {name: (r.data_offset, r.size, blob[r.data_offset:r.data_offset + r.size])
            for name, r in index.records.items() if not name.endswith("serialization_id")}


@pytest.mark.parametrize("streamed", [False, True, "gds"],
                         ids=["copied", "captured and streamed", "middles by the GDS stand-in"])
def test_the_data_file_holds_the_stock_writers_records_at_the_stock_writers_offsets(tmp_path, streamed, monkeypatch):
    """streamed: storages captured while planning and written through the
    engine's reservations, the way a GPU tensor's are (forced for CPU ones);
    gds: their aligned middles written outside the engine, as GPUDirect
    Storage writes them (a DCP file holds many records one after another:
    the middles are aligned to the file, not to each record's plan)."""
    streams = []
    if streamed == "gds":
        monkeypatch.setattr(gds, "STAND_IN_FOR_CPU", True)
        monkeypatch.setattr(gds, "MIN_BYTES", 8192)
        gds.reset_stats()
    if streamed:
        monkeypatch.setattr(_torch_api, "CAPTURE", "always")
        monkeypatch.setattr(torch_format, "STREAM_CPU_STORAGES", True)
        real = torch_format.stream_storage
        monkeypatch.setattr(torch_format, "stream_storage", lambda *a, **k: (streams.append(a[1]), real(*a, **k))[1])
    sd = state()
    save(sd, FastPersistWriter(tmp_path / "fp"))
    assert bool(streams) == bool(streamed)
    if streamed == "gds":
        assert gds.stats()["bytes_written"] >= 1_000_000 and not gds.stats()["fallbacks"]
        gds.reset_stats()
    save(sd, dcp.FileSystemWriter(tmp_path / "stock"))
    ours = FastPersistReader(tmp_path / "fp").read_metadata().storage_data
    theirs = dcp.FileSystemReader(tmp_path / "stock").read_metadata().storage_data
    assert ours.keys() == theirs.keys()
    assert os.path.getsize(tmp_path / "fp" / "__0_0.distcp") == os.path.getsize(tmp_path / "stock" / "__0_0.distcp")
    assert sorted(key.fqn for key in ours) == sorted(
        [f"model.{name}" for name in sd["model"]] + ["optim.step", "optim.lr", "optim.name",
                                                     "optim.moments.0", "optim.moments.1"])
    for key, info in ours.items():
        other = theirs[key]
        assert (info.relative_path, info.offset, info.length) == (other.relative_path, other.offset, other.length)
        # Every item is a torch.save archive, the bytes ones (optim.step, lr, name) too: DCP's planner
        # torch.saves them. One our writer left unparsable raises CheckpointError here and fails the test.
        assert _records(tmp_path / "fp" / info.relative_path, info) == \
            _records(tmp_path / "stock" / other.relative_path, other), key.fqn


def test_replacing_a_checkpoint_keeps_the_old_one_whole_until_the_new_metadata_lands(tmp_path, monkeypatch):
    old, new = state(0), state(1)
    save(old, FastPersistWriter(tmp_path))
    real_replace = os.replace
    seen, current = [], [old]

    def replace_checking_old(src, dst):
        if os.path.basename(dst) == ".metadata":
            # the instant before the commit: the old checkpoint still loads, whole
            assert_same(load(tmp_path, dcp.FileSystemReader, current[0]), current[0])
            seen.append(sorted(os.listdir(tmp_path)))
        return real_replace(src, dst)

    monkeypatch.setattr(os, "replace", replace_checking_old)
    save(new, FastPersistWriter(tmp_path))
    current[0] = new
    assert seen and "__0_0.distcp" in seen[0]  # the old data file was not written over
    assert_same(load(tmp_path, dcp.FileSystemReader, new), new)
    names = files(tmp_path)
    assert len(names) == 2 and ".metadata" in names and "__0_0.distcp" not in names  # the old file released
    save(old, FastPersistWriter(tmp_path))  # and again: each replacement gets names of its own
    assert len(seen) == 2
    assert_same(load(tmp_path, FastPersistReader, old), old)
    assert len(files(tmp_path)) == 2


def test_a_save_that_fails_mid_write_loses_nothing(tmp_path, monkeypatch):
    old = state(0)
    save(old, FastPersistWriter(tmp_path))
    before = files(tmp_path)
    calls = []

    def failing_write_plan(plan, sink):
        calls.append(1)
        if len(calls) == 3:
            raise OSError(28, "No space left on device (simulated)")
        return real(plan, sink)

    real = torch_format.write_plan
    monkeypatch.setattr(torch_format, "write_plan", failing_write_plan)
    with pytest.raises(CheckpointException, match="No space left on device"):
        save(state(1), FastPersistWriter(tmp_path))
    assert files(tmp_path) == before  # no partial data file, no temporary
    assert_same(load(tmp_path, dcp.FileSystemReader, old), old)


def test_overwrite_false_refuses_a_folder_with_a_checkpoint(tmp_path):
    save(state(), FastPersistWriter(tmp_path))
    with pytest.raises(CheckpointException, match="overwrite=False"):
        save(state(1), FastPersistWriter(tmp_path, overwrite=False))
    assert_same(load(tmp_path, FastPersistReader, state()), state())


def test_data_files_left_by_a_dead_save_go_after_the_next_commit(tmp_path):
    save(state(), FastPersistWriter(tmp_path))
    (tmp_path / "__1_0123abcd_0.distcp").write_bytes(b"x" * 5000)  # as a killed rank would leave it
    (tmp_path / "notes.txt").write_text("mine")
    save(state(1), FastPersistWriter(tmp_path))
    names = files(tmp_path)
    assert "__1_0123abcd_0.distcp" not in names and "notes.txt" in names and len(names) == 3


def test_large_tensors_are_read_straight_into_place_and_others_staged(tmp_path, monkeypatch):
    sd = state()
    sd["model"]["t"] = torch.randn(300, 400).t()  # saved as DCP saves it: a contiguous copy
    save(sd, FastPersistWriter(tmp_path))
    out = zeros_like(sd)
    out["model"]["t"] = torch.zeros(300, 400).t()  # a non-contiguous target: staged, then copied
    destinations = []
    real = fp_dcp.read_pipeline.read_extents

    def spy(fd, path, size, options, extents, checksums, **kwargs):
        destinations.extend(address for address, _, _ in extents)
        return real(fd, path, size, options, extents, checksums, **kwargs)

    monkeypatch.setattr(fp_dcp.read_pipeline, "read_extents", spy)
    dcp.load(out, storage_reader=FastPersistReader(tmp_path), no_dist=True)
    assert_same(out, sd)
    assert out["model"]["w"].data_ptr() in destinations  # 1.4 MB: no staging, no copy
    assert out["model"]["t"].data_ptr() not in destinations
    assert out["model"]["b"].data_ptr() not in destinations  # 8 KB: read with its archive, then copied


def test_a_truncated_data_file_is_a_clear_error(tmp_path):
    save(state(), FastPersistWriter(tmp_path))
    path = tmp_path / "__0_0.distcp"
    os.truncate(path, os.path.getsize(path) // 2)
    with pytest.raises(CheckpointException, match="__0_0.distcp.*(ends before|incomplete)"):
        load(tmp_path, FastPersistReader, state())


def test_a_corrupt_record_is_a_clear_error(tmp_path):
    save({"w": torch.randn(1000)}, FastPersistWriter(tmp_path))
    path = tmp_path / "__0_0.distcp"
    blob = bytearray(path.read_bytes())
    end = blob.rfind(b"PK\x05\x06")  # the archive's end record
    blob[end:end + 4] = b"XXXX"
    path.write_bytes(bytes(blob))
    with pytest.raises(CheckpointException, match="CheckpointError: .*__0_0.distcp"):
        load(tmp_path, FastPersistReader, {"w": torch.randn(1000)})


def test_wrong_options_fail_when_the_writer_is_made(tmp_path):
    with pytest.raises(ValueError, match="buffer_size"):
        FastPersistWriter(tmp_path, buffer_size=1000)
    with pytest.raises(TypeError):
        FastPersistReader(tmp_path, no_such_option=1)


def test_stage_copies_into_snapshot_memory_and_gives_it_back(tmp_path):
    sd = state()
    expected = state()
    pool = async_save.snapshot_memory()
    pool.clear()
    staged = FastPersistWriter(tmp_path).stage(sd)
    sd["model"]["w"].zero_()  # training goes on after staging
    sd["optim"]["moments"][0].add_(1)
    assert_same(staged, expected)
    assert not pool.free
    del staged
    gc.collect()
    assert len(pool.free) == 1  # the arena is back for the next save


def test_async_save_with_fastpersist_staging_round_trips(tmp_path):
    sd = state()
    expected = state()
    future = dcp.async_save(sd, storage_writer=FastPersistWriter(tmp_path), no_dist=True)
    sd["model"]["w"].zero_()
    future.result()
    assert_same(load(tmp_path, dcp.FileSystemReader, expected), expected)


# ---------------------------------------------------------------------------
# ranks: gloo, spawned processes, DTensor state


def sharded_state(mesh, seed=0):
    """Row-sharded tensors, large ("w": read straight into place) and small,
    and a column-sharded one (its parts are not contiguous: staged)."""
    from torch.distributed.tensor import Shard, distribute_tensor

    g = torch.Generator().manual_seed(seed)
    full = {"w": torch.randn(96, 4000, generator=g), "b": torch.randn(1000, generator=g),
            "c": torch.randn(64, 2400, generator=g), "step": seed}
    return full, {"w": distribute_tensor(full["w"], mesh, [Shard(0)]),
                  "b": distribute_tensor(full["b"], mesh, [Shard(0)]),
                  "c": distribute_tensor(full["c"], mesh, [Shard(1)]), "step": seed}


def empty_sharded(mesh):
    from torch.distributed.tensor import Shard, distribute_tensor

    return {"w": distribute_tensor(torch.zeros(96, 4000), mesh, [Shard(0)]),
            "b": distribute_tensor(torch.zeros(1000), mesh, [Shard(0)]),
            "c": distribute_tensor(torch.zeros(64, 2400), mesh, [Shard(1)]), "step": -1}


def full_of(sd):
    return {"w": sd["w"].full_tensor(), "b": sd["b"].full_tensor(), "c": sd["c"].full_tensor(), "step": sd["step"]}


def same_full(got, full):
    return all(torch.equal(got[k], full[k]) for k in ("w", "b", "c")) and got["step"] == full["step"]


def _worker(rank, world, folder, scenario, results):
    os.environ["FASTPERSIST_AUTOPATCH"] = "0"
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    warnings.simplefilter("ignore")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{folder}/rendezvous-{scenario}", rank=rank,
                            world_size=world)
    try:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

        mesh = init_device_mesh("cpu", (world,))
        outcome = {}
        if scenario == "two-ranks":
            full, sd = sharded_state(mesh)
            dcp.save(sd, storage_writer=FastPersistWriter(f"{folder}/fp"))
            dcp.save(sd, storage_writer=dcp.FileSystemWriter(f"{folder}/stock"))
            for name, path, reader in [("fp->stock", "fp", dcp.FileSystemReader),
                                       ("stock->fp", "stock", FastPersistReader)]:
                out = empty_sharded(mesh)
                dcp.load(out, storage_reader=reader(f"{folder}/{path}"))
                got = full_of(out)
                outcome[name] = same_full(got, full)
            # async, both executors: training changes the state right after staging
            for kind in (AsyncCheckpointerType.THREAD, AsyncCheckpointerType.PROCESS):
                full, sd = sharded_state(mesh, seed=3)
                future = dcp.async_save(sd, storage_writer=FastPersistWriter(f"{folder}/async-{kind.value}"),
                                        async_checkpointer_type=kind)
                sd["w"].to_local().zero_()
                future.result()
                out = empty_sharded(mesh)
                dcp.load(out, storage_reader=FastPersistReader(f"{folder}/async-{kind.value}"))
                got = full_of(out)
                outcome[f"async-{kind.value}"] = same_full(got, full)
            # one rank fails mid-save: every rank fails; the checkpoint there still loads
            full, sd = sharded_state(mesh, seed=5)
            if rank == 1:
                def broken(plan, sink):
                    raise OSError(28, "No space left on device (simulated on rank 1)")
                torch_format.write_plan = broken
            try:
                dcp.save(sd, storage_writer=FastPersistWriter(f"{folder}/fp"))
                outcome["failure"] = "saved"
            except CheckpointException as exc:  # DCP raises it on every rank (a BaseException)
                outcome["failure"] = "No space left on device" in str(exc)
            out = empty_sharded(mesh)
            dcp.load(out, storage_reader=dcp.FileSystemReader(f"{folder}/fp"))
            outcome["previous intact"] = torch.equal(full_of(out)["w"], sharded_state(mesh)[0]["w"])
        elif scenario == "four-ranks":
            full, _ = sharded_state(mesh)  # what two ranks saved
            for path, reader in [("fp", FastPersistReader), ("fp", dcp.FileSystemReader), ("stock", FastPersistReader)]:
                out = empty_sharded(mesh)
                dcp.load(out, storage_reader=reader(f"{folder}/{path}"))
                got = full_of(out)
                outcome[f"{path} {reader.__name__}"] = same_full(got, full)
        results[rank] = outcome
    except BaseException as exc:  # noqa: BLE001 - reported to the test
        results[rank] = {"crashed": repr(exc)}
        raise
    finally:
        dist.destroy_process_group()


def run(folder, scenario, world):
    with mp.Manager() as manager:
        results = manager.dict()
        mp.spawn(_worker, args=(world, str(folder), scenario, results), nprocs=world, join=True)
        return dict(results)


def test_ranks_save_load_async_save_fail_and_reshard_from_two_ranks_to_four(tmp_path):
    two = run(tmp_path, "two-ranks", 2)
    for rank in range(2):
        assert two[rank] == {"fp->stock": True, "stock->fp": True, "async-thread": True, "async-process": True,
                             "failure": True, "previous intact": True}, two
    four = run(tmp_path, "four-ranks", 4)
    for rank in range(4):
        assert four[rank] == {"fp FastPersistReader": True, "fp FileSystemReader": True,
                              "stock FastPersistReader": True}, four
    # DCP tells no writer that another rank failed: rank 0's file of the failed
    # save stays until the next save into the folder commits
    names = files(tmp_path / "fp")
    assert "__0_0.distcp" in names and "__1_0.distcp" in names and len(names) == 4
    save(state(), FastPersistWriter(tmp_path / "fp"))
    assert len(files(tmp_path / "fp")) == 2


def test_a_cached_checkpoint_is_read_through_the_page_cache_in_parallel(tmp_path, monkeypatch, page_cache_reads):
    """DCP's reader reads through the read pipeline: a checkpoint just written (in the page cache) is
    read from there by its threads, straight into the targets, with the values saved."""
    sd = state()
    save(sd, FastPersistWriter(tmp_path))
    for name in os.listdir(tmp_path):  # written with O_DIRECT, past the page cache: read once to bring it in
        (tmp_path / name).read_bytes()
    reads = []
    real = fp_dcp.read_pipeline.pread_extents
    monkeypatch.setattr(fp_dcp.read_pipeline, "pread_extents",
                        lambda *a, **k: (reads.append(k.get("threads")), real(*a, **k))[1])
    out = zeros_like(sd)
    dcp.load(out, storage_reader=FastPersistReader(tmp_path), no_dist=True)
    assert_same(out, sd)
    assert reads and all(t >= 2 for t in reads)
