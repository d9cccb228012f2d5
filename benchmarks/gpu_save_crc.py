"""Is the GPU save's gap to the raw write the CRC-32? (On a GPU machine: python benchmarks/gpu_save_crc.py.) The same GPU state saved with and without
compute_crc32, beside the raw write, interleaved; and the CRC's own speed here."""
import os, random, statistics, time, zlib
import torch
from torch.utils.serialization import config
import fastpersist
from fastpersist import _engine
from fastpersist.bench.gpu import GpuBench
import argparse
args = argparse.Namespace(device="cuda", dtype="bfloat16", size=1.0, folder="/tmp", cache_drop="auto", repeats=3)
b = GpuBench(args); b.prepare()
buf = bytes(1 << 30)
t = time.perf_counter(); zlib.crc32(buf); print(f"zlib.crc32 of 1 GiB: {time.perf_counter() - t:.3f} s")
t = time.perf_counter(); _engine.crc32(buf); print(f"engine crc32 of 1 GiB: {time.perf_counter() - t:.3f} s")
del buf
def save(crc):
    def run(p):
        config.save.compute_crc32 = crc
        try:
            return b.fastpersist_save(p)
        finally:
            config.save.compute_crc32 = True
    return run
rows = {"raw": b.raw_write, "save crc32=True": save(True), "save crc32=False": save(False)}
times = {k: [] for k in rows}
for r in range(4):
    order = list(rows); random.shuffle(order)
    for k in order:
        p = b.workspace.file("n.pt"); times[k].append(rows[k](p)); os.unlink(p)
for k, v in times.items():
    print(f"{k:20s} median {statistics.median(v):.3f} s  x raw {statistics.median([a / c for a, c in zip(times['raw'], v)]):.2f}  {[round(x, 3) for x in v]}")
b.close()
