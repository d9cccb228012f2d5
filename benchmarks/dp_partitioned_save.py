"""One checkpoint written by N data-parallel ranks (fastpersist.save with
group=...), against one process writing it alone: aggregate GB/s for 1, 2
and 4 ranks (gloo, spawned processes on this machine, one disk).

Every rank holds the same state (a few large float32 tensors, --size GB in
all); per round and rank count, the ranks meet at a barrier, save, and the
time is the slowest rank's, from the barrier to its return (the file is
renamed and its folder fsynced by then). Rank counts are interleaved per
round; the median round is reported. Each checkpoint is a new file
(ckpt_<round>_<ranks>.pt), deleted after its timing with the file system
synced, outside the timing (deletes cost ~1 s/GB on a disk with online
discard).

    python benchmarks/dp_partitioned_save.py --size 2 --ranks 1,2,4 --repeats 3
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

os.environ.setdefault("FASTPERSIST_AUTOPATCH", "0")


def _rank_main(rank, world, args, folder, rendezvous, results):
    import torch
    import torch.distributed as dist

    import fastpersist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{rendezvous}", rank=rank, world_size=world)
    try:
        n = int(args.size * 1e9) // 4
        pieces = 8
        state = {f"t{i}": torch.full((n // pieces,), float(i)) for i in range(pieces)}  # touched, the same everywhere
        for r in range(args.repeats):
            path = os.path.join(folder, f"ckpt_{r}_{world}.pt")
            dist.barrier()
            start = time.perf_counter()
            fastpersist.save(state, path, group=dist.group.WORLD if world > 1 else None, engine=args.engine)
            seconds = time.perf_counter() - start
            times = [None] * world
            dist.all_gather_object(times, seconds)
            if rank == 0:
                results.append((r, max(times), os.path.getsize(path)))
                os.unlink(path)
                os.sync()
            dist.barrier()
    finally:
        dist.destroy_process_group()


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", type=float, default=2.0, help="checkpoint size in GB (10^9 bytes)")
    parser.add_argument("--ranks", default="1,2,4", help="comma-separated rank counts")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--engine", default="auto")
    parser.add_argument("--folder", default=None, help="where checkpoints go (default: a folder under /var/tmp)")
    args = parser.parse_args(argv)

    import torch
    import torch.multiprocessing as mp

    counts = [int(x) for x in args.ranks.split(",")]
    with tempfile.TemporaryDirectory(prefix="fastpersist-dp-", dir="/var/tmp") as tmp:
        folder = args.folder or tmp
        os.makedirs(folder, exist_ok=True)
        print(f"# torch {torch.__version__}; {args.size:.2f} GB float32 state on every rank; ranks {counts}; "
              f"engine {args.engine}; {os.cpu_count()} cores; one disk; folder {folder}; {args.repeats} rounds, "
              "medians of the slowest rank's time", flush=True)
        timings = {c: [] for c in counts}
        size = 0
        with mp.Manager() as manager:
            for r in range(args.repeats):
                for world in counts:  # interleaved: machine noise hits every rank count alike
                    results = manager.list()
                    one = argparse.Namespace(**{**vars(args), "repeats": 1})
                    rendezvous = os.path.join(tmp, f"rdv_{r}_{world}")
                    mp.spawn(_rank_main, args=(world, one, folder, rendezvous, results), nprocs=world, join=True)
                    (_, seconds, size), = list(results)
                    timings[world].append(seconds)
        base = statistics.median(timings[counts[0]])
        for world in counts:
            med = statistics.median(timings[world])
            rounds = ", ".join(f"{t:.2f}" for t in timings[world])
            print(f"fastpersist_save[{world} rank{'s' if world > 1 else ''}] -- {size / 1e9:.2f} GB, {med:.2f} secs, "
                  f"{size / 1e9 / med:.2f} GB/s   (rounds {rounds}; {base / med:.2f}x {counts[0]} rank)", flush=True)


if __name__ == "__main__":
    sys.exit(main())
