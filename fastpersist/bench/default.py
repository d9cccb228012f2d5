"""``fastpersist bench``: save and load one real model's checkpoint on this
machine, against vanilla torch and against the raw engine.

Measured, each in every round, in an order shuffled from round to round:

- save to a new file, and save over an existing checkpoint (the "latest.pt"
  habit): ``torch.save`` + fsync, ``fastpersist.save`` per engine, and the
  ceiling, the raw engine writing the same tensor bytes (no format, no CRC,
  padded to the checkpoint's size) to a new file;
- load in a fresh process (a restart) and in the same process again and
  again: ``torch.load``, ``torch.load(mmap=True)``, ``fastpersist.load`` per
  engine and the ceiling, the raw engine reading the file (in a fresh
  process from scratch, starting its engine and reading into memory it maps
  then, as any load there must; in the same process with its engine started,
  into memory that exists and is touched, as repeated loads reuse it); in a
  fresh process also the raw read with its memory and engine set up
  beforehand, which shows what they cost; in the same process also
  ``fastpersist.load_into`` the model that already exists.

Every save includes its fsync; every load touches every byte it returns and
starts with the file dropped from the page cache.
"""
from __future__ import annotations

import dataclasses
import gc
import importlib
import mmap
import os
import time
from typing import Callable, Optional

from . import common
from .fresh import FreshProcesses
from .common import GB, BenchError, Series, echo, fmt

DTYPES = ("float32", "bfloat16", "float16")


@dataclasses.dataclass
class Mechanism:
    series: Series
    measure: Callable[[], tuple]  # -> (seconds, phases)
    prepare: Callable[[], None] = lambda: None  # untimed, before
    cleanup: Callable[[], None] = lambda: None  # untimed, after


# ---------------------------------------------------------------------------
# the model


def _ladder():
    from . import models

    return [
        ("GPT-2 large", models.CONFIGS["gpt2-large"]),
        ("GPT-2 small", models.CONFIGS["gpt2"]),
        ("narrow GPT-2", models.ModelConfig("gpt2", 256, 4, 4, 8192, 1024, max_positions=256, tie_embeddings=True,
                                            note="GPT-2 layout narrowed for tiny sizes")),
        ("tiny GPT-2", models.ModelConfig("gpt2", 64, 4, 4, 2048, 256, max_positions=128, tie_embeddings=True,
                                          note="GPT-2 layout narrowed for 1 MB checkpoints")),
    ]


def sized_model(nbytes: int, dtype) -> tuple:
    """(config, label, base layer count): the largest GPT-2 shape of which
    one layer fits, with as many of its layers as come closest to nbytes."""
    import torch

    from . import models

    element = torch.empty((), dtype=dtype).element_size()
    ladder = _ladder()
    for name, base in ladder:
        fixed = models.param_count(dataclasses.replace(base, layers=0)) * element
        per_layer = models.param_count(dataclasses.replace(base, layers=1)) * element - fixed
        if fixed + per_layer <= nbytes or name == ladder[-1][0]:
            layers = max(1, round((nbytes - fixed) / per_layer))
            return dataclasses.replace(base, layers=layers), name, base.layers
    raise AssertionError("unreachable")


def _adam_model():
    """The tiny GPT-2 of the ladder with 40 layers: ~500 parameters (12 a layer, 4 more)."""
    return dataclasses.replace(_ladder()[-1][1], layers=40)


def adam_state(model) -> dict:
    """torch.optim.Adam's state_dict after one step with random gradients:
    for each parameter a step count (a 0-d tensor) and two moments."""
    import torch

    optimizer = torch.optim.Adam(model.parameters(), lr=1e-4)
    for p in model.parameters():
        p.grad = torch.randn_like(p)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return optimizer.state_dict()


# ---------------------------------------------------------------------------
# hooks that say where a save's or load's time went


def _save_hooks(clock: common.PhaseClock) -> None:
    from fastpersist import _engine, torch_format, writer

    save_module = importlib.import_module("fastpersist.save")
    clock.hook(torch_format.CheckpointPlan, "for_path", "plan")
    clock.hook(save_module, "remove_stale_temporaries", "open")
    clock.hook(getattr(save_module, "_Temporary", None), "create", "open")
    clock.hook(torch_format, "write_plan", "write")
    clock.hook(_engine.Engine, "end", "drain")
    clock.hook(writer.FastFileWriter, "close", "close")
    # the primitive, not save.py's helper around it: that helper keeps changing
    clock.hook(os, "replace", "rename")
    clock.hook(save_module, "_fsync_folder", "folder fsync")


def _save_phases(total: float, seconds: dict) -> dict:
    """plan, open, write, drain, fsync, rename, folder fsync, other: the parts of one fastpersist.save."""
    seconds = dict(seconds)
    if "close" in seconds:  # FastFileWriter.close = the engine's last writes + fsync
        seconds["fsync"] = max(0.0, seconds.pop("close") - seconds.get("drain", 0.0))
    order = ["plan", "open", "write", "drain", "fsync", "rename", "folder fsync"]
    phases = {name: seconds[name] for name in order if name in seconds}
    phases["other"] = max(0.0, total - sum(phases.values()))
    return phases


# ---------------------------------------------------------------------------
# the mechanisms


class DefaultBench:
    def __init__(self, args):
        import torch

        self.args = args
        self.torch = torch
        self.dtype = getattr(torch, args.dtype)
        self.options = common.bench_options()
        self.engines, self.engine_choice = common.resolve_engines(args.engines, self.options)
        from . import models

        self.contents = getattr(args, "contents", "model")
        if self.contents == "optimizer":
            # Adam's state for a model of ~500 parameters: ~1,500 small tensors, the per-tensor regime
            self.config = _adam_model()
            self.base_name, self.base_layers = "Adam state of a tiny GPT-2", self.config.layers
        else:
            self.config, self.base_name, self.base_layers = sized_model(int(args.size * GB), self.dtype)
        model_bytes = models.param_bytes(self.config, self.dtype) * (2 if self.contents == "optimizer" else 1)
        # checkpoint.pt, latest-torch.pt, one latest file per engine, one new file at a time
        self.workspace = common.Workspace(args.folder, int(model_bytes * (3 + len(self.engines)) * 1.05) + (64 << 20))
        self.dropper = common.CacheDropper(args.cache_drop)
        self.checkpoint = self.workspace.file("checkpoint.pt")  # what every load reads, written by torch.save
        self.fresh: Optional[FreshProcesses] = None
        self.series: list = []

    def opts(self, engine: str):
        return self.options.replace(engine=engine)

    def close(self) -> None:
        self.workspace.close()

    # -- set-up ------------------------------------------------------------
    def prepare(self, bar) -> None:
        from fastpersist.patching import original_save

        from . import models

        self.fresh = FreshProcesses()  # its imports overlap building the model
        bar.set_postfix_str("building the model")
        start = time.perf_counter()
        self.model = models.build(self.config, self.dtype)
        self.state = self.model.state_dict()
        if self.contents == "optimizer":
            self.state = adam_state(self.model)
            self.model = self.state  # what load_into fills: the optimizer's state dict, as its docs say
        self.build_seconds = time.perf_counter() - start
        self.storages = [s for s in common.distinct_storages(self.state) if s.nbytes()]
        self.storage_sizes = [s.nbytes() for s in self.storages]  # the pieces the ceiling touches
        self.tensor_count = sum(1 for _ in common.tensors_in(self.state))
        bar.set_postfix_str("writing the checkpoint to load")
        original_save()(self.state, self.checkpoint)
        common.fsync_path(self.checkpoint)
        self.file_size = os.path.getsize(self.checkpoint)
        # a touched buffer for the raw read (the ceiling reads into existing memory)
        self.raw_memory = mmap.mmap(-1, -(-self.file_size // 4096) * 4096)
        self.raw_buffer = self.torch.frombuffer(self.raw_memory, dtype=self.torch.uint8)
        self.raw_buffer.fill_(1)
        # the checkpoints that the "over an existing checkpoint" saves replace
        bar.set_postfix_str("writing the checkpoints to overwrite")
        original_save()(self.state, self.workspace.file("latest-torch.pt"))
        import fastpersist

        for engine in self.engines:
            fastpersist.save(self.state, self.workspace.file(f"latest-fastpersist-{engine}.pt"),
                             **dataclasses.asdict(self.opts(engine)))
        os.sync()

    # -- saves -------------------------------------------------------------
    def vanilla_save(self, path: str) -> tuple:
        from fastpersist.patching import original_save

        start = time.perf_counter()
        original_save()(self.state, path)
        saved = time.perf_counter()
        common.fsync_path(path)
        end = time.perf_counter()
        return end - start, {"torch.save": saved - start, "fsync": end - saved}

    def fastpersist_save(self, path: str, engine: str) -> tuple:
        import fastpersist

        options = dataclasses.asdict(self.opts(engine))
        with common.PhaseClock() as clock:
            _save_hooks(clock)
            start = time.perf_counter()
            fastpersist.save(self.state, path, **options)
            total = time.perf_counter() - start
        return total, _save_phases(total, clock.seconds)

    def raw_write(self, path: str, engine: str) -> tuple:
        from fastpersist import FastFileWriter

        start = time.perf_counter()
        with FastFileWriter(path, exclusive=True, sole_writer=True, options=self.opts(engine)) as writer:
            common.write_storages(writer, self.storages, self.file_size)
            wrote = time.perf_counter()
        end = time.perf_counter()
        return end - start, {"write": wrote - start, "drain + fsync": end - wrote}

    def save_mechanisms(self) -> list:
        ws, out = self.workspace, []

        def new_file(series, path, fn):
            return Mechanism(series, lambda: fn(path), prepare=lambda: common.remove(path),
                             cleanup=lambda: common.remove(path))

        def existing(series, path, fn):
            def cleanup():
                common.wait_for_background_work()  # a replaced file freed in the background: not the next one's time
                os.sync()
            return Mechanism(series, lambda: fn(path), prepare=lambda: self.dropper.drop(path), cleanup=cleanup)

        new, over = "save, new file", "save, over existing"
        out.append(new_file(Series(new, "torch.save + fsync", role="vanilla"), ws.file("new-torch.pt"),
                            self.vanilla_save))
        for engine in self.engines:
            out.append(new_file(Series(new, "fastpersist.save", engine, role="fastpersist"),
                                ws.file(f"new-fastpersist-{engine}.pt"),
                                lambda p, e=engine: self.fastpersist_save(p, e)))
            out.append(new_file(Series(new, "raw engine write (ceiling)", engine, role="ceiling"),
                                ws.file(f"new-raw-{engine}.bin"), lambda p, e=engine: self.raw_write(p, e)))
        out.append(existing(Series(over, "torch.save + fsync", role="vanilla"), ws.file("latest-torch.pt"),
                            self.vanilla_save))
        for engine in self.engines:
            out.append(existing(Series(over, "fastpersist.save", engine, role="fastpersist"),
                                ws.file(f"latest-fastpersist-{engine}.pt"),
                                lambda p, e=engine: self.fastpersist_save(p, e)))
        return out

    # -- loads in this process --------------------------------------------------
    def same_process_loads(self) -> list:
        import fastpersist
        from fastpersist.patching import original_load

        operation, path, out = "load, same process", self.checkpoint, []
        kept = []  # what a load returned, freed after its timing like a job would keep it

        def prepare():
            self.dropper.drop(path)

        def cleanup():
            kept.clear()
            gc.collect()

        def timed_load(load: Callable, hooks: Callable = lambda clock: None) -> Callable:
            def measure():
                with common.PhaseClock() as clock:
                    hooks(clock)
                    start = time.perf_counter()
                    kept.append(load())
                    loaded = time.perf_counter()
                common.touch_all(kept[-1])
                end = time.perf_counter()
                phases = common.load_phases(clock, loaded - start)
                phases["touch"] = end - loaded
                return end - start, phases
            return measure


        def with_options(engine):
            def load():
                with common.options_for_load(self.opts(engine)):
                    return fastpersist.load(path, weights_only=True)
            return load

        def load_into(engine):
            options = dataclasses.asdict(self.opts(engine))

            def measure():
                start = time.perf_counter()
                fastpersist.load_into(self.model, path, **options)
                loaded = time.perf_counter()
                common.touch_all(self.state)
                end = time.perf_counter()
                return end - start, {"load_into": loaded - start, "touch": end - loaded}
            return measure

        def raw_read(engine):
            options = self.opts(engine)

            def measure():
                pieces = common.pieces_of(self.raw_memory, self.storage_sizes, self.dtype)
                start = time.perf_counter()
                got = common.raw_read(path, self.raw_buffer.data_ptr(), self.file_size, options)
                read = time.perf_counter()
                common.touch_all(pieces)
                end = time.perf_counter()
                if got != self.file_size:
                    raise BenchError(f"the raw read got {got} of {self.file_size} bytes")
                return end - start, {"read": read - start, "touch": end - read}
            return measure

        out.append(Mechanism(Series(operation, "torch.load", role="vanilla"),
                             timed_load(lambda: original_load()(path, weights_only=True)), prepare, cleanup))
        out.append(Mechanism(Series(operation, "torch.load(mmap=True)"),
                             timed_load(lambda: original_load()(path, weights_only=True, mmap=True)),
                             prepare, cleanup))
        for engine in self.engines:
            out.append(Mechanism(Series(operation, "fastpersist.load", engine, role="fastpersist"),
                                 timed_load(with_options(engine), common.hook_load_read), prepare, cleanup))
            out.append(Mechanism(Series(operation, "fastpersist.load_into (existing model)", engine,
                                        role="fastpersist"), load_into(engine), prepare, cleanup))
            out.append(Mechanism(Series(operation, "raw engine read (ceiling)", engine, role="ceiling"),
                                 raw_read(engine), prepare, cleanup))
        return out

    # -- loads in a fresh process ---------------------------------------------
    def _load_in_fresh_process(self, mechanism: str, engine: Optional[str]) -> Callable:
        """A measure: one load of the checkpoint by mechanism in a fresh process."""
        def measure():
            spec = {"kind": "load", "mechanism": mechanism, "path": self.checkpoint,
                    "options": dataclasses.asdict(self.opts(engine or "auto")),
                    "pieces": self.storage_sizes, "dtype": self.args.dtype}
            result = self.fresh.run(spec)
            return result["seconds"], result["phases"]
        return measure

    def _fresh_load_rows(self, operation: str, prepare: Callable) -> list:
        """torch.load, torch.load(mmap=True) and fastpersist.load (each engine), each in a fresh process."""
        load = self._load_in_fresh_process
        rows = [Mechanism(Series(operation, "torch.load", role="vanilla"), load("torch.load", None), prepare),
                Mechanism(Series(operation, "torch.load(mmap=True)"), load("torch.load(mmap=True)", None), prepare)]
        return rows + [Mechanism(Series(operation, "fastpersist.load", engine, role="fastpersist"),
                                 load("fastpersist.load", engine), prepare) for engine in self.engines]

    def fresh_process_loads(self) -> list:
        operation, path, out = "load, fresh process", self.checkpoint, []
        in_fresh_process = self._load_in_fresh_process

        def prepare():
            self.dropper.drop(path)

        out += self._fresh_load_rows(operation, prepare)
        for engine in self.engines:
            # The ceiling of a load in a fresh process starts its engine and
            # reads into memory it maps then, as every load there must: no
            # restart finds memory faulted in or an engine started before it
            # began. The read with both set up beforehand shows what they
            # cost on top of the device (its x ceiling above 1).
            out.append(Mechanism(Series(operation, "raw engine read, from scratch (ceiling)", engine,
                                        role="ceiling"),
                                 in_fresh_process("raw engine read, from scratch", engine), prepare))
            out.append(Mechanism(Series(operation, "raw engine read, memory and engine set up", engine),
                                 in_fresh_process("raw engine read, all set up", engine), prepare))
        return out

    def warm_fresh_process_loads(self) -> list:
        """A restart from a file in the page cache (just written by a
        buffered save, read before, or staged in memory): the fresh-process
        loads again, the file read through the page cache beforehand. The
        ceiling is the read pipeline's parallel read of the bare bytes."""
        operation, path, out = "load, fresh process, file in the page cache", self.checkpoint, []
        in_fresh_process = self._load_in_fresh_process

        def prepare():
            common.warm(path)

        out += self._fresh_load_rows(operation, prepare)
        out.append(Mechanism(Series(operation, "parallel page-cache read, from scratch (ceiling)", "-",
                                    role="ceiling"),
                             in_fresh_process("parallel page-cache read, from scratch", None), prepare))
        return out

    def fresh_process_saves(self) -> list:
        """The first save of a process, to a new file: a new engine's start is
        part of it, as it is of any job that saves once."""
        operation, out = "save, fresh process", []

        def in_fresh_process(mechanism: str, engine: Optional[str], name: str):
            target = self.workspace.file(name)

            def measure():
                spec = {"kind": "save", "mechanism": mechanism, "path": self.checkpoint, "target": target,
                        "options": dataclasses.asdict(self.opts(engine or "auto"))}
                result = self.fresh.run(spec)
                return result["seconds"], result["phases"]
            label = mechanism + (" (ceiling)" if mechanism.startswith("raw") else "")
            return Mechanism(Series(operation, label, engine or "-", role=roles[mechanism]), measure,
                             prepare=lambda: common.remove(target), cleanup=lambda: common.remove(target))

        roles = {"torch.save + fsync": "vanilla", "fastpersist.save": "fastpersist",
                 "raw engine write, from scratch": "ceiling"}
        out.append(in_fresh_process("torch.save + fsync", None, "fresh-torch.pt"))
        for engine in self.engines:
            out.append(in_fresh_process("fastpersist.save", engine, f"fresh-fastpersist-{engine}.pt"))
            out.append(in_fresh_process("raw engine write, from scratch", engine, f"fresh-raw-{engine}.bin"))
        return out

    # -- the rounds ----------------------------------------------------------
    def run(self) -> list:
        mechanisms = (self.save_mechanisms() + self.fresh_process_saves() + self.fresh_process_loads()
                      + self.warm_fresh_process_loads() + self.same_process_loads())
        with common.progress(len(mechanisms) * self.args.repeats + 1, "fastpersist bench") as bar:
            self.prepare(bar)
            bar.update()
            for m in mechanisms:
                m.series.nbytes = self.file_size
            for round_index in range(self.args.repeats):
                for m in common.round_order(mechanisms, round_index):
                    bar.set_postfix_str(f"round {round_index + 1}: {m.series.operation}: {m.series.mechanism}"
                                        + (f" [{m.series.engine}]" if m.series.engine != "-" else ""))
                    m.prepare()
                    seconds, phases = m.measure()
                    m.cleanup()
                    m.series.add(seconds, phases)
                    bar.update()
        self.series = [m.series for m in mechanisms]
        return self.series


# ---------------------------------------------------------------------------
# the report


def _references(series: list) -> tuple:
    """{operation: vanilla series}, {(operation, engine): ceiling series}; a save
    over an existing file compares with the raw write to a new one."""
    vanilla = {s.operation: s for s in series if s.role == "vanilla"}
    ceiling = {(s.operation, s.engine): s for s in series if s.role == "ceiling"}
    for (operation, engine), s in list(ceiling.items()):
        if operation == "save, new file":
            ceiling[("save, over existing", engine)] = s
    return vanilla, ceiling


def result_rows(series: list, engines: list) -> list:
    vanilla, ceiling = _references(series)
    rows = []
    for s in series:
        engine = s.engine if s.engine != "-" else engines[0]
        reference = ceiling.get((s.operation, engine)) or ceiling.get((s.operation, "-"))  # one for every engine
        row = common.series_row(s, common.ratio(vanilla.get(s.operation), s), common.ratio(reference, s))
        interval = common.ratio_interval(reference, s) if reference is not s else None
        row["x_ceiling_low"], row["x_ceiling_high"], row["x_ceiling_coverage"] = interval or (None, None, None)
        rows.append(row)
    return rows


def report_lines(rows: list) -> list:
    body = [(r["operation"], r["mechanism"], r["engine"], f"{r['median_s']:.3f}", _spread(r), fmt(r["gb_per_s"]),
             fmt(r["gib_per_s"]), fmt(r["x_vanilla"]), fmt(r["x_ceiling"]),
             common.phases_text(r["phases_s"])) for r in rows]
    return common.table(["operation", "mechanism", "engine", "median s", "spread", "GB/s", "GiB/s", "x vanilla",
                         "x ceiling", "where the time went (median s)"], body, right=range(3, 9))


def _spread(row: dict) -> str:
    """How far apart the rounds were: (slowest - fastest) / median. Ratios
    between rows that differ by less than their spreads are not findings."""
    return f"{(row['max_s'] - row['min_s']) / row['median_s'] * 100:.0f}%" if row["median_s"] else "-"


def headline_lines(rows: list) -> list:
    """One line per fastpersist row: its ratios, and how sure this run is of
    the one to the ceiling (a figure inside the interval, a target say, is
    one this run cannot tell apart from the result)."""
    lines = []
    for r in rows:
        if r["role_fastpersist"] and r["x_vanilla"] is not None:
            ceiling = f", {r['x_ceiling']:.2f}x the raw engine's speed" if r["x_ceiling"] is not None else ""
            if ceiling and r.get("x_ceiling_low") is not None:
                ceiling += (f" ({r['x_ceiling_low']:.2f}-{r['x_ceiling_high']:.2f} with "
                            f"{r['x_ceiling_coverage'] * 100:.0f}% confidence)")
            lines.append(f"  {r['operation']}: {r['mechanism']} [{r['engine']}] {r['x_vanilla']:.2f}x as fast "
                         f"as {'torch.save + fsync' if r['operation'].startswith('save') else 'torch.load'}"
                         f"{ceiling}")
    return lines


CSV_COLUMNS = ["operation", "mechanism", "engine", "bytes", "rounds", "median_s", "min_s", "max_s", "gb_per_s",
               "gib_per_s", "x_vanilla", "x_ceiling", "x_ceiling_low", "x_ceiling_high", "x_ceiling_coverage",
               "phases_s", "times_s"]


def run(args) -> int:
    common.require("tqdm")
    common.check_output_paths(args.json, args.csv)
    started = time.perf_counter()
    bench = DefaultBench(args)
    common.notice(f"fastpersist bench: about {args.size:g} GB, {common.plural(args.repeats, 'round')}, engines "
                  f"{', '.join(bench.engines)}, in {bench.workspace.path} (removed afterwards)")
    available = common.memory_available()
    if available is not None and available < 4 * args.size * GB:
        # the model, a loaded copy, the raw read's buffer and a fresh process's copy
        common.notice(f"fastpersist bench: warning: {available / GB:.1f} GB of memory available; this run holds up "
                      f"to ~{4 * args.size:.1f} GB at once")
    try:
        machine = common.machine_info(bench.workspace.path)
        series = bench.run()
        rows = result_rows(series, bench.engines)
        for row, s in zip(rows, series):
            row["role_fastpersist"] = s.role == "fastpersist"
    finally:
        bench.close()
    wall = time.perf_counter() - started

    config = bench.config
    model = {"layout": bench.base_name, "arch": config.arch, "hidden": config.hidden, "layers": config.layers,
             "layers_of_base": bench.base_layers, "note": config.note, "dtype": args.dtype,
             "tensors": bench.tensor_count, "tensor_bytes": sum(s.nbytes() for s in bench.storages),
             "file_bytes": bench.file_size, "build_s": bench.build_seconds}
    method = (f"{args.repeats} round{'s' if args.repeats > 1 else ''}; each runs every mechanism once, round 1 in "
              "a fixed order, later rounds shuffled; medians; spread: (slowest - fastest round) / median. Saves "
              "include fsync; loads touch every byte they return and start from a dropped page cache. Fresh "
              "process: a new process per load, forked from a server that has imported only torch and "
              "fastpersist (the import is not timed). Same process: loads one after another in this "
              "process (engine buffers reused). x vanilla: torch's time / this time; x ceiling: the raw engine's "
              "time / this time (1.00 = as fast as the engine with no format; in a fresh process it starts its "
              "engine and reads into memory mapped there, in the same process its engine and memory are ready; a "
              "save over an existing file compares with the raw write to a new one); both ratios are medians over "
              "rounds of the two times in the same round; the interval after a ratio to the ceiling holds the "
              "median of those per-round ratios with the confidence given (order statistics, no assumption "
              "about their distribution). GB = 1e9 bytes, GiB = 2^30.")
    echo(f"fastpersist bench: save and load a {bench.file_size / GB:.2f} GB checkpoint: "
         f"{bench.base_name} layout, {common.plural(config.layers, 'layer')}"
         + (f" (it has {bench.base_layers})" if config.layers != bench.base_layers else "")
         + f", hidden {config.hidden}, {bench.tensor_count} tensors, {args.dtype}, random weights "
         f"(built in {bench.build_seconds:.1f} s)")
    for line in common.machine_lines(machine):
        echo(line)
    echo(f"engines: {', '.join(bench.engines)} -- {bench.engine_choice}; options "
         f"{common.options_text(bench.options.replace(engine=bench.engines[0]))}")
    echo(f"page cache: {bench.dropper.describe()}")
    echo(f"method: {method}")
    echo()
    for line in report_lines(rows):
        echo(line)
    echo()
    headline = headline_lines(rows)
    if headline:
        echo("fastpersist against vanilla torch and the raw engine:")
        for line in headline:
            echo(line)
    echo(f"wall time {wall:.0f} s")

    for row in rows:
        row.pop("role_fastpersist", None)
    if args.json:
        common.write_json(args.json, {
            "benchmark": "fastpersist bench", "machine": machine,
            "settings": {"size_gb": args.size, "repeats": args.repeats, "engines": bench.engines,
                         "engine_choice": bench.engine_choice, "options": dataclasses.asdict(bench.options),
                         "cache_drop": args.cache_drop, "ram_device_gb": getattr(args, "ram_device", None)},
            "model": model, "page_cache": bench.dropper.as_dict(), "method": method, "wall_s": wall,
            "results": rows})
        echo(f"wrote {args.json}")
    if args.csv:
        common.write_csv(args.csv, rows, CSV_COLUMNS)
        echo(f"wrote {args.csv}")
    return 0
