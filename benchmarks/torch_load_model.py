"""Load a real model checkpoint (random weights, real layout) from a cold
page cache: vanilla torch.load, torch.load(mmap=True), fastpersist.load,
fastpersist.load_into the same model already built (the restart path), and
the raw engine reading the same file; every byte of each result is summed
inside the timing. The checkpoint is written by torch.save itself.

    python benchmarks/torch_load_model.py --model gpt2-large --repeats 5
    python benchmarks/torch_load_model.py --model llama-1b --dtype bfloat16 --optimizer
"""
from __future__ import annotations

import argparse
import gc
import os
import sys
import time

os.environ.setdefault("FASTPERSIST_AUTOPATCH", "0")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402

import _common  # noqa: E402
import models  # noqa: E402
from torch_save_model import DTYPES, STEP, adam_state, storage_bytes  # noqa: E402


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="gpt2-large", choices=models.names(), help="model to build")
    parser.add_argument("--dtype", default="float32", choices=list(DTYPES), help="parameter dtype")
    parser.add_argument("--optimizer", action="store_true",
                        help="also checkpoint Adam-style state (exp_avg, exp_avg_sq per parameter)")
    _common.common_arguments(parser)
    args = parser.parse_args(argv)

    from fastpersist.patching import original_save

    start = time.perf_counter()
    model = models.build(args.model, DTYPES[args.dtype])
    checkpoint = {"model": model.state_dict()}
    if args.optimizer:
        checkpoint["optimizer"] = adam_state(model)
    checkpoint["step"] = STEP
    built = time.perf_counter() - start
    data_bytes = storage_bytes(checkpoint)
    engines = _common.usable_engines(args.engines)
    runner = _common.Runner(args.folder)
    path = runner.path("checkpoint")
    original_save()(checkpoint, path)
    # The restart target is the same structure, already in memory and touched:
    # the model's own state dict (and optimizer state) as a job would rebuild it.
    target = checkpoint
    gc.collect()
    print(f"# torch {torch.__version__}; model {args.model} ({models.get_config(args.model).note}): "
          f"{models.param_count(args.model):,} params, {args.dtype}"
          f"{' + Adam state' if args.optimizer else ''}; checkpoint {data_bytes / 1e9:.2f} GB of tensor data "
          f"({len(checkpoint['model'])} model keys; built in {built:.1f} s) saved by torch.save; "
          f"folder {runner.folder}; {args.repeats} rounds, medians; cold page cache", flush=True)
    _common.run_load_rounds(runner, path, target, engines, args.repeats, vanilla=not args.no_vanilla)


if __name__ == "__main__":
    main()
