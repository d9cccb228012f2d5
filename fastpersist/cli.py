"""The ``fastpersist`` command line: ``fastpersist info [--folder PATH] [--json]``
and ``fastpersist bench [sweep|restart] [...]``.

Each subcommand is a ``_cmd_<name>(args) -> int`` function registered in
``_build_parser``; add new ones the same way. Importing this module builds
nothing and touches no GPU: the C engine is loaded and CUDA is queried only
while a command runs, and the benchmarks (fastpersist.bench) are imported
only by ``bench``.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import resource
import sys
from typing import Any, Optional

import fastpersist

from . import cufile
from .filesystems import errno_text, filesystem_of, probe_o_direct

MiB = 1 << 20


# ---------------------------------------------------------------------------
# helpers


def _read_text(path: str) -> Optional[str]:
    try:
        with open(path, encoding="utf-8", errors="replace") as fh:
            return fh.read().strip()
    except OSError:
        return None


def _limit_text(value: int) -> str:
    if value == resource.RLIM_INFINITY:
        return "unlimited"
    mib = value / MiB
    return f"{mib:g} MiB" if value % MiB == 0 else f"{mib:.3f} MiB"


def _engine_probe(options) -> dict:
    """Starts each compiled engine once; reports which start and the auto pick."""
    from . import _engine

    result: dict[str, Any] = {"compiled": None, "start": {}, "auto": None,
                              "memory_locked": None, "lock_error": None, "error": None}
    try:
        compiled = _engine.compiled_engines()
    except ImportError as exc:
        result["error"] = str(exc)
        return result
    result["compiled"] = compiled
    result["missing"] = [kind for kind in _engine._AUTO_ORDER if kind not in compiled]
    result["crc32"] = _engine.crc32_implementation()
    maps = _read_text("/proc/self/maps") or ""
    result["linked"] = {kind: ("shared library" if f"/lib{name}.so" in maps else "built in")
                        for kind, name in (("io_uring", "uring"), ("libaio", "aio")) if kind in compiled}
    started = set()
    for kind in compiled:
        try:
            engine = _engine.Engine(kind, options)
        except OSError as exc:
            result["start"][kind] = exc.strerror or str(exc)
            continue
        started.add(kind)
        result["start"][kind] = "OK"
        if result["memory_locked"] is None:
            result["memory_locked"] = engine.memory_locked
            if not engine.memory_locked and engine.lock_errno:
                result["lock_error"] = errno_text(OSError(engine.lock_errno, os.strerror(engine.lock_errno)))
        del engine  # frees its buffers now
    result["auto"] = next((kind for kind in _engine._AUTO_ORDER if kind in started), None)
    return result


def _cuda_probe() -> dict:
    import torch

    info: dict[str, Any] = {"available": False, "device_count": 0,
                            "torch_cuda_version": getattr(torch.version, "cuda", None)}
    try:
        info["available"] = bool(torch.cuda.is_available())
        info["device_count"] = int(torch.cuda.device_count()) if info["available"] else 0
    except Exception as exc:  # a broken driver should not break `info`
        info["error"] = f"{type(exc).__name__}: {exc}"
    return info


# ---------------------------------------------------------------------------
# info


def gather_info(folder: str) -> dict:
    """Everything `fastpersist info` reports, as JSON-friendly values."""
    import cffi
    import torch

    from . import _torch_api
    from .options import Options, current_options

    try:
        defaults: Any = dataclasses.asdict(current_options())
    except (ValueError, TypeError) as exc:  # a bad FASTPERSIST_* variable
        defaults = {"error": str(exc)}

    engines = _engine_probe(Options())
    cuda = _cuda_probe()
    gds = cufile.probe()  # in a child process, with a timeout
    soft, hard = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    folder = os.path.abspath(folder)

    return {
        "fastpersist_version": fastpersist.__version__,
        "python_version": f"{platform.python_version()} ({platform.python_implementation()})",
        "torch_version": torch.__version__,
        "cffi_version": cffi.__version__,
        "kernel_release": os.uname().release,
        "engines_compiled": engines["compiled"],
        "engines_missing": engines.get("missing"),
        "engines_linked": engines.get("linked"),
        "crc32": engines.get("crc32"),
        "engine_error": engines["error"],
        "engines_start": engines["start"],
        "io_uring_disabled": _read_text("/proc/sys/kernel/io_uring_disabled"),
        "auto_engine": engines["auto"],
        "memory_locked": engines["memory_locked"],
        "memory_lock_error": engines["lock_error"],
        "rlimit_memlock": {"soft": _limit_text(soft), "hard": _limit_text(hard)},
        "default_options": defaults,
        "read_pipeline": _read_pipeline_info(defaults),
        # what `import fastpersist` does in a program run with this environment
        # (this command's own patching says nothing about another process)
        "autopatch_on_import": fastpersist.autopatch_enabled(),
        "safetensors_routed_on_import": _safetensors_routed_on_import(),
        "source_patch_applied": _torch_api.source_patch_applied(),
        "folder": folder,
        "o_direct": probe_o_direct(folder),
        "filesystem": filesystem_of(folder),
        "cuda": cuda,
        "cufile": gds,
        "transfer": _transfer_choice(defaults, gds, cuda["available"]),
    }


def _read_pipeline_info(defaults: dict) -> dict:
    """How loads read with these options: the threads of a page-cache read,
    and the most host memory the engines' buffers take (every engine the
    pool may hold at once; a page-cache read takes none: it reads straight
    into the destinations)."""
    from . import read_pipeline
    from .options import Options

    if "error" in defaults:
        return {"error": defaults["error"]}
    options = Options(**defaults)
    per_engine = options.buffer_size * options.num_buffers
    return {"page_cache_threads": read_pipeline.read_threads(options),
            "page_cache_rule": f"cached >= {read_pipeline.CACHED_ENOUGH:.0%}, or smaller than "
                               f"{read_pipeline.SMALL_FILE_BYTES >> 20} MiB with no engine idle",
            "engine_buffers_bytes": per_engine, "engine_pool_max_bytes": per_engine * options.max_engines}


def _safetensors_routed_on_import() -> str:
    """Whether `import fastpersist` routes safetensors' file functions, and why not."""
    import importlib.util

    if importlib.util.find_spec("safetensors") is None:
        return "no (safetensors is not installed)"
    if not fastpersist.autopatch_enabled():
        return "no (FASTPERSIST_AUTOPATCH)"
    if os.environ.get("FASTPERSIST_SAFETENSORS", "1").strip().lower() in ("0", "false", "no", "off"):
        return "no (FASTPERSIST_SAFETENSORS)"
    return "yes"


def _transfer_choice(defaults: dict, gds: dict, cuda_available: bool) -> dict:
    """What the transfer option makes of GPU tensors in a program run with
    this environment (see cufile.transfer_for)."""
    option = defaults.get("transfer", "auto")
    if option == "bounce":
        return {"option": option, "gpu_tensors_take": "bounce", "why": "transfer=bounce"}
    why = cufile.why_not_gds(gds, cuda_available, allow_compat=option == "gds" and
                             bool(defaults.get("allow_gds_compat")))
    if why is None:
        return {"option": option, "gpu_tensors_take": "gds", "why": cufile.gds_mode(gds)}
    return {"option": option, "gpu_tensors_take": "refused (GPU saves and loads raise)" if option == "gds"
            else "bounce", "why": why}


def _yes_no(value: Optional[bool]) -> str:
    return "unknown" if value is None else ("yes" if value else "no")


def _format_options(options: dict) -> str:
    if "error" in options:
        return f"invalid ({options['error']})"
    parts = []
    for key, value in options.items():
        if isinstance(value, bool):
            value = int(value)
        elif key in ("buffer_size", "request_size") and value % MiB == 0:
            value = f"{value // MiB}M"
        parts.append(f"{key}={value}")
    return " ".join(parts)


def format_info(info: dict) -> list[str]:
    """The text form of gather_info(): aligned 'key: value' lines."""
    rows: list[tuple[str, str]] = [
        ("fastpersist", info["fastpersist_version"]),
        ("python", info["python_version"]),
        ("torch", info["torch_version"]),
        ("cffi", info["cffi_version"]),
        ("kernel", info["kernel_release"]),
    ]
    if info["engine_error"]:
        rows.append(("engines compiled", f"unavailable ({info['engine_error']})"))
    else:
        rows.append(("engines compiled", ", ".join(info["engines_compiled"]) or "none"))
        for kind, how in (info.get("engines_linked") or {}).items():
            rows.append((f"{kind} library", how))
        if info.get("engines_missing"):
            rows.append(("engines missing", ", ".join(info["engines_missing"]) + " (not in this build: install "
                         "liburing-dev and libaio-dev and reinstall fastpersist; without them saves and loads "
                         "run on the slower engines)"))
        rows.append(("crc32", info.get("crc32") or "unknown"))
        for kind, state in info["engines_start"].items():
            rows.append((f"engine {kind}", state))
    if info["io_uring_disabled"] is not None:
        rows.append(("kernel.io_uring_disabled", info["io_uring_disabled"]))
    rows.append(("auto engine", info["auto_engine"] or "none can start"))
    locked = _yes_no(info["memory_locked"])
    if info["memory_lock_error"]:
        locked += f" ({info['memory_lock_error']})"
    rows.append(("buffers mlocked", locked))
    limit = info["rlimit_memlock"]
    rows.append(("RLIMIT_MEMLOCK", f"soft {limit['soft']}, hard {limit['hard']}"))
    rows.append(("default options", _format_options(info["default_options"])))
    reads = info["read_pipeline"]
    if "error" not in reads:
        rows.append(("loads", f"through the page cache with {reads['page_cache_threads']} threads where "
                     f"{reads['page_cache_rule']}; else the engine's O_DIRECT reads"))
        rows.append(("engine buffers", f"{reads['engine_buffers_bytes'] >> 20} MiB an engine, at most "
                     f"{reads['engine_pool_max_bytes'] >> 20} MiB for the pool"))
    rows.append(("import patches torch", _yes_no(info["autopatch_on_import"])
                 + ("" if info["autopatch_on_import"] else " (FASTPERSIST_AUTOPATCH)")))
    rows.append(("import routes safetensors", info["safetensors_routed_on_import"]))
    rows.append(("source patch applied", _yes_no(info["source_patch_applied"])))
    rows.append(("folder", info["folder"]))
    rows.append(("O_DIRECT", info["o_direct"]))
    fs = info["filesystem"]
    rows.append(("filesystem", f"{fs['type']} (mount point {fs['mount_point']}, source {fs['source']})"
                 if fs else "unknown"))
    cuda = info["cuda"]
    if "error" in cuda:
        cuda_text = f"error ({cuda['error']})"
    elif cuda["available"]:
        cuda_text = f"yes, {cuda['device_count']} device(s)"
    else:
        cuda_text = "no"
    if cuda["torch_cuda_version"]:
        cuda_text += f" (torch built with CUDA {cuda['torch_cuda_version']})"
    else:
        cuda_text += " (CPU-only torch build)"
    rows.append(("CUDA", cuda_text))
    gds = info["cufile"]
    if not gds.get("library"):
        rows.append(("cuFile", gds.get("reason") or "not found"))
    else:
        rows.append(("cuFile", f"{gds['library']} (version {gds.get('version') or 'unknown'})"))
        if gds.get("error"):
            rows.append(("cuFile driver", gds["error"]))
        else:
            rows.append(("cuFile driver", gds.get("driver") or "not opened"))
            if gds.get("driver") == "opened":
                rows.append(("cuFile mode", f"GDS (nvidia-fs {gds['nvfs_version']})" if gds.get("nvfs_version")
                             else "compatibility mode only (POSIX I/O through cuFile's bounce buffers)"))
        nvfs = gds.get("nvidia_fs_loaded")
        rows.append(("nvidia-fs", f"loaded, version {nvfs}" if nvfs else "not loaded"))
    transfer = info["transfer"]
    takes = {"gds": "with GPUDirect Storage (cuFile)", "bounce": "through the engine's pinned buffers"}
    rows.append(("GPU tensors move", f"{takes.get(transfer['gpu_tensors_take'], transfer['gpu_tensors_take'])} "
                                     f"(transfer={transfer['option']}): {transfer['why']}"))
    width = max(len(key) for key, _ in rows) + 1
    return [f"{key + ':':<{width}} {value}" for key, value in rows]


def _cmd_info(args: argparse.Namespace) -> int:
    info = gather_info(args.folder)
    if args.json:
        print(json.dumps(info, indent=2))
    else:
        print("\n".join(format_info(info)))
    return 0


# ---------------------------------------------------------------------------
# bench


def _cmd_bench(args: argparse.Namespace) -> int:
    """Runs `fastpersist bench [sweep|restart]`; a problem the user can fix
    (folder, missing package, engine) is one line on stderr and exit code 1."""
    from .bench.common import BenchError

    command = args.bench_command or "default"
    try:
        if command == "sweep":
            from .bench import sweep as module
        elif command == "restart":
            from .bench import restart as module
        elif command == "small":
            from .bench import small as module
        elif command == "gpu":
            from .bench import gpu as module
        elif command == "safetensors":
            from .bench import stfiles as module
        elif command == "vllm":
            from .bench import vllm as module
        elif command == "report":
            from .bench import report as module
        else:
            from .bench import default as module
        if getattr(args, "ram_device", None):
            from .bench.common import ram_device

            with ram_device(args.ram_device) as folder:
                args.folder = folder
                return module.run(args)
        return module.run(args)
    except BenchError as exc:
        print(f"fastpersist bench: error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("fastpersist bench: interrupted", file=sys.stderr)
        return 130


def _positive_float(value: str) -> float:
    try:
        number = float(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {value!r}") from None
    if not number > 0 or number == float("inf"):
        raise argparse.ArgumentTypeError(f"must be a positive number: {value!r}")
    return number


def _positive_int(value: str) -> int:
    try:
        number = int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an integer: {value!r}") from None
    if number < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1: {value!r}")
    return number


def _list_of(item_type, what: str):
    """A comma-separated list of item_type values, none repeated."""
    def parse(value: str) -> list:
        items = [item_type(part.strip()) for part in value.split(",") if part.strip()]
        if not items:
            raise argparse.ArgumentTypeError(f"expected one or more {what}, comma-separated")
        return list(dict.fromkeys(items))
    return parse


def _engines_argument(value: str) -> str:
    from .options import ENGINES

    if value in ("auto", "all"):
        return value
    names = [part.strip() for part in value.split(",") if part.strip()]
    unknown = [n for n in names if n not in ENGINES or n == "auto"]
    if not names or unknown:
        raise argparse.ArgumentTypeError(f"{value!r}: expected auto, all, or a comma-separated list of "
                                         "io_uring, libaio, psync")
    return ",".join(dict.fromkeys(names))


def _option_values(name: str, scale: int = 1):
    """A list for one engine option, each value checked as fastpersist.Options checks it."""
    from .options import Options

    def parse(value: str) -> int:
        try:
            number = float(value) * scale
        except ValueError:
            raise argparse.ArgumentTypeError(f"not a number: {value!r}") from None
        if number != int(number):
            raise argparse.ArgumentTypeError(f"{value!r} is not a whole number of bytes")
        try:
            Options(**{name: int(number), **({"request_size": 4096} if name == "buffer_size" else {})})
        except (ValueError, TypeError) as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None
        return int(number)
    return _list_of(parse, name.replace("_", " ") + " values")


def _common_bench_arguments(parser: argparse.ArgumentParser, repeats: int, csv: Optional[str] = None) -> None:
    parser.add_argument("--folder", default=None,
                        help="an existing folder on the filesystem to measure; the benchmark works in a "
                             "temporary folder inside it and removes it (default: the current folder)")
    parser.add_argument("--ram-device", type=_positive_float, default=None, metavar="GB",
                        help="measure on ext4 on a loop device backed by this much RAM (/dev/shm), made for the "
                             "run and removed after it: a device faster than the CPU side, where per-tensor "
                             "costs and memory faulting show (needs root; overrides --folder)")
    parser.add_argument("--repeats", type=_positive_int, default=repeats, metavar="N",
                        help=f"rounds; medians are reported (default: {repeats})")
    parser.add_argument("--cache-drop", choices=("auto", "file"), default="auto",
                        help="auto: posix_fadvise(DONTNEED) on each file, and /proc/sys/vm/drop_caches where "
                             "writable (root); file: posix_fadvise only, leaving other processes' cache alone "
                             "(default: auto)")
    parser.add_argument("--json", metavar="PATH", help="write the results as JSON too")
    parser.add_argument("--csv", metavar="PATH", default=csv,
                        help="write the results as CSV" + (f" (default: {csv})" if csv else " too"))


def _regimes_argument(text: str) -> list:
    regimes = [r.strip() for r in text.split(",") if r.strip()]
    unknown = [r for r in regimes if r not in ("cold", "warm", "tmpfs")]
    if unknown or not regimes:
        raise argparse.ArgumentTypeError(f"{text!r}: expected a comma-separated list of cold, warm, tmpfs")
    return regimes


def _model_arguments(parser: argparse.ArgumentParser, size: float, dtype: str) -> None:
    parser.add_argument("--size", type=_positive_float, default=size, metavar="GB",
                        help="checkpoint size in GB (10^9 bytes): a GPT-2-shaped model with as many layers as "
                             f"come closest (default: {size:g})")
    parser.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), default=dtype,
                        help=f"parameter dtype (default: {dtype})")


def _add_bench_parser(commands) -> None:
    bench = commands.add_parser(
        "bench", help="measure save and load on this machine against torch.save/torch.load",
        description="Measure fastpersist on this machine's disk: save to a new file and over an existing one, "
                    "load in a fresh process and in the same one, load_into, each against vanilla torch and "
                    "the raw engine, on a ~2 GB model with random weights. 'sweep' tunes the engine "
                    "options; 'restart' characterises LLM restarts; 'small' runs the default rows at small sizes; "
                    "'gpu' saves from and loads to a GPU; 'vllm' times vLLM's load formats.")
    _model_arguments(bench, size=2.0, dtype="float32")
    bench.add_argument("--engines", type=_engines_argument, default="auto",
                       help="auto (the engine fastpersist picks here), all, or a list such as io_uring,libaio "
                            "(default: auto)")
    _common_bench_arguments(bench, repeats=7)
    bench.set_defaults(func=_cmd_bench, bench_command=None)
    kinds = bench.add_subparsers(dest="bench_command", metavar="{sweep,restart,small,gpu,safetensors,vllm,report}")

    sweep = kinds.add_parser(
        "sweep", help="buffer size x buffers x queue depth x engine (x file size): GB/s, CSV and a plot",
        description="Sweep the engine options for fastpersist.save (new file) and fastpersist.load_into "
                    "(from a dropped page cache): buffer size x number of buffers x queue depth x engine x file "
                    "size. Writes a CSV and a PNG plot of GB/s and says how the defaults compare with the best.")
    sweep.add_argument("--size", type=_list_of(_positive_float, "sizes in GB"), default=[0.5], metavar="GB[,GB]",
                       help="checkpoint size(s) in GB (default: 0.5)")
    sweep.add_argument("--buffer-sizes", type=_option_values("buffer_size", 1 << 20), default=[4 << 20, 16 << 20,
                       64 << 20], metavar="MiB,...", help="buffer sizes in MiB (default: 4,16,64)")
    sweep.add_argument("--num-buffers", type=_option_values("num_buffers"), default=[2, 4], metavar="N,...",
                       help="numbers of buffers (default: 2,4)")
    sweep.add_argument("--queue-depths", type=_option_values("queue_depth"), default=[8, 32], metavar="N,...",
                       help="queue depths (default: 8,32)")
    sweep.add_argument("--request-sizes", type=_option_values("request_size", 1 << 20), default=None,
                       metavar="MiB,...", help="request sizes in MiB (default: the current setting, 1)")
    sweep.add_argument("--engines", type=_engines_argument, default="all",
                       help="all (every engine that starts here), auto, or a list (default: all)")
    sweep.add_argument("--plot", metavar="PATH", default="fastpersist-sweep.png",
                       help="PNG plot of GB/s (default: fastpersist-sweep.png)")
    _common_bench_arguments(sweep, repeats=2, csv="fastpersist-sweep.csv")
    sweep.set_defaults(func=_cmd_bench)

    restart = kinds.add_parser(
        "restart", help="LLM restart: checkpoint and restart times of 3B/13B/70B-shaped stand-ins",
        description="Checkpoint and restart (build the model, restore it, first step) Llama-shaped models, "
                    "each restart in a fresh process: torch.load + load_state_dict, torch.load(mmap=True) + "
                    "load_state_dict(assign=True) on a meta model, fastpersist.load + load_state_dict, "
                    "fastpersist.load_into. The models are CPU-sized stand-ins: the real models' layer shapes "
                    "with fewer layers.")
    restart.add_argument("--models", type=_list_of(str, "model names"), default=["3b", "13b", "70b"],
                         metavar="NAME,...", help="stand-ins to measure: 3b, 13b, 70b, tiny (default: 3b,13b,70b)")
    restart.add_argument("--layers", type=_positive_int, default=1, metavar="N",
                         help="decoder layers of each stand-in (default: 1)")
    restart.add_argument("--dtype", choices=("bfloat16", "float16", "float32"), default="bfloat16",
                         help="parameter dtype (default: bfloat16)")
    restart.add_argument("--shard-size", type=_positive_float, default=1.0, metavar="GB",
                         help="largest file of a checkpoint, as in sharded model checkpoints (default: 1)")
    restart.add_argument("--engine", choices=("auto", "io_uring", "libaio", "psync"), default="auto",
                         help="the engine for fastpersist (default: auto)")
    restart.add_argument("--plot", metavar="PATH", default="fastpersist-restart.png",
                         help="PNG plot of the times (default: fastpersist-restart.png)")
    _common_bench_arguments(restart, repeats=3)
    restart.set_defaults(func=_cmd_bench)

    small = kinds.add_parser(
        "small", help="the default save and load rows at 1 MB to 500 MB: a table and a plot against size",
        description="Run the default benchmark's rows (saves to a new file and over an existing one, loads in "
                    "a fresh process and in the same one, load_into; vanilla torch and the raw engine beside "
                    "them) at each size, where fixed costs decide, and plot fastpersist's speed relative to "
                    "vanilla torch and to the raw engine against checkpoint size.")
    small.add_argument("--sizes", type=_list_of(_positive_float, "sizes in GB"),
                       default=[0.001, 0.01, 0.05, 0.1, 0.5], metavar="GB,...",
                       help="checkpoint sizes in GB (default: 0.001,0.01,0.05,0.1,0.5)")
    small.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), default="float32",
                       help="parameter dtype (default: float32)")
    small.add_argument("--engines", type=_engines_argument, default="auto",
                       help="auto, all, or a list such as io_uring,libaio (default: auto)")
    small.add_argument("--plot", metavar="PATH", default="fastpersist-small.png",
                       help="PNG plot of the ratios against size (default: fastpersist-small.png)")
    small.add_argument("--no-optimizer", dest="optimizer", action="store_false",
                       help="leave out the optimizer-state row (Adam's state for a model of ~500 parameters: "
                            "~1,500 small tensors, where per-tensor costs decide)")
    _common_bench_arguments(small, repeats=7)
    small.set_defaults(func=_cmd_bench)

    gpu = kinds.add_parser(
        "gpu", help="save from and load to a GPU: torch, fastpersist, the raw engine, peak host memory",
        description="Save a model's state that lives on the GPU and load it back to the GPU: torch.save + "
                    "fsync, fastpersist.save, save_async's stall beside one device-to-host copy, torch.load and "
                    "fastpersist.load with map_location on the device, load_into a model on the device, and the "
                    "raw engine's write and read; with each call's peak host memory.")
    _model_arguments(gpu, size=1.0, dtype="bfloat16")
    gpu.add_argument("--device", default="cuda",
                     help="the device (default: cuda); cpu only checks that the benchmark runs")
    gpu.add_argument("--regimes", type=_regimes_argument, default="cold,warm,tmpfs", metavar="LIST",
                     help="the loads' sources, comma-separated (default: cold,warm,tmpfs): cold (the disk, the "
                          "files dropped from the page cache), warm (the page cache), tmpfs (copies in /dev/shm)")
    _common_bench_arguments(gpu, repeats=5)
    gpu.set_defaults(func=_cmd_bench)

    safetensors = kinds.add_parser(
        "safetensors", help="safetensors files: safetensors' save_file and load_file against fastpersist's",
        description="Save and load safetensors files as Hugging Face libraries do: a GPT-2-shaped model in two "
                    "shards and a LoRA-like file of ~500 small tensors; safetensors' save_file + fsync, "
                    "load_file (mmap) and safe_open (pread) against fastpersist.safetensors and the raw engine; "
                    "cold loads in fresh processes with the page cache dropped, warm loads in this one.")
    _model_arguments(safetensors, size=2.0, dtype="bfloat16")
    safetensors.add_argument("--small-mb", type=_positive_float, default=50.0, metavar="MB",
                             help="size of the LoRA-like file in MB (default: 50)")
    _common_bench_arguments(safetensors, repeats=5)
    safetensors.set_defaults(func=_cmd_bench)
    vllm = kinds.add_parser(
        "vllm", help="vLLM's load formats against fastpersist's, in fresh vLLM processes",
        description="Start vLLM (its CPU or GPU build, in an environment of its own: --vllm-python) in fresh "
                    "processes on a generated Llama-shaped model in safetensors shards and time each load "
                    "format's load_weights: vLLM's safetensors loader (lazy, eager, prefetch, multithreaded), "
                    "runai_streamer where installed there, and fastpersist; from the disk (cold), the page cache "
                    "(warm) and tmpfs, beside a plain read of the same bytes; reloads in place too. Every "
                    "start's greedy tokens must equal the default loader's.")
    vllm.add_argument("--layers", type=_positive_int, default=7, metavar="N",
                      help="decoder layers of the model (hidden 2048; 7 layers: 0.88 GB in bf16; default: 7)")
    vllm.add_argument("--shard-size", type=_positive_float, default=0.4, metavar="GB",
                      help="largest shard, as save_pretrained's max_shard_size (default: 0.4)")
    vllm.add_argument("--vllm-python", default=None, metavar="PATH",
                      help="the interpreter of vLLM's environment (default: $FASTPERSIST_VLLM_PYTHON, else "
                           "./.venv-vllm/bin/python, which `make vllm-env` makes)")
    vllm.add_argument("--tmpfs", default="/dev/shm", metavar="FOLDER",
                      help="a tmpfs folder for the tmpfs regime (default: /dev/shm)")
    _common_bench_arguments(vllm, repeats=3)
    vllm.set_defaults(func=_cmd_bench)
    report = kinds.add_parser(
        "report", help="render a stored --json result as a table (text or Markdown), with machine and date",
        description="Render the JSON a `fastpersist bench ... --json PATH` run wrote as a table, with the machine, "
                    "the date and the command. With --update, rewrite the generated tables in Markdown pages "
                    "(the blocks between '<!-- fastpersist bench report FILE.json -->' and "
                    "'<!-- end bench report -->'); with --check, only say which are stale (exit code 1).",
        epilog="example: fastpersist bench report benchmarks/results/gpu-h200-2026-11-27-a.json --markdown")
    report.add_argument("files", nargs="+", metavar="FILE",
                        help="JSON files written by --json; with --update or --check, Markdown pages")
    mode = report.add_mutually_exclusive_group()
    mode.add_argument("--markdown", action="store_true", help="a Markdown table instead of text")
    mode.add_argument("--update", action="store_true", help="rewrite the generated tables in the pages FILE ...")
    mode.add_argument("--check", action="store_true",
                      help="exit 1 if a generated table in the pages FILE ... is not what its JSON renders to")
    report.set_defaults(func=_cmd_bench)


# ---------------------------------------------------------------------------
# entry point


def _existing_folder(value: str) -> str:
    if not os.path.isdir(value):
        raise argparse.ArgumentTypeError(f"not a folder: {value}")
    return value


def _build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="fastpersist", description="fastpersist: fast torch.save")
    parser.add_argument("--version", action="version", version=f"fastpersist {fastpersist.__version__}")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND")
    commands.required = True

    info = commands.add_parser("info", help="report versions, engines, limits and what the storage accepts",
                               description="Report what fastpersist can use on this machine.")
    info.add_argument("--folder", type=_existing_folder, default=os.curdir,
                      help="folder to test for O_DIRECT and filesystem type (default: current folder)")
    info.add_argument("--json", action="store_true", help="print a JSON object instead of text")
    info.set_defaults(func=_cmd_info)
    _add_bench_parser(commands)
    return parser


def main(argv: Optional[list[str]] = None) -> int:
    args = _build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
