"""Restores of a small GPT-2-shaped checkpoint the way a restart does them.

The checkpoint is written by vanilla torch.save. Each restore runs in a new
process (imports untimed), from a dropped page cache: build the model
uninitialised, restore it, then a first write to every parameter
(``p.add_(0)``) so that deferred page faults are paid where a job pays
them. Mechanisms alternate in shuffled rounds; medians and per-round ratios
to torch.load + load_state_dict are printed.

    python benchmarks/small_restore.py --size 0.05 --repeats 7
"""
import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile

MECHANISMS = ["torch.load + load_state_dict", "fastpersist.load + load_state_dict", "fastpersist.load_into"]


def child(mechanism: str, path: str, size: float) -> None:
    import time

    import torch

    import fastpersist
    from fastpersist.bench import default, models
    from fastpersist.bench.common import evict_from_page_cache
    from fastpersist.patching import original_load

    config, _, _ = default.sized_model(int(size * 1e9), torch.float32)
    model = models.build(config, init=False)
    evict_from_page_cache(path)
    start = time.perf_counter()
    if mechanism == MECHANISMS[0]:
        model.load_state_dict(original_load()(path, weights_only=True))
    elif mechanism == MECHANISMS[1]:
        model.load_state_dict(fastpersist.load(path, weights_only=True))
    else:
        fastpersist.load_into(model, path)
    restored = time.perf_counter()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0)
    end = time.perf_counter()
    print(json.dumps({"restore": restored - start, "first_write": end - restored, "total": end - start}))


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", type=float, default=0.05, help="checkpoint size in GB (default: 0.05)")
    parser.add_argument("--repeats", type=int, default=7, help="rounds (default: 7)")
    parser.add_argument("--folder", default=None, help="where the checkpoint is written (default: a temporary "
                                                       "folder under the current one)")
    parser.add_argument("--child", nargs=2, metavar=("MECHANISM", "PATH"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        return child(args.child[0], args.child[1], args.size)
    env = {**os.environ, "FASTPERSIST_AUTOPATCH": "0"}
    with tempfile.TemporaryDirectory(prefix=".fastpersist-bench-", dir=args.folder or ".") as folder:
        path = os.path.join(folder, "checkpoint.pt")
        subprocess.run([sys.executable, "-c", (
            "import sys, torch\n"
            "from fastpersist.bench import default, models\n"
            "from fastpersist.patching import original_save\n"
            f"config, _, _ = default.sized_model(int({args.size} * 1e9), torch.float32)\n"
            f"original_save()(models.build(config).state_dict(), {path!r})\n")], check=True, env=env)
        results = {m: [] for m in MECHANISMS}
        for r in range(args.repeats):
            order = list(MECHANISMS)
            random.Random(r).shuffle(order)
            for m in order:
                out = subprocess.run([sys.executable, os.path.abspath(__file__), "--size", str(args.size),
                                      "--child", m, path], capture_output=True, text=True, env=env)
                if out.returncode:
                    sys.exit(out.stderr)
                results[m].append(json.loads(out.stdout.strip().splitlines()[-1]))
    print(f"a {args.size:g} GB checkpoint, "
          f"{args.repeats} rounds, medians; x vanilla: per-round torch time / this time")
    base = [x["total"] for x in results[MECHANISMS[0]]]
    for m in MECHANISMS:
        totals = [x["total"] for x in results[m]]
        ratios = [b / t for b, t in zip(base, totals)]
        print(f"{m:36s} {statistics.median(totals):.3f} s (restore {statistics.median(x['restore'] for x in results[m]):.3f}, "
              f"first write {statistics.median(x['first_write'] for x in results[m]):.3f}); x vanilla "
              f"{statistics.median(ratios):.2f} [{min(ratios):.2f}-{max(ratios):.2f}]")


if __name__ == "__main__":
    main()
