"""``fastpersist bench gpu``: saving a model's state that lives on a GPU and
loading it back to the GPU, against vanilla torch and the raw engine, with
the host memory each mechanism takes at its peak.

Measured, each in every round, in an order shuffled from round to round:

- save to a new file: ``torch.save`` + fsync (torch copies every storage to
  fresh host memory first), ``fastpersist.save`` (storages stream through the
  engine's registered buffers), and the ceiling, the raw engine writing the
  same bytes from page-locked host memory (no device copy, no format);
- ``save_async``: the time the caller is blocked (its snapshot), beside one
  device-to-host ``copy_`` of the whole state into page-locked memory
  already allocated; the save's durable time is reported too;
- load to the GPU: ``torch.load(map_location=device)``, ``fastpersist.load``
  (storages allocated on the device, filled from the engine's buffers), and
  ``fastpersist.load_into`` the model that exists on the device, beside the
  ceiling, the raw engine reading the file into host memory;
- with GPUDirect Storage where cuFile's driver opens here (native, or its
  compatibility mode, which the row names): ``fastpersist.save``,
  ``fastpersist.load`` and ``load_into`` with ``transfer="gds"``. Where it
  cannot open, the report says why instead of the rows.

Every load waits for the device (torch.cuda.synchronize) and starts with the
file dropped from the page cache; every save includes its fsync. Peak host
memory: the growth of the process's resident high-water mark (VmHWM, reset
before each mechanism through /proc/self/clear_refs) over its resident size
before.

``--device cpu`` runs the same mechanisms on the CPU: a check that the
benchmark works where no GPU is, whose numbers say nothing about a GPU (the
report says so).
"""
from __future__ import annotations

import dataclasses
import os
import time
from typing import Callable, Optional

from . import common
from .common import GB, MiB, BenchError, Series, echo, fmt


def _vm_kib(field: str) -> Optional[int]:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1])
    except OSError:
        pass
    return None


def _reset_peak() -> bool:
    """Resets VmHWM to the current resident size (Linux 4.0+)."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


class GpuBench:
    def __init__(self, args):
        import torch

        from .default import sized_model
        from . import models

        self.args, self.torch = args, torch
        self.device = torch.device(args.device)
        if self.device.type == "cuda" and not torch.cuda.is_available():
            raise BenchError("no CUDA device is available here (torch.cuda.is_available() is False); "
                             "`--device cpu` checks that the benchmark runs, without measuring a GPU")
        self.dtype = getattr(torch, args.dtype)
        self.options = common.bench_options(transfer="bounce")  # the GDS rows say transfer="gds" themselves
        self.config, self.base_name, _ = sized_model(int(args.size * GB), self.dtype)
        nbytes = models.param_bytes(self.config, self.dtype)
        self.workspace = common.Workspace(args.folder, int(nbytes * 3 * 1.05) + (64 << 20))
        self.dropper = common.CacheDropper(args.cache_drop)
        self.checkpoint = self.workspace.file("checkpoint.pt")
        self.peak_measurable = _reset_peak()
        self.gds_mode, self.gds_why = self._gds_here()

    def _gds_here(self) -> tuple:
        """(cuFile's mode, None) where transfer="gds" runs here, else (None, why not)."""
        if self.device.type != "cuda":
            return None, "no CUDA device"
        from fastpersist import cufile, gds

        try:
            cufile.transfer_for("gds", allow_compat=True)
        except cufile.GdsUnavailable as exc:
            return None, str(exc)
        gds.reset_stats()
        return cufile.driver_mode(), None

    def close(self) -> None:
        self.workspace.close()

    def sync(self) -> None:
        if self.device.type == "cuda":
            self.torch.cuda.synchronize(self.device)

    def prepare(self) -> None:
        from fastpersist.patching import original_save
        from . import models

        torch = self.torch
        model = models.build(self.config, self.dtype, device=self.device)  # random weights, made on the device
        self.state = model.state_dict()
        del model
        self.storages = common.distinct_storages(self.state)
        self.nbytes = sum(s.nbytes() for s in self.storages)
        pin = self.device.type == "cuda"
        # the raw write's source and the snapshot copy's target: host memory, page-locked on a GPU machine
        self.host = [torch.empty(s.nbytes(), dtype=torch.uint8, pin_memory=pin) for s in self.storages]
        for h, s in zip(self.host, self.storages):
            h.copy_(torch.empty(0, dtype=torch.uint8, device=s.device).set_(s))
        original_save()(self.state, self.checkpoint)
        common.fsync_path(self.checkpoint)
        self.file_size = os.path.getsize(self.checkpoint)
        self.raw_target = torch.empty(self.file_size, dtype=torch.uint8)
        self.raw_target.fill_(1)  # touched: the ceiling reads into memory that exists
        self.sync()

    # -- mechanisms: each returns seconds (and extra numbers) ---------------
    def vanilla_save(self, path: str) -> float:
        from fastpersist.patching import original_save

        start = time.perf_counter()
        original_save()(self.state, path)
        common.fsync_path(path)
        return time.perf_counter() - start

    def fastpersist_save(self, path: str, **extra) -> float:
        import fastpersist

        start = time.perf_counter()
        fastpersist.save(self.state, path, **{**dataclasses.asdict(self.options), **extra})
        return time.perf_counter() - start

    def raw_write(self, path: str) -> float:
        from fastpersist import FastFileWriter

        start = time.perf_counter()
        with FastFileWriter(path, exclusive=True, sole_writer=True, options=self.options) as writer:
            for h in self.host:
                writer.write_address(h.data_ptr(), h.numel())
            if self.nbytes < self.file_size:
                writer.write_zeros(self.file_size - self.nbytes)
        return time.perf_counter() - start

    def save_async_stall(self, path: str) -> tuple:
        import fastpersist

        start = time.perf_counter()
        handle = fastpersist.save_async(self.state, path, **dataclasses.asdict(self.options))
        blocked = time.perf_counter() - start
        handle.result()
        return blocked, {"durable_s": time.perf_counter() - start}

    def one_copy(self) -> float:
        torch = self.torch
        self.sync()
        start = time.perf_counter()
        for h, s in zip(self.host, self.storages):
            h.copy_(torch.empty(0, dtype=torch.uint8, device=s.device).set_(s), non_blocking=True)
        self.sync()
        return time.perf_counter() - start

    def vanilla_load(self) -> float:
        from fastpersist.patching import original_load

        return self._timed_load(original_load())

    def fastpersist_load(self, **extra) -> float:
        import fastpersist

        with common.options_for_load(self.options.replace(**extra)):  # fastpersist.load takes torch.load's arguments
            return self._timed_load(fastpersist.load)

    def _timed_load(self, load: Callable) -> float:
        start = time.perf_counter()
        loaded = load(self.checkpoint, map_location=self.device, weights_only=True)
        self.sync()
        seconds = time.perf_counter() - start
        del loaded  # freed outside the timing
        return seconds

    def load_into(self, **extra) -> float:
        import fastpersist

        start = time.perf_counter()
        fastpersist.load_into(self.state, self.checkpoint, **{**dataclasses.asdict(self.options), **extra})
        self.sync()
        return time.perf_counter() - start

    def raw_read(self) -> float:
        start = time.perf_counter()
        got = common.raw_read(self.checkpoint, self.raw_target.data_ptr(), self.file_size, self.options)
        seconds = time.perf_counter() - start
        if got != self.file_size:
            raise BenchError(f"the raw read got {got} of {self.file_size} bytes")
        return seconds

    def mechanisms(self) -> list:
        """(series, measure() -> seconds or (seconds, extra), is a load)."""
        ws = self.workspace

        def to_new_file(fn: Callable) -> Callable:
            def measure():
                path = ws.file("new.pt")
                try:
                    return fn(path)
                finally:
                    common.remove(path)
            return measure

        save, load = "save from the device", "load to the device"
        gds_rows = []
        if self.gds_mode:
            gds = dict(transfer="gds", allow_gds_compat=True)
            mode = f"transfer=gds, {self.gds_mode.split(' (')[0]}"
            gds_rows = [
                (Series(save, f"fastpersist.save ({mode})", role="gds"),
                 to_new_file(lambda path: self.fastpersist_save(path, **gds)), False),
                (Series(load, f"fastpersist.load ({mode})", role="gds"),
                 lambda: self.fastpersist_load(**gds), True),
                (Series(load, f"fastpersist.load_into ({mode})", role="gds"), lambda: self.load_into(**gds), True),
            ]
        return [
            (Series(save, "torch.save + fsync", role="vanilla"), to_new_file(self.vanilla_save), False),
            (Series(save, "fastpersist.save", role="fastpersist"), to_new_file(self.fastpersist_save), False),
            (Series(save, "raw engine write from host memory (ceiling)", role="ceiling"),
             to_new_file(self.raw_write), False),
            (Series("save_async: caller blocked", "fastpersist.save_async", role="fastpersist"),
             to_new_file(self.save_async_stall), False),
            (Series("save_async: caller blocked", "one device-to-host copy_ of the state", role="vanilla"),
             self.one_copy, False),
            (Series(load, "torch.load(map_location=device)", role="vanilla"), self.vanilla_load, True),
            (Series(load, "fastpersist.load(map_location=device)", role="fastpersist"), self.fastpersist_load, True),
            (Series(load, "fastpersist.load_into (model on the device)", role="fastpersist"), self.load_into, True),
            (Series(load, "raw engine read to host memory (ceiling)", role="ceiling"), self.raw_read, True),
        ] + gds_rows

    def run(self) -> list:
        self.prepare()
        entries = self.mechanisms()
        for s, _, _ in entries:
            s.nbytes = self.file_size
            s.extra["peak_host_mib"] = []
        for round_index in range(self.args.repeats):
            for s, measure, is_load in common.round_order(entries, round_index):
                if is_load:
                    self.dropper.drop(self.checkpoint)
                rss = _vm_kib("VmRSS")
                _reset_peak()
                got = measure()
                seconds, extra = got if isinstance(got, tuple) else (got, {})
                peak = _vm_kib("VmHWM")
                s.add(seconds, extra)
                if self.peak_measurable and rss is not None and peak is not None:
                    s.extra["peak_host_mib"].append(max(0, peak - rss) / 1024)
        return [s for s, _, _ in entries]


def _by_role(series: list, operation: str, role: str) -> Optional[Series]:
    return next((s for s in series if s.operation == operation and s.role == role), None)


def run(args) -> int:
    common.check_output_paths(args.json)
    started = time.perf_counter()
    bench = GpuBench(args)
    common.notice(f"fastpersist bench gpu: about {args.size:g} GB on {bench.device}, "
                  f"{common.plural(args.repeats, 'round')}, in {bench.workspace.path} (removed afterwards)")
    try:
        machine = common.machine_info(bench.workspace.path)
        series = bench.run()
    finally:
        bench.close()
    torch = bench.torch
    device_text = (f"{torch.cuda.get_device_name(bench.device)} (torch {torch.__version__}, CUDA {torch.version.cuda})"
                   if bench.device.type == "cuda" else "the CPU: NOT a GPU measurement (a check that the "
                   "benchmark runs)")
    buffers = bench.options.buffer_size * bench.options.num_buffers
    echo(f"fastpersist bench gpu: a {bench.file_size / GB:.2f} GB checkpoint ({bench.base_name} layout, "
         f"{common.plural(bench.config.layers, 'layer')}, {args.dtype}, {len(bench.storages)} tensors) on "
         f"{device_text}")
    for line in common.machine_lines(machine):
        echo(line)
    echo(f"engine options {common.options_text(bench.options)}; the engine's buffers: {buffers / MiB:.0f} MiB")
    echo(f"page cache: {bench.dropper.describe()}")
    echo("method: every mechanism once per round, round 1 in a fixed order, later ones shuffled; medians; x ref: "
         "the reference's time / this time in the same round, median over rounds (reference: torch, or for "
         "save_async one device-to-host copy); x ceiling: the raw engine's time / this time. Peak host: "
         "growth of the resident high-water mark during the call, median (MiB)"
         + ("" if bench.peak_measurable else " (not measurable here: /proc/self/clear_refs refused)"))
    echo()
    rows, lines = [], []
    for s in series:
        ref = _by_role(series, s.operation, "vanilla")
        ceiling = _by_role(series, s.operation, "ceiling")
        x_ref = common.ratio(ref, s) if ref is not s else None
        x_ceiling = common.ratio(ceiling, s) if ceiling is not None and ceiling is not s else None
        peaks = s.extra.pop("peak_host_mib")
        peak = sorted(peaks)[len(peaks) // 2] if peaks else None
        durable = s.phases.pop("durable_s", None)
        row = common.series_row(s, x_ref, x_ceiling, peak_host_mib=peak, device=str(bench.device))
        if durable:
            row["durable_median_s"] = sorted(durable)[len(durable) // 2]
        rows.append(row)
        lines.append([s.operation, s.mechanism, f"{s.median:.3f}", f"{s.gb_per_s:.2f}", fmt(x_ref), fmt(x_ceiling),
                      fmt(peak, 0) + ("" if durable is None else f"  (durable {row['durable_median_s']:.3f} s)")])
    for line in common.table(["operation", "mechanism", "median s", "GB/s", "x ref", "x ceiling", "peak host MiB"],
                             lines, right=(2, 3, 4, 5)):
        echo(line)
    from fastpersist import gds

    gds_stats = gds.stats() if bench.gds_mode else None
    if bench.gds_mode:
        echo(f"GPUDirect Storage: cuFile in {bench.gds_mode}; moved {gds_stats['bytes_written'] / GB:.2f} GB "
             f"written, {gds_stats['bytes_read'] / GB:.2f} GB read; files that fell back to the buffers: "
             f"{gds_stats['fallbacks'] or 'none'}; middles at a 4 KiB-aligned device address: "
             f"{gds_stats['device_aligned']} of {gds_stats['device_aligned'] + gds_stats['device_unaligned']}"
             " (native GDS stages the others through cuFile's own buffers)")
    else:
        echo(f"GPUDirect Storage rows: not measured ({bench.gds_why})")
    echo(f"wall time {time.perf_counter() - started:.0f} s")
    if args.json:
        common.write_json(args.json, {"benchmark": "fastpersist bench gpu", "machine": machine,
                                      "device": device_text, "buffers_bytes": buffers,
                                      "gds": {"mode": bench.gds_mode, "why_not": bench.gds_why,
                                              "stats": gds_stats},
                                      "settings": {"size_gb": args.size, "repeats": args.repeats,
                                                   "dtype": args.dtype, "device": str(bench.device),
                                                   "ram_device_gb": getattr(args, "ram_device", None)},
                                      "results": rows})
        echo(f"wrote {args.json}")
    return 0
