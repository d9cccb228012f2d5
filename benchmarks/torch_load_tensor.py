"""Load one large CPU tensor from a cold page cache: vanilla torch.load,
torch.load(mmap=True), fastpersist.load, fastpersist.load_into an existing
tensor, and the raw engine reading the same file; every byte of each result
is summed inside the timing.

    python benchmarks/torch_load_tensor.py --size 2 --repeats 5
"""
from __future__ import annotations

import argparse
import os
import sys

os.environ.setdefault("FASTPERSIST_AUTOPATCH", "0")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402

from fastpersist.bench import micro  # noqa: E402


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", type=float, default=2.0, help="tensor size in GB (10^9 bytes)")
    micro.common_arguments(parser)
    args = parser.parse_args(argv)

    from fastpersist.patching import original_save

    nbytes = int(args.size * 1e9) // 4 * 4
    engines = micro.usable_engines(args.engines)
    runner = micro.Runner(args.folder)
    path = runner.path("checkpoint")
    tensor = torch.empty(nbytes // 4, dtype=torch.float32).uniform_()
    original_save()({"weight": tensor}, path)  # written by torch itself
    target = {"weight": tensor}  # an existing, touched tensor to restore into
    print(f"# torch {torch.__version__}; {{'weight': tensor}} of {nbytes / 1e9:.2f} GB float32 saved by "
          f"torch.save; folder {runner.folder}; {args.repeats} rounds, medians; cold page cache", flush=True)
    micro.run_load_rounds(runner, path, target, engines, args.repeats, vanilla=not args.no_vanilla)


if __name__ == "__main__":
    main()
