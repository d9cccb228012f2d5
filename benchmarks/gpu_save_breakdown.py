"""Where a save from the GPU loses to the raw engine (run on a GPU machine:
`python benchmarks/gpu_save_breakdown.py [cuda|cpu]`, SIZE=GB): the same 1 GB state
saved from the GPU, from host copies of it, and with bigger buffers, beside
the raw write; rounds interleaved and shuffled; then a profile of one GPU save."""
import argparse, cProfile, io, os, pstats, random, statistics, sys, time
import torch
import fastpersist
from fastpersist.bench import common
from fastpersist.bench.gpu import GpuBench

args = argparse.Namespace(device=sys.argv[1] if len(sys.argv) > 1 else "cuda", dtype="bfloat16", size=float(os.environ.get("SIZE", "1.0")), folder="/tmp", cache_drop="auto", repeats=5)
b = GpuBench(args)
b.prepare()
cpu_state = {k: v.cpu() for k, v in b.state.items()}
ws = b.workspace

def new(fn):
    path = ws.file("new.pt")
    try:
        return fn(path)
    finally:
        common.remove(path)

import dataclasses
opts = dataclasses.asdict(b.options)
rows = {
    "raw write from pinned host": lambda p: b.raw_write(p),
    "fastpersist.save, GPU state": lambda p: b.fastpersist_save(p),
    "fastpersist.save, host state": lambda p: (lambda t: (fastpersist.save(cpu_state, p, **opts), time.perf_counter() - t)[1])(time.perf_counter()),
    "fastpersist.save, GPU state, 64M buffers": lambda p: b.fastpersist_save(p, buffer_size=64 << 20),
}
times = {k: [] for k in rows}
for r in range(5):
    order = list(rows)
    random.shuffle(order)
    for k in order:
        times[k].append(new(rows[k]))
raw = times["raw write from pinned host"]
for k, v in times.items():
    ratios = [a / c for a, c in zip(raw, v)]
    print(f"{k:45s} median {statistics.median(v):.3f} s  x raw (paired median) {statistics.median(ratios):.2f}  all {[round(x, 3) for x in v]}")
prof = cProfile.Profile()
path = ws.file("prof.pt")
prof.enable(); b.fastpersist_save(path); prof.disable()
s = io.StringIO(); pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(14); print(s.getvalue()[-3500:])
b.close()
