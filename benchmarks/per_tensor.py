"""What one tensor costs a save and a load, beyond its bytes.

A state dict of N small tensors (default 10,000 of 1 KiB, ~10 MB) is saved
and loaded in this process, in rounds whose order is shuffled: torch.save +
fsync, fastpersist.save (its pickle written by plain_pickle's C writer, and
by its Python reference), the raw engine writing the same bytes; torch.load,
fastpersist.load. Every save writes a new file (fsync'd), every load reads
one from the page cache (the per-tensor work is the question, not the
device). Reported: the median seconds of each and the median per tensor,
with the raw engine's write subtracted from the saves ("beyond the bytes").

    python benchmarks/per_tensor.py --folder /mnt/fast --tensors 10000 --bytes 1024 --repeats 7
"""
from __future__ import annotations

import argparse
import os
import random
import statistics
import tempfile
import time


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--folder", default=None, help="where to write (default: a temporary folder in /tmp)")
    parser.add_argument("--tensors", type=int, default=10_000)
    parser.add_argument("--bytes", type=int, default=1024, help="bytes per tensor (float32)")
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()

    import torch

    import fastpersist
    from fastpersist import FastFileWriter, plain_pickle
    from fastpersist.patching import original_load, original_save

    fastpersist.unpatch()
    n = args.tensors
    state = {f"layers.{i}.weight": torch.randn(args.bytes // 4) for i in range(n)}
    payload = sum(t.nbytes for t in state.values())
    folder = tempfile.mkdtemp(prefix="per-tensor-", dir=args.folder)
    path = os.path.join(folder, "state.pt")
    original_save()(state, path)
    size = os.path.getsize(path)

    def torch_save():
        target = os.path.join(folder, "torch.pt")
        original_save()(state, target)
        fd = os.open(target, os.O_RDONLY)
        os.fsync(fd)
        os.close(fd)
        os.unlink(target)

    def fp_save(implementation):
        def run():
            plain_pickle.IMPLEMENTATION = implementation
            target = os.path.join(folder, "fp.pt")
            fastpersist.save(state, target)
            os.unlink(target)
            plain_pickle.IMPLEMENTATION = "c"
        return run

    def raw_write():
        target = os.path.join(folder, "raw.bin")
        with FastFileWriter(target, exclusive=True, sole_writer=True) as writer:
            for t in state.values():
                writer.write_address(t.data_ptr(), t.nbytes)
            writer.write_zeros(size - payload)
        os.unlink(target)

    mechanisms = {
        "torch.save + fsync": torch_save,
        "fastpersist.save": fp_save("c"),
        "fastpersist.save (Python pickle writer)": fp_save("python"),
        "raw engine write (same bytes)": raw_write,
        "torch.load": lambda: original_load()(path, weights_only=True),
        "fastpersist.load": lambda: fastpersist.load(path, weights_only=True),
    }
    times = {name: [] for name in mechanisms}
    for name, fn in mechanisms.items():  # warm-up: engines started, the file in the page cache
        fn()
    for _ in range(args.repeats):
        order = list(mechanisms)
        random.shuffle(order)
        for name in order:
            start = time.perf_counter()
            mechanisms[name]()
            times[name].append(time.perf_counter() - start)
    raw = statistics.median(times["raw engine write (same bytes)"])
    print(f"{n} tensors of {args.bytes} bytes ({size / 1e6:.1f} MB file) in {folder}, {args.repeats} rounds, "
          f"torch {torch.__version__}, fastpersist {fastpersist.__version__}")
    print(f"{'mechanism':42s} {'median s':>9s} {'us/tensor':>10s} {'beyond the bytes':>17s}")
    for name, values in times.items():
        median = statistics.median(values)
        beyond = f"{(median - raw) / n * 1e6:10.2f}" if "save" in name else "-"
        print(f"{name:42s} {median:9.4f} {median / n * 1e6:10.2f} {beyond:>17s}")
    for name in os.listdir(folder):
        os.unlink(os.path.join(folder, name))
    os.rmdir(folder)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
