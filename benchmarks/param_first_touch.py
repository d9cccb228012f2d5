"""Where a vLLM-style load's time goes on the CPU: copying a model's
safetensors shards into parameters allocated as vLLM allocates them
(torch.empty per parameter), without vLLM. Each variant runs in a fresh
process, the variants interleaved round by round; medians are printed.

    python benchmarks/param_first_touch.py MODEL_FOLDER [--rounds 3] [--cold]

Variants (warm: the shards in the page cache; --cold: dropped before each):
  mapped         safetensors' mapping, dst.copy_(tensor) (vLLM's default loader)
  mapped+ahead   the same, a helper reading the mapping in ahead (fastpersist's cold path)
  pread          preadv straight into the parameters, two threads per large tensor
  touched        mapped, into parameters written once before the timing
  read           the shards' bytes read into one reused buffer (the disk or the page cache alone)
What it showed on a 2-CPU VM (0.88 GB): mapped 0.17-0.19 s warm, touched
0.045 s; the parameters' first touch, not the copy, is the warm cost."""
import argparse
import json
import os
import statistics
import subprocess
import sys

VARIANTS = ("mapped", "mapped+ahead", "pread", "touched", "read")


def child(folder: str, variant: str) -> float:
    import ctypes
    import threading
    import time

    import torch
    from safetensors import safe_open

    from fastpersist.fileio import prefaulting

    torch.set_num_threads(2)
    files = sorted(os.path.join(folder, f) for f in os.listdir(folder) if f.endswith(".safetensors"))
    layout = []  # (file, offset, nbytes, name, shape)
    for path in files:
        with open(path, "rb") as f:
            n = int.from_bytes(f.read(8), "little")
            header = json.loads(f.read(n))
        for name, entry in header.items():
            if name != "__metadata__":
                begin, end = entry["data_offsets"]
                layout.append((path, 8 + n + begin, end - begin, name, entry["shape"], entry["dtype"]))
    dtypes = {"BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32}
    params = {name: torch.empty(shape, dtype=dtypes[dtype]) for _, _, _, name, shape, dtype in layout}
    if variant == "touched":
        for p in params.values():
            p.zero_()
    start = time.perf_counter()
    if variant == "read":
        buffer = bytearray(16 << 20)
        for path in files:
            with open(path, "rb", buffering=0) as f:
                while f.readinto(buffer):
                    pass
    elif variant == "pread":
        fds = {path: os.open(path, os.O_RDONLY) for path in files}
        for path, offset, nbytes, name, _, _ in layout:
            view = memoryview((ctypes.c_ubyte * nbytes).from_address(params[name].data_ptr())).cast("B")
            half = nbytes // 2 if nbytes >= 4 << 20 else nbytes

            def part(lo, hi, fd=fds[path], view=view, offset=offset):
                while lo < hi:
                    lo += os.preadv(fd, [view[lo:hi]], offset + lo)

            helper = threading.Thread(target=part, args=(half, nbytes)) if half < nbytes else None
            if helper:
                helper.start()
            part(0, half)
            if helper:
                helper.join()
    else:
        for path in files:
            with safe_open(path, "pt") as f:
                mapped = {k: f.get_tensor(k) for k in f.keys()}
            extents = [(t.data_ptr(), i, t.nbytes) for i, t in enumerate(mapped.values()) if t.nbytes]
            with prefaulting(extents, 1, read_only=True) if variant == "mapped+ahead" else _nothing():
                for name, tensor in mapped.items():
                    params[name].copy_(tensor)
    return time.perf_counter() - start


class _nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("folder")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--cold", action="store_true", help="drop the shards from the page cache before each run")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(child(args.folder, args.child))
        return 0
    from fastpersist.bench.common import evict_from_page_cache, warm

    shards = [os.path.join(args.folder, f) for f in os.listdir(args.folder) if f.endswith(".safetensors")]
    times: dict = {v: [] for v in VARIANTS}
    for _ in range(args.rounds):
        for variant in VARIANTS:
            for path in shards:
                evict_from_page_cache(path) if args.cold else warm(path)
            out = subprocess.run([sys.executable, __file__, args.folder, "--child", variant], capture_output=True,
                                 text=True, check=True)
            times[variant].append(float(out.stdout.split()[-1]))
    for variant, seconds in times.items():
        print(f"{'cold' if args.cold else 'warm'} {variant:13s} median {statistics.median(seconds):.3f} s  "
              f"[{', '.join(f'{s:.3f}' for s in seconds)}]")
    return 0


if __name__ == "__main__":
    sys.exit(main())
