"""The runner of the micro-benchmark scripts in benchmarks/ (after the
FastPersist micro-benchmarks): run mechanisms interleaved, report medians.
Built on fastpersist.bench.common, the harness `fastpersist bench` uses.

Every mechanism runs once per round, in the same process and order, so
machine noise hits them alike; the line printed per mechanism is the median
round, in the FastPersist micro-benchmarks' format:
``NAME -- X.XX GB, Y.YY secs, Z.ZZ GB/s`` (GB = 10^9 bytes).
"""
from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from typing import Callable

from .common import BenchError, evict_from_page_cache, raw_read, resolve_engines, touch_all


def common_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--folder", default=None,
                        help="where checkpoints are written (default: a temporary folder under /var/tmp)")
    parser.add_argument("--repeats", type=int, default=3, help="rounds; the median is reported")
    parser.add_argument("--engines", default="available",
                        help="comma-separated fastpersist engines, or 'available' for every usable one")
    parser.add_argument("--no-vanilla", action="store_true", help="skip vanilla torch.save")


def _clear_peak_rss() -> None:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # resets VmHWM to the current RSS
    except OSError:
        pass


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    return 0


class Runner:
    def __init__(self, folder: str | None):
        self._tmp = None
        if folder is None:
            self._tmp = tempfile.TemporaryDirectory(prefix="fastpersist-bench-", dir="/var/tmp")
            folder = self._tmp.name
        os.makedirs(folder, exist_ok=True)
        self.folder = folder
        self.results: dict[str, list[float]] = {}
        self.extra_rss: dict[str, list[int]] = {}
        self.nbytes: dict[str, int] = {}

    def path(self, name: str) -> str:
        return os.path.join(self.folder, name.replace("[", "_").replace("]", "") + ".pt")

    def run(self, name: str, fn: Callable[[str], int]) -> None:
        """fn(path) writes path and returns bytes written; timed with its fsync."""
        path = self.path(name)
        if os.path.exists(path):
            os.unlink(path)
        _clear_peak_rss()
        rss = _status_kib("VmRSS")
        start = time.perf_counter()
        nbytes = fn(path)
        seconds = time.perf_counter() - start
        self.extra_rss.setdefault(name, []).append(max(0, _status_kib("VmHWM") - rss) * 1024)
        self.results.setdefault(name, []).append(seconds)
        self.nbytes[name] = nbytes
        os.unlink(path)

    def time(self, name: str, fn: Callable[[], int]) -> None:
        """fn() does the work and returns the bytes it moved; timed as a whole."""
        _clear_peak_rss()
        rss = _status_kib("VmRSS")
        start = time.perf_counter()
        nbytes = fn()
        seconds = time.perf_counter() - start
        self.extra_rss.setdefault(name, []).append(max(0, _status_kib("VmHWM") - rss) * 1024)
        self.results.setdefault(name, []).append(seconds)
        self.nbytes[name] = nbytes

    def report(self) -> None:
        for name, times in self.results.items():
            secs = statistics.median(times)
            gb = self.nbytes[name] / 1e9
            extra = statistics.median(self.extra_rss[name]) / 2**20
            print(f"{name} -- {gb:.2f} GB, {secs:.2f} secs, {gb / secs:.2f} GB/s"
                  f"   (rounds {', '.join(f'{t:.2f}' for t in times)}; extra RSS {extra:.0f} MiB)", flush=True)

    def close(self) -> None:
        if self._tmp is not None:
            self._tmp.cleanup()


def run_rounds(runner: Runner, obj, source, engines: list[str], repeats: int, vanilla: bool = True) -> None:
    """The rounds every save benchmark runs, then the report: vanilla
    torch.save, then per engine fastpersist.save and the raw engine writing
    as many bytes as that save's file (repeating ``source``)."""
    try:
        for _ in range(repeats):
            if vanilla:
                runner.run("test_save", vanilla_save(obj))
            for engine in engines:
                name = f"fastpersist_save[{engine}]"
                runner.run(name, fastpersist_save(obj, engine))
                runner.run(f"raw_engine_write[{engine}]", raw_engine_write(source, runner.nbytes[name], engine))
        runner.report()
    finally:
        runner.close()


def usable_engines(selection: str) -> list[str]:
    """--engines: 'available' (every engine that starts here) or a list."""
    from fastpersist.options import Options

    try:
        engines, _ = resolve_engines("all" if selection == "available" else selection, Options())
    except BenchError as exc:
        raise SystemExit(f"# {exc}") from None
    return engines


def vanilla_save(obj) -> Callable[[str], int]:
    """torch.save as shipped, plus the fsync that makes it comparable."""
    import fastpersist.patching
    original = fastpersist.patching.original_save()

    def run(path: str) -> int:
        original(obj, path)
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        return os.path.getsize(path)
    return run


def fastpersist_save(obj, engine: str) -> Callable[[str], int]:
    import fastpersist

    def run(path: str) -> int:
        fastpersist.save(obj, path, engine=engine)
        return os.path.getsize(path)
    return run


def raw_engine_write(source, nbytes: int, engine: str) -> Callable[[str], int]:
    """The ceiling: the engine writing nbytes from memory already touched,
    fsync included, with no format and no CRC."""
    from fastpersist import FastFileWriter

    address = source.data_ptr()
    span = source.untyped_storage().nbytes()

    def run(path: str) -> int:
        with FastFileWriter(path, exclusive=True, sole_writer=True, engine=engine) as w:
            left = nbytes
            while left:
                n = min(left, span)
                w.write_address(address, n)
                left -= n
        return nbytes
    return run


# ---------------------------------------------------------------------------
# load benchmarks


def run_load_rounds(runner: Runner, path: str, target, engines: list[str], repeats: int,
                    vanilla: bool = True, device: str = "cpu") -> None:
    """The rounds every load benchmark runs, then the report, each from a cold
    page cache and with every byte of the result touched: vanilla torch.load,
    torch.load(mmap=True), then per engine fastpersist.load, load_into
    ``target`` (existing, already touched tensors) and the raw engine reading
    the file into an already touched buffer. device: where the loads put the
    tensors (map_location; a CUDA device's timings wait for it)."""
    import gc
    import mmap

    import fastpersist
    import torch
    from fastpersist.options import Options
    from fastpersist.patching import original_load

    size = os.path.getsize(path)
    raw = mmap.mmap(-1, -(-size // 4096) * 4096)
    raw_tensor = torch.frombuffer(raw, dtype=torch.uint8)
    raw_tensor.fill_(1)  # touched once, like a model that already exists
    raw_floats = torch.frombuffer(raw, dtype=torch.float32, count=size // 4)

    results = []  # what a load returned: freed after the timing, as a job would keep it

    def timed(name, fn):
        evict_from_page_cache(path)
        runner.time(name, fn)
        results.clear()
        gc.collect()

    on_gpu = torch.device(device).type == "cuda"
    where = {"map_location": device} if on_gpu else {}

    def settled():
        if on_gpu:
            torch.cuda.synchronize(device)

    def load_with(loader, **kwargs):
        def run():
            results.append(loader(path, **where, **kwargs))
            touch_all(results[-1])
            settled()
            return size
        return run

    def load_into(engine):
        def run():
            fastpersist.load_into(target, path, engine=engine)
            touch_all(target)
            settled()
            return size
        return run

    def raw_engine_read(engine):
        def run():
            raw_read(path, raw_tensor.data_ptr(), size, Options(engine=engine))
            raw_floats.sum()
            return size
        return run

    try:
        for _ in range(repeats):
            if vanilla:
                timed("torch_load", load_with(original_load(), weights_only=True))
            timed("torch_load_mmap", load_with(original_load(), weights_only=True, mmap=True))
            for engine in engines:
                fastpersist.patch(engine=engine)
                timed(f"fastpersist_load[{engine}]", load_with(fastpersist.load, weights_only=True))
                fastpersist.unpatch()
                timed(f"fastpersist_load_into[{engine}]", load_into(engine))
                timed(f"raw_engine_read[{engine}]", raw_engine_read(engine))
        runner.report()
    finally:
        runner.close()
