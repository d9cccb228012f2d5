"""Should data-parallel ranks that all need the same checkpoint read it each
whole, or each read a slice and exchange the slices? Measured before
building fastpersist.load(path, group=...).

Both mechanisms end with the whole file's bytes in fresh memory on every
rank (what fastpersist.load unpickles from; the unpickling itself is the same
for both and left out):

- whole: every rank reads the whole file through the engine (O_DIRECT, so
  every rank's bytes come from the device, as they would on separate machines);
- slice + exchange: every rank reads 1/N of the file through the engine, then
  the ranks all_gather their slices over gloo (loopback TCP here).

Every timing starts with the file dropped from the page cache
(POSIX_FADV_DONTNEED) and a barrier, and ends at the slowest rank; rounds
interleave the mechanisms; medians are reported.

    python benchmarks/dp_load.py --size 2 --ranks 2,4 --repeats 3
"""
from __future__ import annotations

import argparse
import mmap
import os
import statistics
import sys
import tempfile
import time

os.environ.setdefault("FASTPERSIST_AUTOPATCH", "0")


def _fresh(nbytes: int):
    import torch

    memory = mmap.mmap(-1, max(nbytes, 1))
    return memory, torch.frombuffer(memory, dtype=torch.uint8, count=nbytes)


def _read(path: str, lo: int, hi: int, engine_name: str):
    """Bytes [lo, hi) of path into fresh memory through the engine."""
    from fastpersist.fileio import reading_engine
    from fastpersist.options import Options

    memory, view = _fresh(hi - lo)
    fd = os.open(path, os.O_RDONLY)
    try:
        with reading_engine(path, Options(engine=engine_name)) as (engine, direct_fd):
            got = engine.pread_into(direct_fd, fd, view.data_ptr(), hi - lo, lo, path, prefault=True)
    finally:
        os.close(fd)
    assert got == hi - lo
    return memory, view


def _rank_main(rank, world, path, args, rendezvous, results):
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{rendezvous}", rank=rank, world_size=world)
    size = os.path.getsize(path)
    share = -(-size // world // 4096) * 4096  # equal, aligned slices (the last one padded)

    def drop_cache():
        if rank == 0:
            fd = os.open(path, os.O_RDONLY)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            os.close(fd)
        dist.barrier()

    def timed(fn):
        drop_cache()
        start = time.perf_counter()
        fn()
        seconds = time.perf_counter() - start
        times = [None] * world
        dist.all_gather_object(times, seconds)
        return max(times)

    def whole():
        _read(path, 0, size, args.engine)

    def slice_and_exchange():
        lo, hi = min(rank * share, size), min((rank + 1) * share, size)
        _, mine = _read(path, lo, hi, args.engine)
        padded = torch.zeros(share, dtype=torch.uint8)
        padded[:hi - lo] = mine
        _, everything = _fresh(share * world)
        dist.all_gather(list(everything.view(world, share).unbind(0)), padded)

    try:
        for _ in range(args.repeats):
            for name, fn in (("whole", whole), ("slice+exchange", slice_and_exchange)):
                seconds = timed(fn)
                if rank == 0:
                    results.append((name, seconds))
    finally:
        dist.destroy_process_group()


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", type=float, default=2.0, help="checkpoint size in GB (10^9 bytes)")
    parser.add_argument("--ranks", default="2,4")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--engine", default="auto")
    args = parser.parse_args(argv)

    import torch
    import torch.multiprocessing as mp

    import fastpersist

    with tempfile.TemporaryDirectory(prefix="fastpersist-dpload-", dir="/var/tmp") as folder:
        path = os.path.join(folder, "ckpt.pt")
        n = int(args.size * 1e9) // 4
        fastpersist.save({f"t{i}": torch.full((n // 8,), float(i)) for i in range(8)}, path)
        size = os.path.getsize(path)
        print(f"# torch {torch.__version__}; checkpoint {size / 1e9:.2f} GB; ranks {args.ranks}; engine {args.engine}; "
              f"{os.cpu_count()} cores, one disk; cold page cache each time; {args.repeats} rounds, medians of the "
              "slowest rank", flush=True)
        with mp.Manager() as manager:
            for world in (int(x) for x in args.ranks.split(",")):
                results = manager.list()
                mp.spawn(_rank_main, args=(world, path, args, os.path.join(folder, f"rdv{world}"), results),
                         nprocs=world, join=True)
                for name in ("whole", "slice+exchange"):
                    times = [t for m, t in results if m == name]
                    med = statistics.median(times)
                    print(f"dp_load[{name}, {world} ranks] -- {size / 1e9:.2f} GB per rank, {med:.2f} secs, "
                          f"{size / 1e9 / med:.2f} GB/s per rank   (rounds {', '.join(f'{t:.2f}' for t in times)})",
                          flush=True)


if __name__ == "__main__":
    sys.exit(main())
