"""``fastpersist bench sweep``: the engine options against this machine.

For each file size, engine, buffer size, number of buffers, queue depth and
request size: ``fastpersist.save`` of the model to a new file (fsync
included) and ``fastpersist.load_into`` the model from a dropped page cache.
Each combination's engine is started before its timings (an engine is made
once per configuration and reused), and the pool is emptied between
combinations so their buffers do not pile up. The defaults (engine=auto and
the settings a program gets here) are always part of the grid, so the
report can say how far they are from the best.
"""
from __future__ import annotations

import dataclasses
import itertools
import os
import statistics
import time

from . import common
from .common import GB, MiB, Series, echo, fmt

OPERATIONS = ("write", "read")


@dataclasses.dataclass(frozen=True)
class Combo:
    engine: str
    buffer_size: int
    num_buffers: int
    queue_depth: int
    request_size: int

    def label(self) -> str:
        return (f"{self.buffer_size / MiB:g}M x{self.num_buffers} qd{self.queue_depth}"
                f"{'' if self.request_size == MiB else f' rq{self.request_size / MiB:g}M'}")


def combos(args, engines: list, default: Combo) -> list:
    request_sizes = args.request_sizes or [default.request_size]
    grid = [Combo(e, b, n, q, r) for e, b, n, q, r in itertools.product(
        engines, args.buffer_sizes, args.num_buffers, args.queue_depths, request_sizes) if r <= b]
    if default not in grid:
        grid.append(default)
    return grid


def _plot(path: str, rows: list, sizes: list, engines: list, default: Combo) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = list(dict.fromkeys(r["label"] for r in rows))
    width = 0.8 / max(1, len(engines))
    fig, axes = plt.subplots(len(OPERATIONS), len(sizes), squeeze=False,
                             figsize=(max(8.0, 0.5 * len(labels) * max(1, len(engines)) ** 0.5) * len(sizes), 8))
    for col, size in enumerate(sizes):
        for row_index, operation in enumerate(OPERATIONS):
            ax = axes[row_index][col]
            for k, engine in enumerate(engines):
                xs, ys, edges = [], [], []
                for i, label in enumerate(labels):
                    for r in rows:
                        if (r["size_gb"], r["operation"], r["engine"], r["label"]) == (size, operation, engine, label):
                            xs.append(i + (k - (len(engines) - 1) / 2) * width)
                            ys.append(r["gb_per_s"])
                            edges.append(r["is_default"])
                bars = ax.bar(xs, ys, width, label=engine)
                for bar, is_default in zip(bars, edges):
                    if is_default:
                        bar.set_edgecolor("black")
                        bar.set_linewidth(2)
                        ax.annotate("default", (bar.get_x() + bar.get_width() / 2, bar.get_height()),
                                    ha="center", va="bottom", fontsize=8)
            ax.set_xticks(range(len(labels)))
            ax.set_xticklabels(labels, rotation=60, ha="right", fontsize=8)
            ax.set_ylabel("GB/s")
            ax.set_title(f"{'fastpersist.save (new file, fsync)' if operation == 'write' else 'fastpersist.load_into (cold cache)'}"
                         f", {size:g} GB")
            ax.grid(axis="y", alpha=0.3)
            ax.legend(fontsize=8)
    fig.suptitle(f"fastpersist bench sweep: buffer size x buffers x queue depth\n"
                 f"(defaults here: {default.engine} {default.label()}; GB = 1e9 bytes)", fontsize=10)
    common.save_figure(fig, path)


CSV_COLUMNS = ["size_gb", "bytes", "operation", "engine", "buffer_size", "num_buffers", "queue_depth",
               "request_size", "is_default", "rounds", "median_s", "min_s", "max_s", "gb_per_s", "gib_per_s",
               "times_s"]


def run(args) -> int:
    common.require("tqdm", "matplotlib")
    common.check_output_paths(args.json, args.csv, args.plot)
    started = time.perf_counter()

    import torch

    import fastpersist
    from fastpersist import _engine
    from fastpersist.patching import original_save

    from . import models
    from .default import sized_model

    options = common.bench_options()
    engines, choice = common.resolve_engines(args.engines, options)
    auto_kind = common.resolve_engines("auto", options)[0][0]
    default = Combo(auto_kind, options.buffer_size, options.num_buffers, options.queue_depth, options.request_size)
    grid = combos(args, engines, default)
    if default.engine not in engines:
        engines.append(default.engine)
    sizes = list(args.size)
    dtype = torch.float32
    configs = [sized_model(int(size * GB), dtype) for size in sizes]
    total_bytes = sum(models.param_bytes(c, dtype) for c, _, _ in configs)
    workspace = common.Workspace(args.folder, int((total_bytes + max(models.param_bytes(c, dtype) for c, _, _ in
                                                                     configs)) * 1.05) + (64 << 20))
    dropper = common.CacheDropper(args.cache_drop)
    series: dict = {}
    common.notice(f"fastpersist bench sweep: {len(grid)} combinations x {common.plural(len(sizes), 'size')} x "
                  f"{common.plural(args.repeats, 'round')}, in {workspace.path} (removed afterwards)")
    try:
        machine = common.machine_info(workspace.path)
        steps = args.repeats * len(grid) * len(sizes)
        with common.progress(steps + len(sizes), "fastpersist bench sweep") as bar:
            subjects = []
            for i, (config, label, _) in enumerate(configs):
                bar.set_postfix_str(f"building a {sizes[i]:g} GB model")
                model = models.build(config, dtype)
                path = workspace.file(f"checkpoint-{i}.pt")
                original_save()(model.state_dict(), path)
                common.fsync_path(path)
                subjects.append((sizes[i], model, path, os.path.getsize(path), label, config))
                bar.update()
            work = [(s, c) for s in subjects for c in grid]
            for round_index in range(args.repeats):
                for subject, combo in common.round_order(work, round_index):
                    size, model, path, nbytes, _, _ = subject
                    bar.set_postfix_str(f"round {round_index + 1}: {size:g} GB {combo.engine} {combo.label()}")
                    opts = options.replace(**dataclasses.asdict(combo))
                    _engine.clear_pool()  # frees the previous combination's buffers
                    _engine.release(_engine.acquire(opts))  # started before the timings, as in a long-running job
                    target = workspace.file("new.pt")
                    common.remove(target)
                    start = time.perf_counter()
                    fastpersist.save(model.state_dict(), target, **dataclasses.asdict(opts))
                    wrote = time.perf_counter() - start
                    common.remove(target)
                    dropper.drop(path)
                    start = time.perf_counter()
                    fastpersist.load_into(model, path, **dataclasses.asdict(opts))
                    read = time.perf_counter() - start
                    for operation, seconds in (("write", wrote), ("read", read)):
                        key = (size, operation, combo)
                        if key not in series:
                            series[key] = Series(operation, combo.label(), combo.engine, nbytes=nbytes)
                        series[key].add(seconds)
                    bar.update()
            _engine.clear_pool()
    finally:
        workspace.close()
    wall = time.perf_counter() - started

    rows = []
    for (size, operation, combo), s in series.items():
        row = common.series_row(s, None, None, size_gb=size)
        row.update(dataclasses.asdict(combo), label=combo.label(), is_default=combo == default)
        rows.append(row)
    rows.sort(key=lambda r: (r["size_gb"], OPERATIONS.index(r["operation"]), r["engine"], r["buffer_size"],
                             r["num_buffers"], r["queue_depth"], r["request_size"]))

    echo("fastpersist bench sweep: fastpersist.save to a new file (fsync included) and fastpersist.load_into "
         "from a dropped page cache, per engine option combination")
    for size, (config, label, base_layers) in zip(sizes, configs):
        nbytes = next(r["bytes"] for r in rows if r["size_gb"] == size)
        echo(f"checkpoint {size:g} GB: {label} layout, {common.plural(config.layers, 'layer')}, {nbytes / GB:.2f} GB file, float32")
    for line in common.machine_lines(machine):
        echo(line)
    echo(f"engines: {', '.join(engines)} -- {choice}; defaults here: {default.engine} {default.label()} "
         f"(options {common.options_text(options)})")
    echo(f"page cache: {dropper.describe()}")
    echo(f"method: {args.repeats} round{'s' if args.repeats > 1 else ''}, each running every combination once "
         "in an order shuffled from round to round; medians. Each combination's engine is started before its "
         "timings.")
    echo()
    by_combo: dict = {}
    for r in rows:
        by_combo.setdefault((r["size_gb"], r["engine"], r["label"]), {})[r["operation"]] = r
    body = []
    for (size, engine, label), ops in by_combo.items():
        write, read = ops.get("write"), ops.get("read")
        body.append((f"{size:g}", engine, label, fmt(write and write["gb_per_s"]), fmt(read and read["gb_per_s"]),
                     fmt(write and write["gib_per_s"]), fmt(read and read["gib_per_s"]),
                     "default" if (write or read)["is_default"] else ""))
    for line in common.table(["GB", "engine", "buffers, queue depth", "write GB/s", "read GB/s", "write GiB/s",
                              "read GiB/s", ""], body, right=range(3, 7)):
        echo(line)
    echo()
    verdicts = []
    for size in sizes:
        for operation in OPERATIONS:
            candidates = [r for r in rows if r["size_gb"] == size and r["operation"] == operation]
            best = max(candidates, key=lambda r: r["gb_per_s"])
            mine = next(r for r in candidates if r["is_default"])
            share = mine["gb_per_s"] / best["gb_per_s"]
            verdicts.append({"size_gb": size, "operation": operation, "best": best["label"],
                             "best_engine": best["engine"], "best_gb_per_s": best["gb_per_s"],
                             "default_gb_per_s": mine["gb_per_s"], "default_share_of_best": share})
            echo(f"{operation} {size:g} GB: best {best['engine']} {best['label']} {best['gb_per_s']:.2f} GB/s; "
                 f"the defaults {mine['gb_per_s']:.2f} GB/s = {100 * share:.0f}% of it")
    spreads = [(max(r["times_s"]) - min(r["times_s"])) / r["median_s"] for r in rows if len(r["times_s"]) > 1]
    if spreads:
        echo(f"round-to-round spread of one combination: median {100 * statistics.median(spreads):.0f}% "
             "(differences smaller than that are noise)")

    _plot(args.plot, rows, sizes, engines, default)
    echo(f"wrote {args.plot}")
    if args.csv:
        common.write_csv(args.csv, rows, CSV_COLUMNS)
        echo(f"wrote {args.csv}")
    if args.json:
        common.write_json(args.json, {
            "benchmark": "fastpersist bench sweep", "machine": machine,
            "settings": {"sizes_gb": sizes, "repeats": args.repeats, "engines": engines, "engine_choice": choice,
                         "options": dataclasses.asdict(options), "default": dataclasses.asdict(default),
                         "cache_drop": args.cache_drop},
            "page_cache": dropper.as_dict(), "wall_s": wall, "verdicts": verdicts, "results": rows})
        echo(f"wrote {args.json}")
    echo(f"wall time {wall:.0f} s")
    return 0
