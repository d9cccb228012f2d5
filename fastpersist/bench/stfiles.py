"""``fastpersist bench safetensors``: safetensors files as Hugging Face
libraries write and read them, against the safetensors package and the raw
engine.

Two workloads: a GPT-2-shaped model of ``--size`` GB in two shards, and a
LoRA-like file of ``--small-mb`` MB in ~500 small tensors. Measured, in an
order shuffled from round to round:

- save to new files: ``safetensors.torch.save_file`` + fsync, fastpersist's
  ``save_file`` (atomic and durable), and the raw engine writing the same
  bytes (no format) to new files;
- cold load, each in a fresh process with the files dropped from the page
  cache, every byte touched: ``safetensors.torch.load_file`` (its mmap
  backend), ``safe_open(..., backend="pread")`` where this safetensors has
  it, fastpersist's ``load_file``, the raw engine's read into memory
  mapped then, and where installed fastsafetensors (``fastsafe_open``,
  ``nogds=True``, to the CPU) and runai-model-streamer
  (``SafetensorsStreamer``, to the CPU);
- cold load as transformers 5 reads a shard (every tensor by
  ``get_slice(name)[...]`` from 4 threads, names in its order), through
  safetensors' ``safe_open`` and fastpersist's;
- warm load (the files in the page cache), in this process: safetensors'
  ``load_file`` and fastpersist's.
"""
from __future__ import annotations

import dataclasses
import importlib.util
import os
import random
import time

from . import common
from .common import GB, BenchError, Series, echo, fmt
from .child import AS_TRANSFORMERS_READS
from .fresh import FreshProcesses


def _state(size_gb: float, dtype_name: str) -> dict:
    """A GPT-2-shaped state of about size_gb, no tensor sharing memory (a
    tied head saved once, as save_pretrained does)."""
    import torch

    from . import models
    from .default import sized_model

    dtype = getattr(torch, dtype_name)
    config, _, _ = sized_model(int(size_gb * GB), dtype)
    model = models.build(config, dtype)
    seen, state = set(), {}
    for name, tensor in model.state_dict().items():
        key = tensor.untyped_storage().data_ptr()
        if key not in seen:
            seen.add(key)
            state[name] = tensor.detach().contiguous()
    return state


def _small_state(megabytes: float, count: int = 500) -> dict:
    import torch

    g = torch.Generator().manual_seed(7)
    per = max(1, int(megabytes * 1e6 / 2 / count))  # bf16 elements per tensor
    return {f"base_model.model.layers.{i // 4}.lora_{'AB'[i % 2]}.{i % 4}.weight": torch.randn(per, generator=g).bfloat16()
            for i in range(count)}


def _shards(state: dict, n: int) -> list:
    names = list(state)
    size = -(-len(names) // n)
    return [{k: state[k] for k in names[i:i + size]} for i in range(0, len(names), size)]


class SafetensorsBench:
    def __init__(self, args):
        common.require("safetensors")
        import safetensors.torch as reference

        self.args = args
        self.reference_save = getattr(reference, "_fastpersist_original_save_file", reference.save_file)
        self.reference_load = getattr(reference, "_fastpersist_original_load_file", reference.load_file)
        state = _state(args.size, args.dtype)
        self.workloads = [("model, 2 shards", _shards(state, 2)),
                          (f"LoRA-like, {args.small_mb:g} MB", [_small_state(args.small_mb)])]
        total = sum(t.nbytes for _, shards in self.workloads for s in shards for t in s.values())
        self.workspace = common.Workspace(args.folder, int(total * 3.2) + (64 << 20))
        self.dropper = common.CacheDropper(args.cache_drop)
        self.options = common.bench_options()
        self.files = {}
        for label, shards in self.workloads:
            paths = [self.workspace.file(f"{label.split(',')[0].replace(' ', '-')}-{i}.safetensors")
                     for i in range(len(shards))]
            for shard, path in zip(shards, paths):
                self.reference_save(shard, path, metadata={"format": "pt"})
                common.fsync_path(path)
            self.files[label] = paths
        self.fresh = FreshProcesses()

    def close(self) -> None:
        self.workspace.close()

    # -- saves -----------------------------------------------------------
    def _new_paths(self, label: str) -> list:
        return [self.workspace.file(f"new-{i}.safetensors") for i in range(len(self.files[label]))]

    def save(self, label: str, shards: list, mechanism: str) -> float:
        from fastpersist import FastFileWriter
        from fastpersist import safetensors as fst

        paths = self._new_paths(label)
        try:
            start = time.perf_counter()
            for shard, path in zip(shards, paths):
                if mechanism == "safetensors save_file + fsync":
                    self.reference_save(shard, path, metadata={"format": "pt"})
                    common.fsync_path(path)
                elif mechanism == "fastpersist save_file":
                    fst.save_file(shard, path, metadata={"format": "pt"}, **dataclasses.asdict(self.options))
                else:  # the raw engine: the same bytes, no format
                    with FastFileWriter(path, exclusive=True, sole_writer=True, options=self.options) as writer:
                        for t in shard.values():
                            writer.write_address(t.data_ptr(), t.nbytes)
            return time.perf_counter() - start
        finally:
            for path in paths:
                common.remove(path)

    # -- loads -----------------------------------------------------------
    def cold_load(self, label: str, mechanism: str) -> float:
        paths = self.files[label]
        self.dropper.drop(*paths)
        result = self.fresh.run({"kind": "safetensors_load", "mechanism": mechanism, "paths": paths,
                                 "options": dataclasses.asdict(self.options), "dtype": self.args.dtype})
        return result["seconds"]

    def warm_load(self, label: str, mechanism: str) -> float:
        from fastpersist import safetensors as fst

        paths = self.files[label]
        for path in paths:  # in the page cache
            with open(path, "rb") as f:
                while f.read(64 << 20):
                    pass
        start = time.perf_counter()
        loaded = [self.reference_load(p) if mechanism.startswith("safetensors") else fst.load_file(p) for p in paths]
        for tensors in loaded:
            common.touch_all(tensors)
        seconds = time.perf_counter() - start
        del loaded
        return seconds


COLD = ("safetensors load_file (mmap)", "safetensors safe_open (pread)", "fastpersist load_file",
        "raw engine read")
# the loaders that compete with it, each measured where its package is installed (the `bench` extra's
# optional peers): {mechanism: module}
PEERS = {"fastsafetensors (nogds, CPU)": "fastsafetensors", "runai-model-streamer": "runai_model_streamer"}
SAVES = ("safetensors save_file + fsync", "fastpersist save_file", "raw engine write")
WARM = ("safetensors load_file (mmap)", "fastpersist load_file")


def _role(mechanism: str) -> str:
    if mechanism.startswith("raw"):
        return "ceiling"
    if mechanism.startswith("safetensors"):
        return "vanilla"
    if mechanism in PEERS:
        return "other"
    return "fastpersist"


def run(args) -> int:
    common.check_output_paths(args.json, args.csv)
    started = time.perf_counter()
    try:
        bench = SafetensorsBench(args)
    except ImportError as exc:
        raise BenchError(f"{exc}") from None
    try:
        import safetensors

        has_pread = _has_pread_backend(bench.files[bench.workloads[1][0]][0])
        peers = tuple(m for m, module in PEERS.items() if importlib.util.find_spec(module) is not None)
        missing = [module for module in PEERS.values() if importlib.util.find_spec(module) is None]
        if missing:
            common.notice(f"not measured (not installed): {', '.join(missing)}")
        series, measures = [], []
        for label, shards in bench.workloads:
            nbytes = sum(os.path.getsize(p) for p in bench.files[label])
            for m in SAVES:
                s = Series(f"save: {label}", m, role=_role(m), nbytes=nbytes)
                series.append(s)
                measures.append((s, lambda label=label, shards=shards, m=m: bench.save(label, shards, m)))
            for m in COLD + peers:
                if m.endswith("(pread)") and not has_pread:
                    continue
                s = Series(f"cold load, fresh process: {label}", m, role=_role(m), nbytes=nbytes)
                series.append(s)
                measures.append((s, lambda label=label, m=m: bench.cold_load(label, m)))
            for m in AS_TRANSFORMERS_READS:
                s = Series(f"cold load, fresh process, as transformers reads: {label}", m, role=_role(m),
                           nbytes=nbytes)
                series.append(s)
                measures.append((s, lambda label=label, m=m: bench.cold_load(label, m)))
            for m in WARM:
                s = Series(f"warm load: {label}", m, role=_role(m), nbytes=nbytes)
                series.append(s)
                measures.append((s, lambda label=label, m=m: bench.warm_load(label, m)))
        for r in range(args.repeats):
            order = list(measures)
            if r:
                random.Random(r).shuffle(order)
            for s, measure in order:
                s.add(measure())
        echo(f"fastpersist bench safetensors: safetensors {safetensors.__version__}, {args.repeats} rounds")
        for line in common.machine_lines(common.machine_info(bench.workspace.path)):
            echo(line)
        echo(f"page cache: {bench.dropper.describe()}")
        echo("x ref: safetensors' time / this time in the same round (save_file + fsync, load_file), median over "
             "rounds; x ceiling: the raw engine's time / this time")
        echo()
        rows, lines = [], []
        for s in series:
            x_ref, x_ceiling = common.role_ratios(series, s)
            rows.append(common.series_row(s, x_ref, x_ceiling))
            lines.append([s.operation, s.mechanism, f"{s.median:.3f}", f"{s.gb_per_s:.2f}", fmt(x_ref), fmt(x_ceiling)])
        for line in common.table(["operation", "mechanism", "median s", "GB/s", "x ref", "x ceiling"], lines,
                                 right=(2, 3, 4, 5)):
            echo(line)
        echo(f"wall time {time.perf_counter() - started:.0f} s")
        if args.json:
            common.write_json(args.json, {"benchmark": "fastpersist bench safetensors",
                                          "machine": common.machine_info(bench.workspace.path),
                                          "safetensors": safetensors.__version__,
                                          "settings": {"size_gb": args.size, "small_mb": args.small_mb,
                                                       "repeats": args.repeats, "dtype": args.dtype,
                                                       "ram_device_gb": getattr(args, "ram_device", None)},
                                          "page_cache": bench.dropper.as_dict(), "results": rows})
            echo(f"wrote {args.json}")
        if args.csv:
            common.write_csv(args.csv, rows, ["operation", "mechanism", "median_s", "gb_per_s", "x_vanilla",
                                              "x_ceiling"])
            echo(f"wrote {args.csv}")
        return 0
    finally:
        bench.close()


def _has_pread_backend(path: str) -> bool:
    """Whether this safetensors' safe_open takes backend="pread" (0.8 and later)."""
    import safetensors

    opener = getattr(safetensors, "_fastpersist_original_safe_open", safetensors.safe_open)
    try:
        with opener(path, framework="pt", backend="pread"):
            return True
    except TypeError:
        return False
