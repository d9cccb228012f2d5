"""What a small checkpoint's durability costs: fastpersist.save (atomic and
durable, then without the atomic rename, then without fsync either) against
torch.save + fsync, saving a small GPT-2-shaped state dict to a new file.

At 1 MB a save is ~3 ms and fixed costs decide: the folder's fsync after
the rename, the O_DIRECT write waiting on the device (torch's buffered
write does not), torch's pickling (the same in both). Mechanisms alternate
in shuffled rounds in one process; each round saves --saves times per
mechanism (a new file each, removed after) and keeps the median; the
report is the median over rounds and the median of per-round ratios to
torch.save + fsync.

    python benchmarks/small_save.py --size 0.001 --repeats 21
"""
import argparse
import gc
import os
import statistics
import tempfile
import time


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", type=float, default=0.001, help="checkpoint size in GB (default 0.001: 1 MB)")
    parser.add_argument("--repeats", type=int, default=21, help="rounds (default 21)")
    parser.add_argument("--saves", type=int, default=9, help="saves per mechanism and round (default 9)")
    parser.add_argument("--folder", default=None, help="where checkpoints go (default: a temporary folder here)")
    args = parser.parse_args(argv)
    os.environ.setdefault("FASTPERSIST_AUTOPATCH", "0")  # the baseline is torch's own save

    import torch

    import fastpersist
    from fastpersist.bench import common, default, models
    from fastpersist.patching import original_save

    config, label, _ = default.sized_model(int(args.size * 1e9), torch.float32)
    state = models.build(config).state_dict()

    def vanilla(path):
        original_save()(state, path)
        common.fsync_path(path)

    mechanisms = {"torch.save + fsync": vanilla,
                  "fastpersist.save": lambda path: fastpersist.save(state, path),
                  "atomic=False": lambda path: fastpersist.save(state, path, atomic=False),
                  "atomic=False, fsync=False": lambda path: fastpersist.save(state, path, atomic=False, fsync=False)}
    times = {name: [] for name in mechanisms}
    with tempfile.TemporaryDirectory(prefix=".fastpersist-bench-", dir=args.folder or ".") as folder:
        path = os.path.join(folder, "checkpoint.pt")
        size = 0
        for r in range(args.repeats + 1):
            for name in common.round_order(list(mechanisms), r):
                seconds = []
                for _ in range(args.saves):
                    gc.collect()  # every mechanism starts from the same heap
                    start = time.perf_counter()
                    mechanisms[name](path)
                    seconds.append(time.perf_counter() - start)
                    size = os.path.getsize(path)
                    os.unlink(path)
                if r:  # round 0 warms up
                    times[name].append(statistics.median(seconds))
    base = times["torch.save + fsync"]
    print(f"{label} ({config.layers} layers, {len(state)} tensors), {size / 1e6:.2f} MB file, new file each save, "
          f"{args.repeats} rounds of {args.saves}")
    print(f"{'mechanism':<28}{'median ms':>10}{'x torch.save + fsync':>22}")
    for name, values in times.items():
        ratio = statistics.median(b / v for b, v in zip(base, values))
        print(f"{name:<28}{statistics.median(values) * 1e3:>10.3f}{ratio:>22.3f}")


if __name__ == "__main__":
    main()
