"""Save one large CPU tensor: vanilla torch.save + fsync against fastpersist
per engine and the raw engine writing the same bytes.

    python benchmarks/torch_save_tensor.py --size 2 --repeats 5
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

    nbytes = int(args.size * 1e9) // 4 * 4
    tensor = torch.empty(nbytes // 4, dtype=torch.float32)
    tensor.uniform_()  # touch every page before timing
    engines = micro.usable_engines(args.engines)
    runner = micro.Runner(args.folder)
    print(f"# torch {torch.__version__}; tensor {nbytes / 1e9:.2f} GB float32; folder {runner.folder}; "
          f"{args.repeats} rounds, medians", flush=True)
    micro.run_rounds(runner, tensor, tensor, engines, args.repeats, vanilla=not args.no_vanilla)

if __name__ == "__main__":
    main()
