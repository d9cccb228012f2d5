"""What every ``fastpersist bench`` command shares: the folder it works in,
dropping the page cache, the machine's description,
interleaved rounds, medians, tables and the CSV and JSON files.

Units: GB = 10^9 bytes, GiB = 2^30 bytes; times are medians of rounds, and
every round runs every mechanism once, in an order shuffled from round to
round so that drifting machine noise, and what one mechanism leaves behind
for the next, hit them alike; ratios pair the times of the same round.
"""
from __future__ import annotations

import contextlib
import csv
import dataclasses
import datetime
import json
import math
import os
import platform
import random
import shutil
import statistics
import sys
import tempfile
import time
import traceback
from typing import Any, Callable, Iterable, Iterator, Optional, Sequence

GB = 1e9
GiB = float(1 << 30)
MiB = 1 << 20
ENGINE_NAMES = ("io_uring", "libaio", "psync")
INSTALL_HINT = "pip install 'fastpersist[bench]'"


class BenchError(Exception):
    """A problem the user can fix (a folder, a missing package): one line, exit code 1."""


def require(*modules: str) -> None:
    """Fails with the install command when an optional dependency is missing."""
    import importlib

    for name in modules:
        try:
            importlib.import_module(name)
        except ImportError:
            raise BenchError(f"fastpersist bench needs the {name} package: {INSTALL_HINT}") from None


# ---------------------------------------------------------------------------
# the folder


class Workspace:
    """A fresh hidden folder inside the user's folder (default: the current
    one, so the numbers are those of the filesystem the user works on),
    removed with everything in it by close()."""

    def __init__(self, folder: Optional[str], needs_bytes: int = 0):
        base = os.path.abspath(folder if folder is not None else os.getcwd())
        hint = "" if folder is not None else " (choose another with --folder)"
        if not os.path.exists(base):
            raise BenchError(f"folder {base} does not exist")
        if not os.path.isdir(base):
            raise BenchError(f"{base} is not a folder")
        try:
            self.path = tempfile.mkdtemp(prefix=".fastpersist-bench-", dir=base)
        except OSError as exc:
            raise BenchError(f"cannot write in folder {base}: {exc.strerror or exc}{hint}") from None
        self.base = base
        free = shutil.disk_usage(self.path).free
        if needs_bytes and free < needs_bytes:
            self.close()
            raise BenchError(f"folder {base} has {free / GB:.1f} GB free; this benchmark needs about "
                             f"{needs_bytes / GB:.1f} GB{hint}")

    def file(self, name: str) -> str:
        return os.path.join(self.path, name)

    def close(self) -> None:
        shutil.rmtree(self.path, ignore_errors=True)


def check_output_paths(*paths: Optional[str]) -> None:
    """--json/--csv/--plot targets: their folder must exist before minutes of measuring."""
    for path in paths:
        if not path:
            continue
        parent = os.path.dirname(os.path.abspath(path))
        if not os.path.isdir(parent):
            raise BenchError(f"cannot write {path}: folder {parent} does not exist")
        if os.path.isdir(path):
            raise BenchError(f"cannot write {path}: it is a folder")
        if not os.access(parent, os.W_OK):  # also false on a read-only filesystem, even for root
            raise BenchError(f"cannot write {path}: folder {parent} is not writable")


def remove(path: str) -> None:
    """Deletes a benchmark file and syncs, outside any timing: freeing a
    file's blocks (with online discard, ~1 s per GB) must not land in the
    next mechanism's time."""
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)
    wait_for_background_work()
    os.sync()


def wait_for_background_work() -> None:
    """Waits for work fastpersist does after a call returns (freeing a replaced
    checkpoint's blocks), where this version of fastpersist has any."""
    import fastpersist

    for name in ("wait_for_releases", "wait_for_saves"):
        waiter = getattr(fastpersist, name, None)
        if waiter is not None:
            waiter()


# ---------------------------------------------------------------------------
# the page cache




def cached_fraction(path: str) -> Optional[float]:
    """The fraction of path's pages in the page cache (mincore), or None
    where it cannot be told."""
    from fastpersist.fileio import cached_fraction as of_open_file

    fd = os.open(path, os.O_RDONLY)
    try:
        return of_open_file(fd, os.fstat(fd).st_size)
    finally:
        os.close(fd)


class CacheDropper:
    """Makes the next read of a file come from the device, as after a restart
    on another machine: fsync, then posix_fadvise(POSIX_FADV_DONTNEED) on the
    file; with mode "auto", where mincore still finds 1% or more of a file
    cached (or cannot tell), also /proc/sys/vm/drop_caches where this process
    may write it (root). Not every time: dropping the whole page cache also
    evicts the code of torch and Python, and a load that runs more of that
    code than the raw read then pays for reading it back from the disk,
    which a process loading checkpoint after checkpoint never does."""

    DROP_CACHES = "/proc/sys/vm/drop_caches"

    def __init__(self, mode: str = "auto"):
        self.mode = mode
        self.fadvise_error: Optional[str] = None
        self.system_error: Optional[str] = None if mode == "auto" else "not asked for (--cache-drop file)"
        self.system_used = False
        self.drops = 0
        self.most_cached: Optional[float] = None  # the largest fraction left cached after a drop

    def drop(self, *paths: str) -> None:
        for path in paths:
            fd = os.open(path, os.O_RDONLY)
            try:
                os.fsync(fd)  # dirty pages cannot be dropped
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            except OSError as exc:
                self.fadvise_error = exc.strerror or str(exc)
            finally:
                os.close(fd)
        fractions = [cached_fraction(path) for path in paths]
        still_cached = any(f is None or f >= 0.01 for f in fractions)
        if self.mode == "auto" and self.system_error is None and still_cached:
            try:
                with open(self.DROP_CACHES, "w") as fh:
                    fh.write("1\n")  # the page cache only; dentries and inodes stay
                self.system_used = True
            except OSError as exc:
                self.system_error = exc.strerror or str(exc)
            fractions = [cached_fraction(path) for path in paths]
        self.drops += 1
        for fraction in fractions:
            if fraction is not None:
                self.most_cached = max(self.most_cached or 0.0, fraction)

    @property
    def works(self) -> bool:
        if self.most_cached is not None:
            return self.most_cached < 0.01
        return self.fadvise_error is None or self.system_used

    def describe(self) -> str:
        used = []
        if self.fadvise_error is None:
            used.append("posix_fadvise(POSIX_FADV_DONTNEED) on the file after fsync")
        if self.system_used:
            used.append(f"{self.DROP_CACHES} (root)")
        text = "dropped before every read with " + " and ".join(used) if used else "NOT dropped"
        if self.mode == "auto" and not self.system_used and self.system_error:
            text += f"; {self.DROP_CACHES} not used ({self.system_error})"
        if self.fadvise_error:
            text += f"; posix_fadvise failed ({self.fadvise_error})"
        if self.most_cached is not None:
            text += f"; mincore after each drop: at most {100 * self.most_cached:.1f}% of a file still cached"
        if not self.works:
            text += " -- WARNING: the page cache could not be dropped, so reads may come from memory, not the device"
        return text

    def as_dict(self) -> dict:
        return {"mode": self.mode, "fadvise": self.fadvise_error is None, "fadvise_error": self.fadvise_error,
                "drop_caches": self.system_used, "drop_caches_error": self.system_error, "drops": self.drops,
                "most_cached_fraction": self.most_cached, "works": self.works, "text": self.describe()}


def fsync_path(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


# ---------------------------------------------------------------------------
# tensors


def tensors_in(obj) -> Iterator:
    """Every tensor in nested dicts, lists and tuples."""
    import torch

    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, dict):
        for v in obj.values():
            yield from tensors_in(v)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            yield from tensors_in(v)


def distinct_storages(obj) -> list:
    """The storages of obj's tensors, each once (a tied head shares the embedding's)."""
    seen = {}
    for t in tensors_in(obj):
        s = t.untyped_storage()
        seen.setdefault(s.data_ptr(), s)
    return list(seen.values())


def write_storages(writer, storages, file_size: int) -> None:
    """The raw engine's write for a ceiling: the storages' bytes, then zeros
    up to file_size (as many bytes as the checkpoint file), no format."""
    written = 0
    for storage in storages:
        writer.write_address(storage.data_ptr(), storage.nbytes())
        written += storage.nbytes()
    if written < file_size:
        writer.write_zeros(file_size - written)


def storage_bytes(obj) -> int:
    return sum(s.nbytes() for s in distinct_storages(obj))


def touch_all(obj) -> None:
    """Reads every byte of every tensor, so lazy mappings pay for their
    faults; the same tensor met twice (a tied head is the embedding) once,
    as the ceiling touches the bytes it read once (GPT-2's tied 256 MB
    summed twice cost 0.006 s more per 2 GB here)."""
    seen = set()
    for t in tensors_in(obj):
        key = (t.data_ptr(), t.dtype, t.shape, t.stride())
        if t.numel() and key not in seen:
            seen.add(key)
            t.sum()


def pieces_of(memory, sizes: Sequence[int], dtype) -> list:
    """Tensors over consecutive pieces of memory, of the given byte sizes: the
    ceiling touches what it read in the pieces a load returns, so that both
    pay the same per-tensor cost for touching (269 sums against one cost
    ~0.01-0.03 s more for 2 GB here)."""
    import torch

    item = torch.empty((), dtype=dtype).element_size()
    views, offset = [], 0
    for n in sizes:
        count = min(n, len(memory) - offset) // item
        if count <= 0:
            break
        views.append(torch.frombuffer(memory, dtype=dtype, count=count, offset=offset))
        offset += count * item
    return views


def raw_read(path: str, address: int, size: int, options, fresh_memory: bool = False) -> int:
    """The ceiling of a load: the file's bytes into memory at address, by the
    engine alone (no format), the way fastpersist's loads read: through the
    engine's registered buffers, copied out on its helper thread (as fio
    reads with --fixedbufs). Returns the bytes read.

    fresh_memory: the memory was just mapped and never touched; a helper
    thread faults it in ahead of the copies, started before the engine is
    taken (it may have to be created), as fastpersist.load does."""
    from fastpersist.fileio import prefaulting, read_extents, reading_engine

    extents = [(address, 0, size)]
    fd = os.open(path, os.O_RDONLY)
    try:
        with prefaulting(extents) if fresh_memory else contextlib.nullcontext(), \
                reading_engine(path, options) as (engine, direct_fd):
            if fresh_memory:
                read_extents(engine, direct_fd, fd, path, extents, checksums=False)
                return size  # read_extents raises EOFError on a short read
            got, _ = engine.read_extents(direct_fd, fd, extents, path)
    finally:
        os.close(fd)
    return got


def warm(path: str) -> None:
    """Reads a file whole through the page cache, so that the next read finds it there."""
    fd = os.open(path, os.O_RDONLY)
    try:
        buffer = bytearray(16 << 20)
        offset = 0
        while True:
            n = os.preadv(fd, [buffer], offset)
            if not n:
                break
            offset += n
    finally:
        os.close(fd)


def evict_from_page_cache(path: str) -> None:
    """fsync and POSIX_FADV_DONTNEED on one file (the benchmarks/ scripts' eviction)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


# ---------------------------------------------------------------------------
# engines and options


def usable_engines(wanted: Sequence[str], options) -> list:
    """The engines of wanted that start here, in the order given; raises BenchError naming why one cannot."""
    from fastpersist import _engine

    compiled = _engine.compiled_engines()
    usable = []
    for kind in wanted:
        if kind not in compiled:
            raise BenchError(f"engine {kind} is not compiled into this fastpersist build (compiled: "
                             f"{', '.join(compiled) or 'none'})")
        try:
            _engine.release(_engine.acquire(options.replace(engine=kind)))
        except OSError as exc:
            raise BenchError(f"engine {kind} cannot start here: {exc.strerror or exc}") from None
        usable.append(kind)
    return usable


def resolve_engines(selection: str, options) -> tuple:
    """(engines, how they were chosen) for --engines: auto, all or a list."""
    from fastpersist import _engine

    if selection == "auto":
        engine = _engine.acquire(options.replace(engine="auto"))
        kind = engine.kind
        _engine.release(engine)
        return [kind], f"{kind} (what engine=auto picks here)"
    if selection == "all":
        usable = []
        for kind in ENGINE_NAMES:
            try:
                usable += usable_engines([kind], options)
            except BenchError:
                pass
        if not usable:
            raise BenchError("no fastpersist engine can start here")
        return usable, "every engine that starts here"
    return usable_engines(selection.split(","), options), "as asked"


def bench_options(**overrides):
    """The settings a program would get (defaults, FASTPERSIST_* variables),
    with fsync forced on: every mechanism here makes its file durable."""
    from fastpersist.options import from_environment

    return from_environment().replace(fsync=True, **overrides)


@contextlib.contextmanager
def options_for_load(options):
    """fastpersist.load takes its settings from patch()/the environment; set them for one call."""
    from fastpersist import options as options_module

    previous = options_module._patched_options
    options_module.set_patched_options(options)
    try:
        yield
    finally:
        options_module.set_patched_options(previous)


def options_text(options) -> str:
    parts = []
    for field in dataclasses.fields(options):
        value = getattr(options, field.name)
        if isinstance(value, bool):
            value = int(value)
        elif field.name in ("buffer_size", "request_size") and value % MiB == 0:
            value = f"{value // MiB}M"
        parts.append(f"{field.name}={value}")
    return " ".join(parts)


# ---------------------------------------------------------------------------
# the machine


def _first_line_with(path: str, prefix: str) -> Optional[str]:
    try:
        with open(path, encoding="utf-8", errors="replace") as fh:
            for line in fh:
                if line.startswith(prefix):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return None


def _read(path: str) -> Optional[str]:
    try:
        with open(path, encoding="utf-8", errors="replace") as fh:
            return fh.read().strip()
    except OSError:
        return None


def block_device_of(source: Optional[str]) -> dict:
    """Model, rotational flag and I/O scheduler of /dev/<name> (its disk's, for a partition)."""
    if not source or not source.startswith("/dev/"):
        return {}
    name = os.path.basename(os.path.realpath(source))
    sys_dir = os.path.realpath(f"/sys/class/block/{name}")
    if not os.path.isdir(sys_dir):
        return {}
    if os.path.exists(os.path.join(sys_dir, "partition")):
        sys_dir = os.path.dirname(sys_dir)
    scheduler = _read(os.path.join(sys_dir, "queue", "scheduler")) or ""
    active = scheduler[scheduler.find("[") + 1:scheduler.find("]")] if "[" in scheduler else scheduler or None
    rotational = _read(os.path.join(sys_dir, "queue", "rotational"))
    return {"name": os.path.basename(sys_dir), "model": _read(os.path.join(sys_dir, "device", "model")),
            "rotational": None if rotational is None else rotational == "1", "scheduler": active}


def memory_available() -> Optional[int]:
    value = _first_line_with("/proc/meminfo", "MemAvailable")
    return int(value.split()[0]) * 1024 if value else None


def machine_info(folder: str) -> dict:
    import torch

    import fastpersist
    from fastpersist.filesystems import filesystem_of, probe_o_direct

    fs = filesystem_of(folder)
    mem_total = _first_line_with("/proc/meminfo", "MemTotal")
    mem_available = _first_line_with("/proc/meminfo", "MemAvailable")
    return {
        "cpus": os.cpu_count(),
        "cpus_usable": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
        "cpu_model": _first_line_with("/proc/cpuinfo", "model name") or platform.processor() or None,
        "memory_bytes": int(mem_total.split()[0]) * 1024 if mem_total else None,
        "memory_available_bytes": int(mem_available.split()[0]) * 1024 if mem_available else None,
        "kernel": f"{platform.system()} {platform.release()}",
        "python": platform.python_version(),
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "fastpersist": fastpersist.__version__,
        "folder": folder,
        "filesystem": fs,
        "device": block_device_of(fs["source"]) if fs else {},
        "o_direct": probe_o_direct(folder),
    }


def machine_lines(info: dict) -> list:
    memory = f"{info['memory_bytes'] / GiB:.1f} GiB RAM" if info["memory_bytes"] else "RAM unknown"
    cpus = f"{info['cpus']} CPUs"
    if info["cpus_usable"] and info["cpus_usable"] != info["cpus"]:
        cpus += f" ({info['cpus_usable']} usable)"
    lines = [f"machine: {cpus} ({info['cpu_model'] or 'unknown model'}), {memory}, {info['kernel']}, "
             f"python {info['python']}, torch {info['torch']} ({info['torch_threads']} threads), "
             f"fastpersist {info['fastpersist']}"]
    fs = info["filesystem"]
    if fs:
        where = f"{fs['type']} on {fs['source']} (mounted at {fs['mount_point']}"
        if fs.get("options"):
            where += f"; options {fs['options']}"
            if fs.get("super_options"):
                where += f"; {fs['super_options']}"
        where += ")"
    else:
        where = "filesystem unknown"
    device = info["device"]
    if device:
        kind = {True: "rotational", False: "non-rotational", None: "rotational?"}[device["rotational"]]
        where += (f"; device {device['name']}" + (f" {device['model']}" if device["model"] else "")
                  + f", {kind}, scheduler {device['scheduler']}")
    lines.append(f"folder: {info['folder']} -- {where}; O_DIRECT {info['o_direct']}")
    return lines


# ---------------------------------------------------------------------------
# timing


def model_script_arguments(doc: str, argv, layers: int, repeats: int, layers_note: str = ""):
    """The arguments the benchmarks/ scripts on a GPT-2-shaped model share:
    --layers (GPT-2 small's, that many), --repeats (rounds) and --folder."""
    import argparse

    parser = argparse.ArgumentParser(description=doc.splitlines()[0])
    parser.add_argument("--layers", type=int, default=layers,
                        help=f"GPT-2 small layers (default: {layers}{layers_note})")
    parser.add_argument("--repeats", type=int, default=repeats, help=f"rounds (default: {repeats})")
    parser.add_argument("--folder", default=None, help="where checkpoints go (default: a temporary folder here)")
    return parser.parse_args(argv)


def round_order(items: Sequence, round_index: int) -> list:
    """The order of round r: round 0 as given, later rounds shuffled (seeded
    by r, so a run can be repeated). Shuffled rather than rotated: rotating
    keeps every mechanism behind the same neighbour round after round, and
    what a neighbour leaves behind shows. A raw read right after a
    torch.load(mmap=True) had freed its page cache took 0.79 s here, right
    after another read 0.75 s (8 alternating rounds each)."""
    order = list(items)
    if round_index:
        random.Random(round_index).shuffle(order)
    return order


def hook_load_read(clock: "PhaseClock") -> None:
    """Times how long fastpersist.load waits for its file's read: the read runs
    on a thread while the pickle is unpickled, so the rest is what is not
    hidden behind it."""
    import importlib

    clock.hook(getattr(importlib.import_module("fastpersist.load"), "_CheckpointImage", None),
               "finish_reading", "read")


def load_phases(clock: "PhaseClock", seconds: float) -> dict:
    """A fastpersist.load's phases for hook_load_read's clock: what ran before
    and beside its read (open, unpickling) and the wait for the read after it."""
    if "read" not in clock.seconds:
        return {"load": seconds}
    waited = clock.seconds["read"]
    return {"open + unpickle during the read": max(0.0, seconds - waited), "rest of the read": waited}


class PhaseClock:
    """Seconds spent inside functions, by name, while hooks are installed.

    hook(owner, attribute, name) replaces a function, method or classmethod
    with a timing wrapper until the with-block ends; a missing attribute is
    skipped (fastpersist's internals change; the measurement must not)."""

    def __init__(self):
        self.seconds: dict = {}
        self._undo: list = []

    def add(self, name: str, seconds: float) -> None:
        self.seconds[name] = self.seconds.get(name, 0.0) + seconds

    def _timed(self, name: str, fn: Callable) -> Callable:
        def wrapper(*args, **kwargs):
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.add(name, time.perf_counter() - start)
        return wrapper

    def hook(self, owner: Any, attribute: str, name: str) -> None:
        raw = owner.__dict__.get(attribute) if isinstance(owner, type) else getattr(owner, attribute, None)
        if raw is None:
            return
        if isinstance(raw, classmethod):
            replacement: Any = classmethod(self._timed(name, raw.__func__))
        elif isinstance(raw, staticmethod):
            replacement = staticmethod(self._timed(name, raw.__func__))
        elif callable(raw):
            replacement = self._timed(name, raw)
        else:
            return
        setattr(owner, attribute, replacement)
        self._undo.append((owner, attribute, raw))

    def unhook(self) -> None:
        while self._undo:
            owner, attribute, raw = self._undo.pop()
            setattr(owner, attribute, raw)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.unhook()


@dataclasses.dataclass
class Series:
    """The rounds of one mechanism."""

    operation: str
    mechanism: str
    engine: str = "-"
    role: str = "other"  # "vanilla", "ceiling", "fastpersist" or "other": what ratios compare with
    nbytes: int = 0
    times: list = dataclasses.field(default_factory=list)
    phases: dict = dataclasses.field(default_factory=dict)  # name -> [seconds per round]
    extra: dict = dataclasses.field(default_factory=dict)

    def add(self, seconds: float, phases: Optional[dict] = None) -> None:
        self.times.append(seconds)
        for name, value in (phases or {}).items():
            self.phases.setdefault(name, []).append(value)

    @property
    def median(self) -> float:
        return statistics.median(self.times)

    @property
    def gb_per_s(self) -> float:
        return self.nbytes / GB / self.median if self.median > 0 else float("inf")

    @property
    def gib_per_s(self) -> float:
        return self.nbytes / GiB / self.median if self.median > 0 else float("inf")

    def phase_medians(self) -> dict:
        return {name: statistics.median(values) for name, values in self.phases.items()}


def ratio(reference: Optional[Series], series: Series) -> Optional[float]:
    """How many times faster series is than reference: the median over rounds
    of reference's time / series's time in the same round. Both ran once in
    every round, so a slow stretch of a noisy machine that slows both
    cancels: across four 5-round runs here, same-process loads came to
    0.90-0.96x their ceiling this way, 0.86-0.97x as a ratio of the two
    medians. Rounds with a zero time are left out; where the rounds do not
    pair up, the ratio of the medians."""
    if reference is None or not reference.times or not series.times or series.median <= 0:
        return None
    paired = _paired(reference, series)
    if paired:
        return statistics.median(paired)
    return reference.median / series.median


def _paired(reference: Optional[Series], series: Series) -> list:
    if reference is None or len(reference.times) != len(series.times):
        return []
    return [r / t for r, t in zip(reference.times, series.times) if t > 0]


def ratio_interval(reference: Optional[Series], series: Series, confidence: float = 0.9) -> Optional[tuple]:
    """(low, high, coverage): where the median of the per-round ratios that
    ratio() reports lies, with at least `confidence` (coverage is the exact
    figure). Distribution-free, from order statistics: the true median lies
    between the j-th smallest and j-th largest of n values with probability
    1 - 2 P(Binomial(n, 1/2) < j); j is the largest that reaches the
    confidence, else 1 (then coverage says how short it falls). A target
    inside the interval is one this run cannot tell apart. None below 2
    paired rounds."""
    values = sorted(_paired(reference, series))
    n = len(values)
    if n < 2:
        return None

    def coverage(j: int) -> float:
        return 1 - 2 * sum(math.comb(n, k) for k in range(j)) / 2 ** n

    j = 1
    while j + 1 <= (n + 1) // 2 and coverage(j + 1) >= confidence:
        j += 1
    return values[j - 1], values[n - j], coverage(j)


def role_ratios(series: list, s: Series) -> tuple:
    """(x vanilla, x ceiling) of s: ratio() against the series of the same
    operation whose role is "vanilla", and "ceiling" (None where none, or s itself)."""
    out = []
    for role in ("vanilla", "ceiling"):
        reference = next((o for o in series if o.operation == s.operation and o.role == role), None)
        out.append(ratio(reference, s) if reference is not None and reference is not s else None)
    return tuple(out)


def phases_text(phases: dict) -> str:
    return ", ".join(f"{name} {seconds:.3f}" for name, seconds in phases.items())


def series_row(series: Series, x_vanilla: Optional[float], x_ceiling: Optional[float], **columns) -> dict:
    """One result as JSON-friendly values (phases as a dict, times as a list)."""
    return {**columns, "operation": series.operation, "mechanism": series.mechanism, "engine": series.engine,
            "bytes": series.nbytes, "rounds": len(series.times), "median_s": series.median,
            "min_s": min(series.times), "max_s": max(series.times), "gb_per_s": series.gb_per_s,
            "gib_per_s": series.gib_per_s, "x_vanilla": x_vanilla, "x_ceiling": x_ceiling,
            "phases_s": series.phase_medians(), "times_s": list(series.times), **series.extra}


# ---------------------------------------------------------------------------
# output


def plural(count: int, word: str) -> str:
    return f"{count} {word}{'' if count == 1 else 's'}"


def fmt(value: Optional[float], digits: int = 2) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def table(headers: Sequence[str], rows: Iterable[Sequence[Any]], right: Iterable[int] = ()) -> list:
    """Text table lines; columns in right are right-aligned."""
    rows = [[str(cell) for cell in row] for row in rows]
    right = set(right)
    widths = [max([len(h)] + [len(r[i]) for r in rows]) for i, h in enumerate(headers)]

    def line(cells):
        return "  ".join(c.rjust(w) if i in right else c.ljust(w) for i, (c, w) in enumerate(zip(cells, widths))).rstrip()

    return [line(headers), line(["-" * w for w in widths])] + [line(r) for r in rows]


def write_json(path: str, document: dict) -> None:
    """The document, with the run's date (UTC) first, as `fastpersist bench report` reads it."""
    document = {"benchmark": document.get("benchmark"),
                "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"), **document}
    try:
        with open(path, "w", encoding="utf-8") as fh:
            json.dump(document, fh, indent=2, default=str)
            fh.write("\n")
    except OSError as exc:
        raise BenchError(f"cannot write {path}: {exc.strerror or exc}") from None


def write_csv(path: str, rows: list, columns: Sequence[str]) -> None:
    """One line per row; dict values become name=value;... and lists ;-separated."""
    def cell(value):
        if isinstance(value, dict):
            return ";".join(f"{k}={v:.6g}" if isinstance(v, float) else f"{k}={v}" for k, v in value.items())
        if isinstance(value, (list, tuple)):
            return ";".join(f"{v:.6g}" if isinstance(v, float) else str(v) for v in value)
        if isinstance(value, float):
            return f"{value:.6g}"
        return "" if value is None else value

    try:
        with open(path, "w", newline="", encoding="utf-8") as fh:
            writer = csv.DictWriter(fh, fieldnames=list(columns), extrasaction="ignore")
            writer.writeheader()
            for row in rows:
                writer.writerow({k: cell(row.get(k)) for k in columns})
    except OSError as exc:
        raise BenchError(f"cannot write {path}: {exc.strerror or exc}") from None


def save_figure(fig, path: str) -> None:
    """Writes a matplotlib figure as a PNG and closes it; an unwritable path is a BenchError."""
    import matplotlib.pyplot as plt

    fig.tight_layout()
    try:
        fig.savefig(path, dpi=100)
    except OSError as exc:
        raise BenchError(f"cannot write {path}: {exc.strerror or exc}") from None
    finally:
        plt.close(fig)


def progress(total: int, description: str):
    """A tqdm bar on stderr (hidden when stderr is not a terminal)."""
    from tqdm import tqdm

    return tqdm(total=total, desc=description, unit="run", disable=None, leave=False, file=sys.stderr,
                dynamic_ncols=True)


def echo(line: str = "") -> None:
    print(line, flush=True)


def notice(line: str) -> None:
    """Progress words on stderr, so stdout holds only the report."""
    print(line, file=sys.stderr, flush=True)


def format_exception(exc: BaseException) -> str:
    return "".join(traceback.format_exception_only(type(exc), exc)).strip()


@contextlib.contextmanager
def ram_device(gigabytes: float, shm: str = "/dev/shm") -> Iterator[str]:
    """A folder on ext4 on a loop device whose backing file lives in RAM
    (tmpfs): a device faster than the CPU side on most machines, where the
    per-tensor work and the faulting in of fresh memory show, which a slow
    disk hides. O_DIRECT works there, and dropping the file's pages makes the
    next read go to the device (the loop driver reading RAM). Needs root and
    loop devices; BenchError says what is missing. Everything is removed at
    the end."""
    import subprocess

    size = int(gigabytes * 1e9)
    if not os.path.isdir(shm):
        raise BenchError(f"--ram-device needs a tmpfs at {shm}")
    free = shutil.disk_usage(shm).free
    if size > free * 0.9:
        raise BenchError(f"--ram-device {gigabytes:g}: {shm} has {free / GB:.1f} GB free")
    for tool in ("losetup", "mkfs.ext4", "mount", "umount"):
        if shutil.which(tool) is None:
            raise BenchError(f"--ram-device needs {tool}")
    import signal
    import threading

    fd, image = tempfile.mkstemp(prefix="fastpersist-ramdev-", suffix=".img", dir=shm)
    os.close(fd)
    mountpoint = tempfile.mkdtemp(prefix="fastpersist-ramdev-")
    mounted = False
    # a SIGTERM (a job's timeout) unwinds through the clean-up below instead of leaving the mount and
    # its RAM behind
    previous = None
    if threading.current_thread() is threading.main_thread():
        previous = signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    try:
        os.truncate(image, size)
        for cmd in (["mkfs.ext4", "-q", "-F", "-E", "lazy_itable_init=0,lazy_journal_init=0", image],
                    ["mount", "-o", "loop", image, mountpoint]):
            result = subprocess.run(cmd, capture_output=True, text=True)
            if result.returncode:
                raise BenchError(f"--ram-device: {' '.join(cmd[:2])} failed: {result.stderr.strip()[:300]} "
                                 "(root and loop devices are needed)")
        mounted = True
        notice(f"RAM-backed device: ext4 on a loop device over {image} ({gigabytes:g} GB), mounted at {mountpoint}")
        yield mountpoint
    finally:
        if mounted:
            subprocess.run(["umount", mountpoint], capture_output=True)
        with contextlib.suppress(OSError):
            os.rmdir(mountpoint)
        with contextlib.suppress(OSError):
            os.unlink(image)
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)
