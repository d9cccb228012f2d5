"""``fastpersist bench restart``: what checkpointing and restarting an LLM
costs, for 3B-, 13B- and 70B-shaped models.

The models are stand-ins that fit a CPU machine's memory and minutes: each
has its model's layer shapes, vocabulary and embeddings, with fewer decoder
layers (``--layers``, default 1). A checkpoint is sharded into files of at
most ``--shard-size`` GB (whole tensors, in state-dict order, with an index
file naming each tensor's file, as sharded model checkpoints are).

Checkpoint: every file written and fsynced, by torch.save and by
fastpersist.save, into a new folder. Restart, each in a fresh process from a
dropped page cache: build the model, restore it, and take a "first step"
that writes every parameter once (``p.add_(0)``), so that the copy-on-write
faults torch.load(mmap=True) defers are paid where a job pays them:

- torch.load + load_state_dict (the model built on the CPU, uninitialised);
- torch.load(mmap=True) + load_state_dict(assign=True) on a meta-device model;
- fastpersist.load + load_state_dict;
- fastpersist.load_into the model built on the CPU.
"""
from __future__ import annotations

import dataclasses
import json
import os
import shutil
import time

from . import common
from .fresh import FreshProcesses
from .common import GB, Series, echo, fmt

CHECKPOINT = ("torch.save + fsync", "fastpersist.save")
RESTART = ("torch.load + load_state_dict", "torch.load(mmap=True) + load_state_dict(assign=True)",
           "fastpersist.load + load_state_dict", "fastpersist.load_into")


def stand_ins() -> dict:
    """name -> (the model it stands for, its full config)."""
    from . import models

    return {
        "3b": ("Llama-3.2-3B", models.CONFIGS["llama-3b"]),
        "13b": ("Llama-2-13B", models.ModelConfig("llama", 5120, 40, 40, 32000, 13824, note="Llama-2-13B, 13.0B")),
        "70b": ("Llama-2-70B", models.ModelConfig("llama", 8192, 80, 64, 32000, 28672, kv_heads=8,
                                                  note="Llama-2-70B, 69.0B")),
        # tied head, like the 3B: the path where two keys share one storage
        "tiny": ("tiny Llama", models.ModelConfig("llama", 256, 4, 4, 4096, 768, kv_heads=2, tie_embeddings=True,
                                                  note="tiny Llama layout for checking the benchmark")),
    }


def shard(entries: list, limit: int) -> list:
    """[(key, nbytes, storage id)] -> lists of keys, each list at most limit
    bytes unless one tensor alone is larger; a key sharing a storage (a tied
    head) goes with the file holding that storage."""
    shards, sizes, home = [[]], [0], {}
    for key, nbytes, storage in entries:
        if storage in home:
            shards[home[storage]].append(key)
            continue
        if sizes[-1] and sizes[-1] + nbytes > limit:
            shards.append([])
            sizes.append(0)
        shards[-1].append(key)
        sizes[-1] += nbytes
        home[storage] = len(shards) - 1
    return [s for s in shards if s]


def file_names(count: int) -> list:
    return [f"model-{i + 1:05d}-of-{count:05d}.pt" for i in range(count)]


def full_model_files(config, dtype, limit: int) -> tuple:
    """(bytes, files) of the real model's checkpoint, from its shapes alone."""
    import math

    import torch

    from . import models

    element = torch.empty((), dtype=dtype).element_size()
    entries = [(key, math.prod(shape) * element, key) for key, shape in models.param_shapes(config)]
    return sum(e[1] for e in entries), len(shard(entries, limit))


class Subject:
    """One stand-in: its model, its checkpoint files for the restarts, its series."""

    def __init__(self, name: str, args, workspace: common.Workspace, dtype):
        from . import models

        self.name = name
        self.real, base = stand_ins()[name]
        self.base = base
        self.config = dataclasses.replace(base, layers=args.layers)
        self.full_bytes, self.full_files = full_model_files(base, dtype, int(args.shard_size * GB))
        self.model = models.build(self.config, dtype)
        self.state = self.model.state_dict()
        entries = [(k, t.untyped_storage().nbytes(), t.untyped_storage().data_ptr()) for k, t in self.state.items()]
        self.shards = shard(entries, int(args.shard_size * GB))
        self.names = file_names(len(self.shards))
        self.weight_map = {k: n for keys, n in zip(self.shards, self.names) for k in keys}
        self.folder = workspace.file(f"restart-{name}")
        os.makedirs(self.folder)
        self.write(self.folder, "torch.save + fsync", {})  # the files every restart reads
        self.file_sizes = [os.path.getsize(os.path.join(self.folder, n)) for n in self.names]
        self.checks = {keys[0]: float(self.state[keys[0]].flatten()[:4096].double().sum()) for keys in self.shards}

    @property
    def paths(self) -> list:
        return [os.path.join(self.folder, n) for n in self.names]

    def write(self, folder: str, mechanism: str, options: dict) -> dict:
        """Writes every file and the index into folder; returns seconds per phase."""
        import fastpersist
        from fastpersist.patching import original_save

        phases = {"files": 0.0, "index": 0.0}
        start = time.perf_counter()
        for keys, name in zip(self.shards, self.names):
            part = {k: self.state[k] for k in keys}
            path = os.path.join(folder, name)
            if mechanism == "torch.save + fsync":
                original_save()(part, path)
                common.fsync_path(path)
            else:
                fastpersist.save(part, path, **options)
        wrote = time.perf_counter()
        index = os.path.join(folder, "model.pt.index.json")
        with open(index, "w", encoding="utf-8") as fh:
            json.dump({"metadata": {"total_size": sum(s.nbytes() for s in common.distinct_storages(self.state))},
                       "weight_map": self.weight_map}, fh)
            fh.flush()
            os.fsync(fh.fileno())
        phases["files"], phases["index"] = wrote - start, time.perf_counter() - wrote
        return phases


def _plot(path: str, rows: list) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    models_ = list(dict.fromkeys(r["model"] for r in rows))
    ticks = []
    for name in models_:
        r = next(r for r in rows if r["model"] == name)
        # one short line each: the checkpoint panel is a third of the width
        ticks.append(f"{name}: {r['stand_in_for']}\n{r['layers']} of {r['full_layers']} layers\n"
                     f"{r['bytes'] / GB:.2f} GB, {r['files']} file{'s' if r['files'] > 1 else ''}")
    fig, axes = plt.subplots(1, 2, figsize=(max(12.0, 4.5 * len(models_)), 5.5), width_ratios=[1, 2])
    for ax, phase, title in ((axes[0], "checkpoint", "checkpoint: every file written + fsync"),
                             (axes[1], "restart", "restart in a fresh process: build + restore + first step")):
        mechanisms = list(dict.fromkeys(r["mechanism"] for r in rows if r["phase"] == phase))
        width = 0.8 / len(mechanisms)
        for k, mechanism in enumerate(mechanisms):
            xs, ys = [], []
            for i, name in enumerate(models_):
                for r in rows:
                    if (r["phase"], r["mechanism"], r["model"]) == (phase, mechanism, name):
                        xs.append(i + (k - (len(mechanisms) - 1) / 2) * width)
                        ys.append(r["median_s"])
            bars = ax.bar(xs, ys, width, label=mechanism)
            ax.bar_label(bars, fmt="%.2f", fontsize=7)
        ax.set_xticks(range(len(models_)))
        ax.set_xticklabels(ticks, fontsize=8)
        ax.set_ylabel("seconds (median)")
        ax.set_title(title, fontsize=10)
        ax.grid(axis="y", alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle("fastpersist bench restart: CPU-sized stand-ins (the real layer shapes, fewer layers)", fontsize=10)
    common.save_figure(fig, path)


CSV_COLUMNS = ["model", "stand_in_for", "layers", "full_layers", "dtype", "bytes", "files", "file_sizes",
               "full_bytes", "full_files", "phase", "mechanism", "engine", "rounds", "median_s", "min_s", "max_s",
               "gb_per_s", "gib_per_s", "x_vanilla", "phases_s", "times_s"]


def run(args) -> int:
    common.require("tqdm", "matplotlib")
    common.check_output_paths(args.json, args.csv, args.plot)
    known = stand_ins()
    unknown = [m for m in args.models if m not in known]
    if unknown:
        raise common.BenchError(f"unknown model(s) {', '.join(unknown)}; known: {', '.join(known)}")
    started = time.perf_counter()

    import torch

    from . import models

    dtype = getattr(torch, args.dtype)
    options = common.bench_options()
    engine = common.resolve_engines(args.engine, options)[0][0]
    options = options.replace(engine=engine)
    sizes = {m: models.param_bytes(dataclasses.replace(known[m][1], layers=args.layers), dtype) for m in args.models}
    workspace = common.Workspace(args.folder, int(2 * max(sizes.values()) * 1.1) + (64 << 20))
    dropper = common.CacheDropper(args.cache_drop)
    rows: list = []
    subjects_info = []
    common.notice(f"fastpersist bench restart: {', '.join(args.models)} ({sum(sizes.values()) / GB:.1f} GB in all), "
                  f"{common.plural(args.repeats, 'round')}, in {workspace.path} (removed afterwards)")
    try:
        machine = common.machine_info(workspace.path)
        fresh = FreshProcesses()
        steps = len(args.models) * (1 + args.repeats * (len(CHECKPOINT) + len(RESTART)))
        with common.progress(steps, "fastpersist bench restart") as bar:
            for name in args.models:  # one model in memory at a time
                bar.set_postfix_str(f"{name}: building the model and its checkpoint")
                subject = Subject(name, args, workspace, dtype)
                bar.update()
                nbytes = sum(subject.file_sizes)
                series = {m: Series("checkpoint", m, "-" if m.startswith("torch") else engine, nbytes=nbytes,
                                    role="vanilla" if m.startswith("torch") else "fastpersist") for m in CHECKPOINT}
                series.update({m: Series("restart", m, "-" if m.startswith("torch") else engine, nbytes=nbytes,
                                         role="vanilla" if m == RESTART[0] else "other") for m in RESTART})
                work = [("checkpoint", m) for m in CHECKPOINT] + [("restart", m) for m in RESTART]
                for round_index in range(args.repeats):
                    for phase, mechanism in common.round_order(work, round_index):
                        bar.set_postfix_str(f"{name} round {round_index + 1}: {phase}: {mechanism}")
                        if phase == "checkpoint":
                            folder = workspace.file("checkpoint-timing")
                            shutil.rmtree(folder, ignore_errors=True)
                            os.makedirs(folder)
                            os.sync()
                            start = time.perf_counter()
                            phases = subject.write(folder, mechanism, dataclasses.asdict(options))
                            seconds = time.perf_counter() - start
                            shutil.rmtree(folder)  # outside the timing, with the sync
                            common.wait_for_background_work()
                            os.sync()
                        else:
                            dropper.drop(*subject.paths)
                            result = fresh.run({
                                "kind": "restart", "mechanism": mechanism, "folder": subject.folder,
                                "index": "model.pt.index.json", "config": dataclasses.asdict(subject.config),
                                "dtype": args.dtype, "options": dataclasses.asdict(options),
                                "check_keys": list(subject.checks)})
                            for key, expected in subject.checks.items():
                                got = result["checks"].get(key)
                                if got is None or abs(got - expected) > 1e-6 * max(1.0, abs(expected)):
                                    raise common.BenchError(f"{mechanism} restored {key} wrongly "
                                                            f"(sum {got}, expected {expected})")
                            seconds, phases = result["seconds"], result["phases"]
                        series[mechanism].add(seconds, phases)
                        bar.update()
                vanilla = {"checkpoint": series[CHECKPOINT[0]], "restart": series[RESTART[0]]}
                info = {"model": name, "stand_in_for": subject.real, "layers": subject.config.layers,
                        "full_layers": subject.base.layers, "dtype": args.dtype, "bytes": nbytes,
                        "files": len(subject.names), "file_sizes": subject.file_sizes,
                        "full_bytes": subject.full_bytes, "full_files": subject.full_files,
                        "tensors": len(subject.state)}
                subjects_info.append(info)
                for s in series.values():
                    row = common.series_row(s, common.ratio(vanilla[s.operation], s), None, **info)
                    row["phase"] = row.pop("operation")
                    row.pop("x_ceiling")
                    rows.append(row)
                del subject
    finally:
        workspace.close()
    wall = time.perf_counter() - started

    echo(f"fastpersist bench restart: checkpoint and restart of LLM-shaped models, {args.dtype}, random weights")
    echo(f"stand-ins: CPU-sized, NOT the full models: each keeps its model's layer shapes, vocabulary and "
         f"embeddings, with {args.layers} decoder layer{'s' if args.layers > 1 else ''}; files of at most "
         f"{args.shard_size:g} GB")
    for info in subjects_info:
        sizes_text = ", ".join(f"{b / GB:.2f}" for b in info["file_sizes"])
        echo(f"  {info['model']}: {info['stand_in_for']} with {info['layers']} of {info['full_layers']} layers, "
             f"{info['tensors']} tensors, {info['bytes'] / GB:.2f} GB in {info['files']} file"
             f"{'s' if info['files'] > 1 else ''} ({sizes_text} GB); the full model: {info['full_bytes'] / GB:.3g} "
             f"GB, {info['full_files']} file{'s' if info['full_files'] > 1 else ''}")
    for line in common.machine_lines(machine):
        echo(line)
    echo(f"engine: {engine}; options {common.options_text(options)}")
    echo(f"page cache: {dropper.describe()}")
    echo(f"method: {args.repeats} round{'s' if args.repeats > 1 else ''} per model, each running every mechanism "
         "once, in an order shuffled from round to round; medians. Restart: in a fresh process forked from a "
         "server that has imported only torch and fastpersist (the import is not timed); build (uninitialised, "
         "or on the meta device), restore, first step (p.add_(0) on every parameter). x vanilla: torch's "
         "time / this time, the median over rounds of the two times in the same round.")
    echo()
    body = [(r["model"], f"{r['bytes'] / GB:.2f}", r["files"], r["phase"], r["mechanism"], f"{r['median_s']:.3f}",
             fmt(r["gb_per_s"]), fmt(r["x_vanilla"]), common.phases_text(r["phases_s"])) for r in rows]
    for line in common.table(["model", "GB", "files", "", "mechanism", "median s", "GB/s", "x vanilla",
                              "where the time went (median s)"], body, right=(1, 2, 5, 6, 7)):
        echo(line)
    echo()

    _plot(args.plot, rows)
    echo(f"wrote {args.plot}")
    if args.csv:
        common.write_csv(args.csv, rows, CSV_COLUMNS)
        echo(f"wrote {args.csv}")
    if args.json:
        common.write_json(args.json, {
            "benchmark": "fastpersist bench restart", "machine": machine,
            "settings": {"models": args.models, "layers": args.layers, "dtype": args.dtype,
                         "shard_size_gb": args.shard_size, "repeats": args.repeats, "engine": engine,
                         "options": dataclasses.asdict(options), "cache_drop": args.cache_drop},
            "models": subjects_info, "page_cache": dropper.as_dict(), "wall_s": wall, "results": rows})
        echo(f"wrote {args.json}")
    echo(f"wall time {wall:.0f} s")
    return 0
