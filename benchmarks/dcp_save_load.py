"""torch.distributed.checkpoint through DCP's own FileSystemWriter and
FileSystemReader against fastpersist's FastPersistWriter and
FastPersistReader: the same sharded state (DTensors, Shard(0) over the
ranks), 1, 2 and 4 ranks (gloo, spawned processes on this machine),
aggregate GB/s.

Per rank count, one set of processes runs every round; in each round every
mechanism saves once (a new checkpoint folder, as a step-numbered save
writes) and then loads that checkpoint once into the existing, touched
state (a restart whose model is built), in a rotating order so machine
noise hits them alike. The stock writer runs with its default thread_count
(1) and with each of --thread-counts; its best median is the one the ratio
uses. The ceiling is the engine alone: each rank writes its tensors' bytes
back to back into a file of its own and reads them back, no DCP, no format.
Before every load the page cache holds none of the checkpoint
(posix_fadvise DONTNEED on every file after an fsync). A time is the
slowest rank's, from a barrier to its return (dcp.save returns after the
metadata is written; both writers fsync their data). Folders are deleted
after their load, outside the timing (deletes cost ~1 s/GB on a disk with
online discard). Medians over rounds.

    python benchmarks/dcp_save_load.py --size 2 --ranks 1,2,4 --repeats 3
"""
from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
import warnings

os.environ.setdefault("FASTPERSIST_AUTOPATCH", "0")  # the stock writer must run torch's own torch.save


def _drop_cache(folder: str) -> None:
    for name in os.listdir(folder):
        fd = os.open(os.path.join(folder, name), os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def _mechanisms(thread_counts):
    import torch.distributed.checkpoint as dcp

    from fastpersist.dcp import FastPersistReader, FastPersistWriter

    found = [(f"stock[threads={t}]", lambda p, t=t: dcp.FileSystemWriter(p, thread_count=t), dcp.FileSystemReader)
             for t in thread_counts]
    found.append(("fastpersist", FastPersistWriter, FastPersistReader))
    found.append(("raw engine (ceiling)", None, None))
    return found


def _raw_save(state, folder: str, rank: int) -> None:
    """The device's ceiling for this state: every rank writes its local
    tensors' bytes back to back into one file through the engine, fsynced."""
    from fastpersist.writer import FastFileWriter

    os.makedirs(folder, exist_ok=True)
    writer = FastFileWriter(os.path.join(folder, f"rank{rank}.bin"), truncate=True, sole_writer=True)
    for t in state.values():
        local = t.to_local()
        writer.write_address(local.data_ptr(), local.nbytes)
    writer.close()
    fd = os.open(folder, os.O_RDONLY)
    os.fsync(fd)  # the new file's name too, as the DCP writers make theirs durable
    os.close(fd)


def _raw_load(state, folder: str, rank: int) -> None:
    """... and reads them back into the tensors in one pass of the engine."""
    from fastpersist.fileio import read_extents, reading_engine
    from fastpersist.options import current_options

    path = os.path.join(folder, f"rank{rank}.bin")
    extents, offset = [], 0
    for t in state.values():
        local = t.to_local()
        extents.append((local.data_ptr(), offset, local.nbytes))
        offset += local.nbytes
    fd = os.open(path, os.O_RDONLY)
    try:
        with reading_engine(path, current_options()) as (engine, direct_fd):
            read_extents(engine, direct_fd, fd, path, extents, checksums=False)
    finally:
        os.close(fd)


def _rank_main(rank, world, args, folder, rendezvous, results):
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    warnings.simplefilter("ignore")  # DCP warns on every call about planner defaults
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{rendezvous}", rank=rank, world_size=world)
    try:
        mesh = init_device_mesh("cpu", (world,))
        # a model-like state: many tensors of mixed sizes, --size GB in all, sharded by rows
        total = int(args.size * 1e9) // 4
        sizes = [total // 64 * (1 + i % 4) * 2 // 5 for i in range(64)]
        cols = 1024
        state = {}
        g = torch.Generator().manual_seed(rank)
        for i, n in enumerate(sizes):
            rows = max(world, n // cols // world * world)
            local = torch.randn(rows // world, cols, generator=g)
            state[f"layer{i}.weight"] = DTensor.from_local(local, mesh, [Shard(0)], run_check=False,
                                                           shape=(rows, cols), stride=(cols, 1))
        nbytes = sum(t.to_local().nbytes for t in state.values()) * world
        mechanisms = _mechanisms(args.thread_counts)
        for r in range(args.repeats):
            order = mechanisms[r % len(mechanisms):] + mechanisms[:r % len(mechanisms)]
            for name, writer, reader in order:
                path = os.path.join(folder, f"{name}-{r}")
                dist.barrier()
                start = time.perf_counter()
                if writer is None:
                    _raw_save(state, path, rank)
                else:
                    dcp.save(state, storage_writer=writer(path))
                saved = time.perf_counter() - start
                if rank == 0:
                    _drop_cache(path)
                dist.barrier()
                start = time.perf_counter()
                if reader is None:
                    _raw_load(state, path, rank)
                else:
                    dcp.load(state, storage_reader=reader(path))
                loaded = time.perf_counter() - start
                times = [None] * world
                dist.all_gather_object(times, (saved, loaded))
                if rank == 0:
                    results.append((name, max(t[0] for t in times), max(t[1] for t in times), nbytes))
                    shutil.rmtree(path)
                    os.sync()
    finally:
        dist.destroy_process_group()


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", type=float, default=2.0, help="checkpoint size in GB (10^9 bytes), all ranks together")
    parser.add_argument("--ranks", default="1,2,4", help="comma-separated rank counts")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--thread-counts", default="1,2,4",
                        help="the stock FileSystemWriter's thread_count values to try (1 is its default)")
    parser.add_argument("--folder", default=None, help="where checkpoints go (default: a folder under /var/tmp)")
    args = parser.parse_args(argv)
    args.thread_counts = [int(x) for x in args.thread_counts.split(",")]

    import torch
    import torch.multiprocessing as mp

    counts = [int(x) for x in args.ranks.split(",")]
    with tempfile.TemporaryDirectory(prefix="fastpersist-dcp-", dir=args.folder or "/var/tmp") as folder:
        print(f"# torch {torch.__version__}; {args.size:.2f} GB of DTensors (Shard(0)) over the ranks; ranks {counts}; "
              f"{os.cpu_count()} cores; one disk; folder {folder}; {args.repeats} rounds, medians of the slowest "
              "rank's time; loads from a cold page cache into the existing state", flush=True)
        print("| ranks | mechanism | save GB/s | load GB/s | save vs best stock | load vs best stock "
              "| save vs ceiling | load vs ceiling | rounds (save; load), s |")
        print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
        with mp.Manager() as manager:
            for world in counts:
                results = manager.list()
                mp.spawn(_rank_main, args=(world, args, folder, os.path.join(folder, f"rdv{world}"), results),
                         nprocs=world, join=True)
                rows = {}
                for name, saved, loaded, nbytes in results:
                    rows.setdefault(name, ([], [], nbytes))
                    rows[name][0].append(saved)
                    rows[name][1].append(loaded)
                rates = {name: (n / 1e9 / statistics.median(s), n / 1e9 / statistics.median(l))
                         for name, (s, l, n) in rows.items()}
                stock = [v for k, v in rates.items() if k.startswith("stock")]
                best_save, best_load = max(v[0] for v in stock), max(v[1] for v in stock)
                ceiling_save, ceiling_load = rates["raw engine (ceiling)"]
                for name, (s, l, _) in rows.items():
                    save_rate, load_rate = rates[name]
                    print(f"| {world} | {name} | {save_rate:.2f} | {load_rate:.2f} | {save_rate / best_save:.2f}x "
                          f"| {load_rate / best_load:.2f}x | {save_rate / ceiling_save:.2f} "
                          f"| {load_rate / ceiling_load:.2f} | {', '.join(f'{t:.2f}' for t in s)}; "
                          f"{', '.join(f'{t:.2f}' for t in l)} |", flush=True)


if __name__ == "__main__":
    sys.exit(main())
