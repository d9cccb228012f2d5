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
- load to the GPU, from each source (``--regimes``): the disk (cold: the
  files dropped from the page cache first), the page cache (warm) and tmpfs
  (copies in /dev/shm): ``torch.load(map_location=device)``,
  ``fastpersist.load`` and ``fastpersist.load_into`` the model that exists on
  the device; a safetensors file of the same tensors through safetensors'
  ``load_file(device=...)`` and fastpersist's; the peers where importable
  (fastsafetensors without GDS, which reads with O_DIRECT on ext4 by its
  own default even where the file is cached, InstantTensor,
  runai-model-streamer to the CPU then ``.to(device)``, as vLLM uses it),
  each load's tensors checked
  equal to the state once. The ceiling of each source: the raw engine
  reading the file into host memory (cold), ``read_threads`` threads
  pread-ing it into page-locked memory (warm, tmpfs); beside them, one
  page-locked host-to-device copy of the state;
- with GPUDirect Storage where cuFile's driver opens here (native, or its
  compatibility mode, which the row names): ``fastpersist.save``,
  ``fastpersist.load`` and ``load_into`` with ``transfer="gds"``. Where it
  cannot open, the report says why instead of the rows.

Every load waits for the device (torch.cuda.synchronize); every save
includes its fsync. Peak host
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


REGIMES = ("cold", "warm", "tmpfs")
# peers loading a safetensors file to a GPU: label -> the module that must be importable
PEERS = {"fastsafetensors (nogds)": "fastsafetensors", "InstantTensor": "instanttensor",
         "runai-model-streamer (to the CPU, then .to(device))": "runai_model_streamer"}


def _import_error(module: str) -> Optional[str]:
    """Why module does not import here, or None where it does."""
    import importlib

    try:
        importlib.import_module(module)
    except Exception as exc:  # noqa: BLE001 - a peer that cannot load is reported, not fatal
        return "not installed" if isinstance(exc, ModuleNotFoundError) and exc.name == module else \
            common.format_exception(exc)
    return None


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
        self.regimes = [r for r in REGIMES if r in args.regimes]
        self.shm: Optional[str] = None
        self.skipped: dict = {}  # regime or peer -> why it was not measured

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
        if self.shm is not None:
            import shutil

            shutil.rmtree(self.shm, ignore_errors=True)

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
        # the same tensors in a safetensors file (each storage once: safetensors refuses shared ones)
        self.st_names, seen = {}, set()
        for name, tensor in self.state.items():
            if tensor.untyped_storage().data_ptr() not in seen:
                seen.add(tensor.untyped_storage().data_ptr())
                self.st_names[name] = tensor
        self.st_checkpoint = self.workspace.file("checkpoint.safetensors")
        from fastpersist import safetensors as fst

        fst.save_file(self.st_names, self.st_checkpoint)
        common.fsync_path(self.st_checkpoint)
        self.st_size = os.path.getsize(self.st_checkpoint)
        # the ceiling of a cached source: page-locked host memory, touched
        self.pinned_target = torch.empty(max(self.file_size, self.st_size), dtype=torch.uint8, pin_memory=pin)
        self.pinned_target.fill_(1)
        self.device_bytes = torch.empty(self.nbytes, dtype=torch.uint8, device=self.device)
        self.files = {r: (self.checkpoint, self.st_checkpoint) for r in ("cold", "warm")}
        if "tmpfs" in self.regimes:
            self._copy_to_tmpfs()
        self.sync()

    def _copy_to_tmpfs(self) -> None:
        import shutil
        import tempfile

        needs = self.file_size + self.st_size + (256 << 20)
        if not os.path.isdir("/dev/shm") or shutil.disk_usage("/dev/shm").free < needs:
            self.skipped["tmpfs"] = f"/dev/shm is missing or has less than {needs / GB:.1f} GB free"
            self.regimes.remove("tmpfs")
            return
        self.shm = tempfile.mkdtemp(prefix=".fastpersist-bench-", dir="/dev/shm")
        copies = []
        for path in (self.checkpoint, self.st_checkpoint):
            copies.append(os.path.join(self.shm, os.path.basename(path)))
            shutil.copyfile(path, copies[-1])
        self.files["tmpfs"] = tuple(copies)

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

    def fastpersist_save_without_crc(self, path: str) -> float:
        """fastpersist.save with torch's compute_crc32 off: what the CRC-32 of
        every record costs the save (its implementation: `fastpersist info`)."""
        from torch.utils.serialization import config

        was = config.save.compute_crc32
        config.save.compute_crc32 = False
        try:
            return self.fastpersist_save(path)
        finally:
            config.save.compute_crc32 = was

    def safetensors_save(self, path: str) -> float:
        """fastpersist.safetensors.save_file of the same tensors (a format
        with no CRC), + fsync as every save here."""
        from fastpersist import safetensors as fst

        start = time.perf_counter()
        fst.save_file(self.st_names, path, **dataclasses.asdict(self.options))
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

    def vanilla_load(self, path: Optional[str] = None) -> float:
        from fastpersist.patching import original_load

        return self._timed(lambda: original_load()(path or self.checkpoint, map_location=self.device,
                                                   weights_only=True))

    def fastpersist_load(self, path: Optional[str] = None, **extra) -> float:
        import fastpersist

        with common.options_for_load(self.options.replace(**extra)):  # fastpersist.load takes torch.load's arguments
            return self._timed(lambda: fastpersist.load(path or self.checkpoint, map_location=self.device,
                                                        weights_only=True))

    def _timed(self, load: Callable) -> float:
        """Seconds of load() and the device's work; its result kept in
        self.loaded (checked by the caller, then freed, outside the timing)."""
        start = time.perf_counter()
        loaded = load()
        self.sync()
        seconds = time.perf_counter() - start
        self.loaded = loaded
        return seconds

    def load_into(self, path: Optional[str] = None, **extra) -> float:
        import fastpersist

        start = time.perf_counter()
        fastpersist.load_into(self.state, path or self.checkpoint, **{**dataclasses.asdict(self.options), **extra})
        self.sync()
        return time.perf_counter() - start

    def stock_load_file(self, path: str) -> float:
        load_file = _stock_load_file()
        return self._timed(lambda: load_file(path, device=str(self.device)))

    def fastpersist_load_file(self, path: str) -> float:
        from fastpersist import safetensors as fst

        with common.options_for_load(self.options):
            return self._timed(lambda: fst.load_file(path, device=str(self.device)))

    def peer_load(self, label: str, path: str) -> float:
        device = str(self.device)

        def load():
            if label.startswith("fastsafetensors"):
                from fastsafetensors import fastsafe_open

                with fastsafe_open(filenames=[path], nogds=True, device=device) as f:
                    return {k: f.get_tensor(k).clone() for k in f.keys()}  # its tensors view its buffer
            if label == "InstantTensor":
                import instanttensor

                index = self.device.index or 0 if self.device.type == "cuda" else device
                with instanttensor.safe_open([path], framework="pt", device=index, copy=True) as f:
                    return dict(f.tensors())
            from runai_model_streamer import SafetensorsStreamer

            with SafetensorsStreamer() as streamer:
                streamer.stream_files([path], device="cpu")
                return {k: t.to(device) for k, t in streamer.get_tensors()}

        return self._timed(load)

    def raw_read(self) -> float:
        start = time.perf_counter()
        got = common.raw_read(self.checkpoint, self.raw_target.data_ptr(), self.file_size, self.options)
        seconds = time.perf_counter() - start
        if got != self.file_size:
            raise BenchError(f"the raw read got {got} of {self.file_size} bytes")
        return seconds

    def parallel_read_to_pinned(self, path: str) -> float:
        """The ceiling of a cached source: read_threads threads pread the
        file into page-locked host memory (no device copy, no format)."""
        from fastpersist import read_pipeline

        size = os.path.getsize(path)
        threads = read_pipeline.read_threads(self.options)
        fd = os.open(path, os.O_RDONLY)
        try:
            start = time.perf_counter()
            read_pipeline.pread_extents(fd, path, [(self.pinned_target.data_ptr(), 0, size)], False, threads=threads)
            return time.perf_counter() - start
        finally:
            os.close(fd)

    def host_to_device(self) -> float:
        """One page-locked host-to-device copy of the state's bytes."""
        self.sync()
        start = time.perf_counter()
        self.device_bytes.copy_(self.pinned_target[:self.nbytes], non_blocking=True)
        self.sync()
        return time.perf_counter() - start

    def check(self, label: str) -> None:
        """The last load's tensors equal the state's (by name), on the device."""
        torch = self.torch
        loaded = getattr(self, "loaded", None)
        self.loaded = None
        if loaded is None:
            return
        for name, expected in (self.st_names if len(loaded) == len(self.st_names) else self.state).items():
            got = loaded.get(name)
            on_device = got is not None and got.device.type == self.device.type and (
                self.device.index is None or got.device.index == self.device.index)  # "cuda" is cuda:N
            if not on_device or got.dtype != expected.dtype or not torch.equal(got, expected):
                raise BenchError(f"{label}: tensor {name!r} differs from the state saved "
                                 f"({'missing' if got is None else f'{got.device} {got.dtype}'})")

    def mechanisms(self) -> list:
        """(series, measure() -> seconds or (seconds, extra), before: None or what runs first, untimed)."""
        ws = self.workspace

        def to_new_file(fn: Callable) -> Callable:
            def measure():
                path = ws.file("new.pt")
                try:
                    return fn(path)
                finally:
                    common.remove(path)
            return measure

        save = "save from the device"
        gds_rows = []
        load = "load to the device, cold (from the disk)"
        drop = lambda: self.dropper.drop(self.checkpoint)  # noqa: E731
        if self.gds_mode:
            gds = dict(transfer="gds", allow_gds_compat=True)
            mode = f"transfer=gds, {self.gds_mode.split(' (')[0]}"
            gds_rows = [
                (Series(save, f"fastpersist.save ({mode})", role="gds"),
                 to_new_file(lambda path: self.fastpersist_save(path, **gds)), None),
                (Series(load, f"fastpersist.load ({mode})", role="gds"),
                 lambda: self.fastpersist_load(**gds), drop),
                (Series(load, f"fastpersist.load_into ({mode})", role="gds"), lambda: self.load_into(**gds), drop),
            ]
        return [
            (Series(save, "torch.save + fsync", role="vanilla"), to_new_file(self.vanilla_save), None),
            (Series(save, "fastpersist.save", role="fastpersist"), to_new_file(self.fastpersist_save), None),
            (Series(save, "fastpersist.save, CRC-32 off (torch's compute_crc32=False)", role="other"),
             to_new_file(self.fastpersist_save_without_crc), None),
            (Series(save, "fastpersist.safetensors save_file (no CRC in the format)", role="other"),
             to_new_file(self.safetensors_save), None),
            (Series(save, "raw engine write from host memory (ceiling)", role="ceiling"),
             to_new_file(self.raw_write), None),
            (Series("save_async: caller blocked", "fastpersist.save_async", role="fastpersist"),
             to_new_file(self.save_async_stall), None),
            (Series("save_async: caller blocked", "one device-to-host copy_ of the state", role="vanilla"),
             self.one_copy, None),
            (Series("page-locked host-to-device copy", "one copy_ of the state's bytes", role="ceiling"),
             self.host_to_device, None),
        ] + self.load_mechanisms() + gds_rows

    def load_mechanisms(self) -> list:
        """(series, measure, before) of the loads, regime by regime; before:
        what makes the files' source the regime's (drop or warm)."""
        entries = []
        for regime in self.regimes:
            pt, st = self.files[regime]
            op = f"load to the device, {regime}" + {"cold": " (from the disk)", "warm": " (page cache)",
                                                     "tmpfs": " (/dev/shm)"}[regime]
            rows = [
                (Series(op, "torch.load(map_location=device)", role="vanilla"), lambda pt=pt: self.vanilla_load(pt)),
                (Series(op, "fastpersist.load(map_location=device)", role="fastpersist"),
                 lambda pt=pt: self.fastpersist_load(pt)),
                (Series(op, "fastpersist.load_into (model on the device)", role="fastpersist"),
                 lambda pt=pt: self.load_into(pt)),
                (Series(op, "safetensors load_file(device=...)", role="other"),
                 lambda st=st: self.stock_load_file(st)),
                (Series(op, "fastpersist.safetensors load_file(device=...)", role="fastpersist"),
                 lambda st=st: self.fastpersist_load_file(st)),
            ]
            for label, module in PEERS.items():
                why = "no CUDA device" if self.device.type != "cuda" else _import_error(module)
                if why is None:
                    rows.append((Series(op, label, role="other"), lambda label=label, st=st: self.peer_load(label, st)))
                else:
                    self.skipped[label] = f"{module}: {why}"
            if regime == "cold":
                rows.append((Series(op, "raw engine read to host memory (ceiling)", role="ceiling"), self.raw_read))
            else:
                rows.append((Series(op, "parallel pread into page-locked memory (ceiling)", role="ceiling"),
                             lambda pt=pt: self.parallel_read_to_pinned(pt)))
            for series, measure in rows:
                series.nbytes = self.st_size if "load_file" in series.mechanism or series.mechanism in PEERS \
                    else self.file_size
                paths = (pt, st)
                before = (lambda paths=paths: [self.dropper.drop(p) for p in paths]) if regime == "cold" else \
                    (lambda paths=paths: [common.warm(p) for p in paths if (common.cached_fraction(p) or 0) < 0.99]) \
                    if regime == "warm" else None
                entries.append((series, measure, before))
        return entries

    def run(self) -> list:
        self.prepare()
        entries = self.mechanisms()
        for s, _, _ in entries:
            s.nbytes = s.nbytes or self.file_size
            s.extra["peak_host_mib"] = []
        failed: set = set()  # peers that raised: reported, not measured again
        for round_index in range(self.args.repeats):
            for s, measure, before in common.round_order(entries, round_index):
                if s.mechanism in failed:
                    continue
                if before is not None:
                    before()
                rss = _vm_kib("VmRSS")
                _reset_peak()
                try:
                    got = measure()
                    peak = _vm_kib("VmHWM")
                    if round_index == 0:
                        self.check(f"{s.operation}: {s.mechanism}")
                except Exception as exc:  # noqa: BLE001 - a peer's failure is its row's, not the run's
                    if s.mechanism not in PEERS:
                        raise
                    failed.add(s.mechanism)
                    self.skipped[s.mechanism] = f"raised or differed: {common.format_exception(exc)}"
                    self.loaded = None
                    continue
                seconds, extra = got if isinstance(got, tuple) else (got, {})
                self.loaded = None
                # a line per measurement as it is made: a run cut short by a time limit still says what it saw
                common.notice(f"round {round_index + 1}: {s.operation}: {s.mechanism}: {seconds:.3f} s")
                s.add(seconds, extra)
                if self.peak_measurable and rss is not None and peak is not None:
                    s.extra["peak_host_mib"].append(max(0, peak - rss) / 1024)
        return [s for s, _, _ in entries if s.mechanism not in failed]


def _stock_load_file():
    """safetensors' load_file, whether or not fastpersist has patched
    safetensors: its body (safe_open, get_tensor of every name) over
    safetensors' own safe_open (the original load_file looks safe_open up
    where the patch rebinds it)."""
    import safetensors

    safe_open = getattr(safetensors, "_fastpersist_original_safe_open", safetensors.safe_open)

    def load_file(path: str, device: str = "cpu") -> dict:
        with safe_open(path, framework="pt", device=device) as f:
            return {k: f.get_tensor(k) for k in f.keys()}

    return load_file


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
    for what, why in bench.skipped.items():
        echo(f"not measured: {what} ({why})")
    echo(f"wall time {time.perf_counter() - started:.0f} s")
    if args.json:
        common.write_json(args.json, {"benchmark": "fastpersist bench gpu", "machine": machine,
                                      "device": device_text, "buffers_bytes": buffers,
                                      "gds": {"mode": bench.gds_mode, "why_not": bench.gds_why,
                                              "stats": gds_stats},
                                      "not_measured": bench.skipped,
                                      "settings": {"size_gb": args.size, "repeats": args.repeats,
                                                   "regimes": bench.regimes,
                                                   "dtype": args.dtype, "device": str(bench.device),
                                                   "ram_device_gb": getattr(args, "ram_device", None)},
                                      "results": rows})
        echo(f"wrote {args.json}")
    return 0
