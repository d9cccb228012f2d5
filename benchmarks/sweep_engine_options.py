"""Sweep the engine's buffer size, buffer count and request size for
fastpersist.save of one tensor; the defaults in fastpersist/options.py come
from this. Rounds are interleaved; medians are printed.

    python benchmarks/sweep_engine_options.py --size 1 --repeats 3
"""
from __future__ import annotations

import argparse
import itertools
import os
import sys

os.environ.setdefault("FASTPERSIST_AUTOPATCH", "0")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402

from fastpersist.bench import micro  # noqa: E402

MiB = 1 << 20


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", type=float, default=1.0, help="tensor size in GB")
    parser.add_argument("--engine", default="io_uring")
    parser.add_argument("--buffer-sizes", default="4,16,64", help="MiB")
    parser.add_argument("--num-buffers", default="2,4")
    parser.add_argument("--request-sizes", default="0.25,1,4", help="MiB")
    parser.add_argument("--folder", default=None)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args(argv)

    import fastpersist

    nbytes = int(args.size * 1e9) // 4 * 4
    tensor = torch.empty(nbytes // 4)
    tensor.uniform_()
    combos = [
        (int(float(b) * MiB), int(n), int(float(r) * MiB))
        for b, n, r in itertools.product(args.buffer_sizes.split(","), args.num_buffers.split(","),
                                         args.request_sizes.split(","))
        if float(r) <= float(b)
    ]
    runner = micro.Runner(args.folder)
    print(f"# {args.engine}; tensor {nbytes / 1e9:.2f} GB; folder {runner.folder}; {args.repeats} rounds, medians")
    try:
        for _ in range(args.repeats):
            for bs, nb, rs in combos:
                def save(path, bs=bs, nb=nb, rs=rs):
                    fastpersist.save(tensor, path, engine=args.engine, buffer_size=bs, num_buffers=nb,
                                     request_size=rs)
                    return os.path.getsize(path)
                runner.run(f"buffer_size={bs // MiB}M,num_buffers={nb},request_size={rs / MiB:g}M", save)
        runner.report()
    finally:
        runner.close()


if __name__ == "__main__":
    main()
