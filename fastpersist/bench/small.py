"""``fastpersist bench small``: the default benchmark's save and load rows at
several checkpoint sizes (1 MB to 500 MB by default), where fixed costs
(engine start, planning, unpickling, fsyncs) decide, so a user sees the
curve of fastpersist against vanilla torch and the raw engine.

Each size is one run of ``fastpersist bench`` (the same mechanisms, model
layout, page-cache drops, shuffled rounds and paired ratios), one after the
other; the report is one table of every size and a PNG plot of both ratios
against size.
"""
from __future__ import annotations

import argparse
import time

from . import common
from .common import GB, echo, fmt
from .default import DefaultBench, result_rows

PLOTTED = ("fastpersist.save", "fastpersist.load", "fastpersist.load_into (existing model)")


def measure_size(args, size: float, contents: str = "model") -> tuple:
    """(rows, the bench's description of its model) of one default-bench run
    at size GB; contents "optimizer": Adam's state of a ~500-parameter model (size unused)."""
    bench = DefaultBench(argparse.Namespace(**{**vars(args), "size": size, "contents": contents}))
    try:
        series = bench.run()
        rows = result_rows(series, bench.engines)
        for row, s in zip(rows, series):
            row["size_gb"] = size
            row["file_bytes"] = bench.file_size
            row["contents"] = contents
            row["fastpersist"] = s.role == "fastpersist"
        return rows, (f"{bench.base_name} layout, {common.plural(bench.config.layers, 'layer')}, "
                      f"{bench.tensor_count} tensors, {bench.file_size / GB:.3f} GB file"), \
            common.machine_info(bench.workspace.path)
    finally:
        bench.close()


def plot(rows: list, path: str) -> None:
    """x vanilla and x ceiling of each fastpersist row against file size."""
    common.require("matplotlib")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(13, 5), sharex=True)
    lines = {}
    for r in rows:
        if r["fastpersist"] and r["mechanism"] in PLOTTED and r.get("contents", "model") == "model":
            lines.setdefault(f"{r['operation']}: {r['mechanism']}", []).append(r)
    for label, points in sorted(lines.items()):
        points.sort(key=lambda r: r["file_bytes"])
        sizes = [r["file_bytes"] / 1e6 for r in points]
        for ax, key in zip(axes, ("x_vanilla", "x_ceiling")):
            ax.plot(sizes, [r[key] for r in points], marker="o", label=label)
    for ax, title in zip(axes, ("speed / vanilla torch (torch.save + fsync, torch.load)",
                                "speed / raw engine (no format)")):
        ax.set_xscale("log")
        ax.axhline(1.0, color="grey", linewidth=1, linestyle="--")
        ax.set_xlabel("checkpoint file size (MB)")
        ax.set_title(title)
        ax.grid(True, which="both", alpha=0.3)
    axes[0].set_ylabel("median of per-round ratios (higher is faster)")
    axes[1].legend(fontsize=7, loc="lower right")
    common.save_figure(fig, path)


def run(args) -> int:
    common.require("tqdm")
    common.check_output_paths(args.json, args.csv, args.plot)
    started = time.perf_counter()
    common.notice(f"fastpersist bench small: sizes {', '.join(f'{s:g}' for s in args.sizes)} GB, "
                  f"{common.plural(args.repeats, 'round')} each")
    rows, models, machine = [], [], None
    for size in args.sizes:
        size_rows, model, machine = measure_size(args, size)
        rows += size_rows
        models.append(f"{size:g} GB: {model}")
    if getattr(args, "optimizer", True):
        size_rows, model, machine = measure_size(args, 0.0, "optimizer")
        rows += size_rows
        models.append(f"optimizer: {model}")
    wall = time.perf_counter() - started
    echo("fastpersist bench small: the default benchmark's rows at each size (see `fastpersist bench` for the "
         "method: fsync in every save, a dropped page cache before every load, shuffled rounds, medians, "
         "ratios as medians of per-round pairs)")
    for line in models:
        echo(f"  {line}")
    echo()
    body = [(f"{r['file_bytes'] / 1e6:.1f}" + (" (Adam)" if r["contents"] == "optimizer" else ""), r["operation"], r["mechanism"], r["engine"], f"{r['median_s']:.4f}",
             fmt(r["gb_per_s"]), fmt(r["x_vanilla"]), fmt(r["x_ceiling"])) for r in rows]
    for line in common.table(["MB", "operation", "mechanism", "engine", "median s", "GB/s", "x vanilla",
                              "x ceiling"], body, right=(0, 4, 5, 6, 7)):
        echo(line)
    plot(rows, args.plot)
    echo(f"wrote {args.plot}")
    echo(f"wall time {wall:.0f} s")
    if args.json:
        common.write_json(args.json, {"benchmark": "fastpersist bench small", "machine": machine,
                                      "sizes_gb": args.sizes, "repeats": args.repeats,
                                      "ram_device_gb": getattr(args, "ram_device", None), "wall_s": wall,
                                      "results": rows})
        echo(f"wrote {args.json}")
    if args.csv:
        common.write_csv(args.csv, rows, ["size_gb", "file_bytes", "contents", "operation", "mechanism", "engine",
                                          "median_s", "gb_per_s", "x_vanilla", "x_ceiling", "x_ceiling_low",
                                          "x_ceiling_high"])
        echo(f"wrote {args.csv}")
    return 0
