"""Load a real model checkpoint (random weights, real layout) from a cold
page cache: vanilla torch.load, torch.load(mmap=True), fastpersist.load,
fastpersist.load_into the same model already built (the restart path), and
the raw engine reading the same file; every byte of each result is summed
inside the timing. The checkpoint is written by torch.save itself.

    python benchmarks/torch_load_model.py --model gpt2-large --repeats 5
    python benchmarks/torch_load_model.py --model llama-1b --dtype bfloat16 --optimizer
    python benchmarks/torch_load_model.py --model llama-1b --gpu     # loads to cuda:0

With ``--gpu`` every load restores to the GPU (``map_location="cuda:0"``),
load_into fills the model built there, and each timing waits for the
device; the raw engine still reads into host memory (the ceiling).
"""
from __future__ import annotations

import argparse
import os
import sys

os.environ.setdefault("FASTPERSIST_AUTOPATCH", "0")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from fastpersist.bench import micro  # noqa: E402
from torch_save_model import build_checkpoint, describe, device_of, model_arguments  # noqa: E402


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    model_arguments(parser)
    micro.common_arguments(parser)
    args = parser.parse_args(argv)

    from fastpersist.patching import original_save

    checkpoint, built = build_checkpoint(args)
    engines = micro.usable_engines(args.engines)
    runner = micro.Runner(args.folder)
    path = runner.path("checkpoint")
    original_save()(checkpoint, path)
    print(f"# {describe(args, checkpoint, built)} saved by torch.save; folder {runner.folder}; "
          f"{args.repeats} rounds, medians; cold page cache", flush=True)
    # The restart target is the same structure, already in memory and touched:
    # the model's own state dict (and optimizer state) as a job would rebuild it.
    micro.run_load_rounds(runner, path, checkpoint, engines, args.repeats, vanilla=not args.no_vanilla,
                          device=device_of(args))


if __name__ == "__main__":
    main()
