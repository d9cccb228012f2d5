"""``fastpersist bench vllm``: vLLM's load formats against fastpersist's, as
an inference server starts: each load in a fresh vLLM process (vLLM's CPU
build, run by the interpreter of its own environment, ``--vllm-python``),
on a generated Llama-shaped model in safetensors shards, from the disk
(cold), from the page cache (warm) and from tmpfs, beside a plain read of
the same bytes. Each format's ``load_weights`` is timed the same way in the
vLLM process (vLLM's own "Loading weights took" is kept beside it where the
format logs one); warm and tmpfs starts also reload in place
(``reload_weights``). Every start's greedy tokens must equal those of
vLLM's default loader: a format that differs is an error, not a row."""
from __future__ import annotations

import json
import os
import shutil
import statistics
import subprocess
import tempfile
import time

from . import common
from .common import BenchError, Series, echo, fmt

# (label, load_format, LLM keyword arguments, what vLLM's environment must have)
FORMATS = [
    ("safetensors (lazy mmap, vLLM's default)", "safetensors", {}, None),
    ("safetensors, eager", "safetensors", {"safetensors_load_strategy": "eager"}, None),
    ("safetensors, prefetch", "safetensors", {"safetensors_load_strategy": "prefetch"}, None),
    ("safetensors, enable_multithread_load", "safetensors",
     {"model_loader_extra_config": {"enable_multithread_load": True}}, None),
    ("runai_streamer", "runai_streamer", {}, "runai_model_streamer"),
    ("fastpersist", "fastpersist", {}, None),
    # fastpersist's other choices, measured beside its defaults
    ("fastpersist, cold_read=engine", "fastpersist", {"model_loader_extra_config": {"cold_read": "engine"}}, None),
    ("fastpersist, prefault_parameters", "fastpersist",
     {"model_loader_extra_config": {"prefault_parameters": True}}, None),
]
VANILLA = FORMATS[0][0]
PLAIN_READ = "plain read of the shards (cat, one reader)"
REGIMES = ("cold", "warm", "tmpfs")


def default_vllm_python() -> str:
    return os.environ.get("FASTPERSIST_VLLM_PYTHON", os.path.join(os.getcwd(), ".venv-vllm", "bin", "python"))


def make_model(folder: str, layers: int, shard_gb: float) -> int:
    """A Llama-shaped model (hidden 2048, 32 heads, 4 KV heads, vocab
    32000) of layers layers, random bf16 weights, in safetensors shards of
    at most shard_gb with an index, as save_pretrained writes it; its bytes."""
    common.require("transformers")
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=32000, hidden_size=2048, intermediate_size=5632, num_hidden_layers=layers,
                         num_attention_heads=32, num_key_value_heads=4, max_position_embeddings=512,
                         tie_word_embeddings=False)
    with torch.device("meta"):
        model = LlamaForCausalLM(config)
    model = model.to_empty(device="cpu").to(torch.bfloat16)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.02)
    model.save_pretrained(folder, max_shard_size=f"{int(shard_gb * 1000)}MB")
    return sum(os.path.getsize(os.path.join(folder, f)) for f in os.listdir(folder) if f.endswith(".safetensors"))


def _shards(folder: str) -> list:
    return sorted(os.path.join(folder, f) for f in os.listdir(folder) if f.endswith(".safetensors"))


def _has(python: str, module: str) -> bool:
    return subprocess.run([python, "-c", f"import {module}"], capture_output=True).returncode == 0


def _start(python: str, folder: str, load_format: str, kwargs: dict, reload: bool) -> dict:
    case = json.dumps({"model": folder, "load_format": load_format, "kwargs": kwargs, "reload": reload})
    done = subprocess.run([python, "-m", "fastpersist.bench.vllm_child", case], capture_output=True, text=True,
                          timeout=1800)
    for line in done.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[len("RESULT "):])
    tail = (done.stdout + done.stderr)[-3000:]
    raise BenchError(f"vLLM with load_format={load_format} {kwargs} failed (exit {done.returncode}):\n{tail}")


def _plain_read(paths: list) -> float:
    started = time.perf_counter()
    subprocess.run(["cat", *paths], stdout=subprocess.DEVNULL, check=True)
    return time.perf_counter() - started


def run(args) -> int:
    common.check_output_paths(args.json)
    python = args.vllm_python or default_vllm_python()
    if not os.path.exists(python) or not _has(python, "vllm"):
        raise BenchError(f"no vLLM at {python} (make vllm-env makes .venv-vllm; or pass --vllm-python)")
    formats = [f for f in FORMATS if f[3] is None or _has(python, f[3])]
    for label, _, _, needs in FORMATS:
        if (label, needs) not in [(f[0], f[3]) for f in formats]:
            common.notice(f"not measured: {label} ({needs} is not installed in vLLM's environment)")
    workspace = common.Workspace(args.folder)
    tmpfs = tempfile.mkdtemp(prefix="fastpersist-bench-vllm-", dir=args.tmpfs)
    dropper = common.CacheDropper(args.cache_drop)
    try:
        disk_model = os.path.join(workspace.path, "model")
        nbytes = make_model(disk_model, args.layers, args.shard_size)
        tmpfs_model = os.path.join(tmpfs, "model")
        shutil.copytree(disk_model, tmpfs_model)
        folders = {"cold": disk_model, "warm": disk_model, "tmpfs": tmpfs_model}
        series: dict = {}
        reference_tokens = None
        for r in range(args.repeats):
            for regime in REGIMES:
                folder = folders[regime]
                entries = [(PLAIN_READ, None, None)] + [(f[0], f[1], f[2]) for f in formats]
                for label, load_format, kwargs in common.round_order(entries, r):
                    if regime == "cold":
                        dropper.drop(*_shards(folder))
                    else:
                        for path in _shards(folder):
                            common.warm(path)
                    key = (f"load weights, fresh vLLM process, {regime}", label)
                    s = series.setdefault(key, Series(key[0], label, role=_role(label), nbytes=nbytes))
                    if load_format is None:
                        s.add(_plain_read(_shards(folder)))
                        continue
                    got = _start(python, folder, load_format, kwargs, reload=regime != "cold")
                    if reference_tokens is None:
                        reference_tokens = got["tokens"]
                    if got["tokens"] != reference_tokens or got.get("reload_tokens", reference_tokens) != \
                            reference_tokens:
                        raise BenchError(f"{label}: greedy tokens {got['tokens']} differ from {reference_tokens}")
                    s.add(got["load_weights_s"])
                    for name in ("vllm_loading_weights_s", "anon_growth_bytes", "file_peak_bytes"):
                        if name in got:
                            s.extra.setdefault(name, []).append(got[name])
                    if "reload_s" in got:
                        rkey = (f"reload in place (reload_weights), {regime}", label)
                        rs = series.setdefault(rkey, Series(rkey[0], label, role=_role(label), nbytes=nbytes))
                        rs.add(got.get("vllm_reloading_s", got["reload_s"]))
                echo(f"round {r + 1}/{args.repeats}: {regime} done")
        return _report(args, workspace, dropper, list(series.values()), nbytes, python)
    finally:
        workspace.close()
        shutil.rmtree(tmpfs, ignore_errors=True)


def _role(label: str) -> str:
    return {VANILLA: "vanilla", PLAIN_READ: "ceiling", "fastpersist": "fastpersist"}.get(label, "other")


def _report(args, workspace, dropper, series: list, nbytes: int, python: str) -> int:
    version = subprocess.run([python, "-c", "import vllm; print(vllm.__version__)"], capture_output=True,
                             text=True).stdout.strip()
    echo(f"fastpersist bench vllm: vLLM {version}, {args.repeats} rounds, {nbytes / 1e9:.2f} GB of weights")
    for line in common.machine_lines(common.machine_info(workspace.path)):
        echo(line)
    echo(f"page cache (cold): {dropper.describe()}")
    echo("x ref: vLLM's default loader's time / this time in the same round, median over rounds; "
         "x ceiling: the plain read's time / this time")
    rows, lines = [], []
    for s in series:
        x_ref, x_ceiling = common.role_ratios(series, s)
        extra = {k: statistics.median(v) for k, v in s.extra.items()}
        s.extra = {f"median_{k}": v for k, v in extra.items()}
        rows.append(common.series_row(s, x_ref, x_ceiling))
        anon = extra.get("anon_growth_bytes")
        lines.append([s.operation, s.mechanism, f"{s.median:.3f}", f"{s.gb_per_s:.2f}", fmt(x_ref), fmt(x_ceiling),
                      fmt(extra.get("vllm_loading_weights_s")), fmt(None if anon is None else anon / 1e9)])
    for line in common.table(["operation", "mechanism", "median s", "GB/s", "x ref", "x ceiling", "vLLM logged s",
                              "private memory grew, GB"], lines, right=(2, 3, 4, 5, 6, 7)):
        echo(line)
    if args.json:
        common.write_json(args.json, {"benchmark": "fastpersist bench vllm", "machine": common.machine_info(workspace.path),
                                      "vllm": version,
                                      "settings": {"layers": args.layers, "shard_size_gb": args.shard_size,
                                                   "repeats": args.repeats},
                                      "page_cache": {"text": dropper.describe()}, "results": rows})
    return 0
