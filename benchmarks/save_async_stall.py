"""save_async's stall (what training waits for) against copy_ of the same
tensors into memory already touched, the floor of any snapshot.

A GPT-2-shaped state dict (GPT-2 small's layers; --layers 30 makes 1.0 GB
in 365 tensors); the two alternate in shuffled rounds in one process, after
one warm-up round; medians and per-round ratios.

    python benchmarks/save_async_stall.py --layers 30 --repeats 9
"""
import dataclasses
import os
import random
import statistics
import tempfile
import time


def main(argv=None) -> None:
    from fastpersist.bench import common

    args = common.model_script_arguments(__doc__, argv, layers=30, repeats=9, layers_note=", 1.0 GB")

    import torch

    import fastpersist
    from fastpersist.bench import models

    state = models.build(dataclasses.replace(models.CONFIGS["gpt2"], layers=args.layers)).state_dict()
    tensors = list({t.untyped_storage().data_ptr(): t for t in state.values()}.values())
    nbytes = sum(t.untyped_storage().nbytes() for t in tensors)
    destinations = [torch.zeros_like(t) for t in tensors]  # touched once, like a snapshot buffer in use
    times = {"copy_": [], "save_async": []}
    with tempfile.TemporaryDirectory(prefix=".fastpersist-bench-", dir=args.folder or ".") as folder:
        for r in range(args.repeats + 1):
            order = list(times)
            random.Random(r).shuffle(order)
            for mechanism in order:
                start = time.perf_counter()
                if mechanism == "copy_":
                    with torch.no_grad():
                        for d, s in zip(destinations, tensors):
                            d.copy_(s)
                    seconds = time.perf_counter() - start
                else:
                    handle = fastpersist.save_async(state, os.path.join(folder, "ckpt.pt"))
                    seconds = time.perf_counter() - start
                    handle.wait()
                if r:  # round 0 warms up
                    times[mechanism].append(seconds)
    ratios = [s / c for s, c in zip(times["save_async"], times["copy_"])]
    print(f"{len(state)} tensors, {nbytes / 1e9:.2f} GB, {args.repeats} rounds")
    print(f"copy_ {statistics.median(times['copy_']):.3f} s, save_async stall "
          f"{statistics.median(times['save_async']):.3f} s; stall / copy_ per round: median "
          f"{statistics.median(ratios):.2f} [{min(ratios):.2f}-{max(ratios):.2f}]")


if __name__ == "__main__":
    main()
