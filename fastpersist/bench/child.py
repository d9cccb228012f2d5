"""What a fresh process measures for ``fastpersist bench``: one load, one
save, or one restart (build the model, restore it, take a first step). Started by
fresh.FreshProcesses; the result goes back through a pipe as a dict:
``{"ok": True, "seconds": ..., "phases": {...}, ...}``."""
from __future__ import annotations

import json
import os
import time
import traceback


def main(spec: dict, connection) -> None:
    try:
        result = {"ok": True, **_MEASURES[spec["kind"]](spec)}
    except BaseException as exc:  # reported by the parent, which names the mechanism
        result = {"ok": False, "error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()}
    try:
        connection.send(result)
    finally:
        connection.close()


def _options(spec: dict):
    from fastpersist.options import Options

    return Options(**spec["options"])


def _warm_up() -> None:
    """torch's first operation in a process starts its thread pool: a job
    restarting has done that long before it loads, so it is not timed here.

    The heap is then collected, so that every mechanism starts from the same
    garbage collector state: a process forked from the server inherits its
    allocation counts, and a full collection of the heap torch's import
    left (about 0.1 s here) falls due within the next few thousand
    allocations. Whichever load crossed that line paid for it (a 10 MB load
    of 569 tensors measured 0.14 s with it and 0.045 s without), which
    measured the server's history, not the load."""
    import gc

    import torch

    torch.ones(1 << 16).sum()
    gc.collect()


# ---------------------------------------------------------------------------
# one load of a checkpoint, every byte touched


def _load(spec: dict) -> dict:
    import mmap

    import torch

    import fastpersist
    from fastpersist.patching import original_load

    from . import common
    from .common import PhaseClock, options_for_load, touch_all

    path, mechanism = spec["path"], spec["mechanism"]
    options = _options(spec)
    _warm_up()
    size = os.path.getsize(path)
    if mechanism == "parallel page-cache read, from scratch":
        # The ceiling of a load from the page cache: the file's bytes, no
        # format, into memory mapped now by the read pipeline's threads
        # (read_threads of them, each faulting its pieces in), as a load of a
        # cached file reads it.
        from fastpersist import read_pipeline

        sizes = spec.get("pieces", [size])
        dtype = getattr(torch, spec.get("dtype", "float32"))
        start = time.perf_counter()
        memory = mmap.mmap(-1, -(-size // 4096) * 4096)
        if hasattr(mmap, "MADV_NOHUGEPAGE"):
            memory.madvise(mmap.MADV_NOHUGEPAGE)
        address = torch.frombuffer(memory, dtype=torch.uint8).data_ptr()
        fd = os.open(path, os.O_RDONLY)
        try:
            read_pipeline.pread_extents(fd, path, [(address, 0, size)], False,
                                        threads=read_pipeline.read_threads(options), populate=True)
        finally:
            os.close(fd)
        read = time.perf_counter()
        touch_all(common.pieces_of(memory, sizes, dtype))
        end = time.perf_counter()
        return {"seconds": end - start, "phases": {"map + read": read - start, "touch": end - read}}
    if mechanism in ("raw engine read, from scratch", "raw engine read, all set up"):
        from fastpersist import _engine

        # From scratch, the ceiling of a load here: the file's bytes into
        # memory mapped now (as fastpersist.load maps it, faulted in during
        # the read) through an engine started now, as any load in a fresh
        # process must. All set up: the memory touched and the engine
        # started before the timing; what it saves is what those two cost.
        fresh = mechanism.endswith("from scratch")
        sizes = spec.get("pieces", [size])  # touched in the pieces the loads return, as they are
        dtype = getattr(torch, spec.get("dtype", "float32"))
        if not fresh:
            _engine.release(_engine.acquire(options))
            memory = mmap.mmap(-1, -(-size // 4096) * 4096)
            torch.frombuffer(memory, dtype=torch.uint8).fill_(1)
            pieces = common.pieces_of(memory, sizes, dtype)
        with PhaseClock() as clock:
            if fresh:
                clock.hook(_engine, "acquire", "engine start")
            start = time.perf_counter()
            if fresh:
                memory = mmap.mmap(-1, -(-size // 4096) * 4096)
                if hasattr(mmap, "MADV_NOHUGEPAGE"):
                    memory.madvise(mmap.MADV_NOHUGEPAGE)
            address = torch.frombuffer(memory, dtype=torch.uint8).data_ptr()
            got = common.raw_read(path, address, size, options, fresh_memory=fresh)
            read = time.perf_counter()
        touch_all(common.pieces_of(memory, sizes, dtype) if fresh else pieces)
        end = time.perf_counter()
        if got != size:
            raise EOFError(f"{path}: read {got} of {size} bytes")
        started = clock.seconds.get("engine start", 0.0)
        phases = {"engine start": started, "map + read": read - start - started} if fresh else {"read": read - start}
        phases["touch"] = end - read
        return {"seconds": end - start, "phases": phases}

    with PhaseClock() as clock:
        if mechanism == "fastpersist.load":
            common.hook_load_read(clock)
        start = time.perf_counter()
        if mechanism == "torch.load":
            obj = original_load()(path, weights_only=True)
        elif mechanism == "torch.load(mmap=True)":
            obj = original_load()(path, weights_only=True, mmap=True)
        elif mechanism == "fastpersist.load":
            with options_for_load(options):
                obj = fastpersist.load(path, weights_only=True)
        else:
            raise ValueError(f"unknown load mechanism {mechanism!r}")
        loaded = time.perf_counter()
    touch_all(obj)
    end = time.perf_counter()
    phases = common.load_phases(clock, loaded - start)
    phases["touch"] = end - loaded
    return {"seconds": end - start, "phases": phases}


# ---------------------------------------------------------------------------
# one save to a new file, the first of the process


def _save(spec: dict) -> dict:
    """The state is the checkpoint's, read untimed by torch's own load (no
    engine started); then one save to a new file, fsync included, removed
    afterwards: what a job that saves once (an export, an adapter at the
    end of a short run) or a job's first save pays."""
    import fastpersist
    from fastpersist.patching import original_load, original_save

    from . import common

    mechanism, target = spec["mechanism"], spec["target"]
    options = _options(spec)
    state = original_load()(spec["path"], weights_only=True)
    _warm_up()
    with common.PhaseClock() as clock:
        if mechanism != "torch.save + fsync":
            from fastpersist import _engine

            clock.hook(_engine, "acquire", "engine start")
        start = time.perf_counter()
        if mechanism == "torch.save + fsync":
            original_save()(state, target)
            common.fsync_path(target)
        elif mechanism == "fastpersist.save":
            fastpersist.save(state, target, **spec["options"])
        elif mechanism == "raw engine write, from scratch":
            from fastpersist import FastFileWriter

            storages = [s for s in common.distinct_storages(state) if s.nbytes()]
            size = os.path.getsize(spec["path"])
            with FastFileWriter(target, exclusive=True, sole_writer=True, options=options,
                                expected_size=size) as writer:
                common.write_storages(writer, storages, size)
        else:
            raise ValueError(f"unknown save mechanism {mechanism!r}")
        end = time.perf_counter()
    os.unlink(target)
    started = clock.seconds.get("engine start", 0.0)
    phases = {"engine start": started, "rest": end - start - started} if started else {}
    return {"seconds": end - start, "phases": phases}


# ---------------------------------------------------------------------------
# one restart: build the model, restore it, first step


def _restart(spec: dict) -> dict:
    import dataclasses

    import torch

    import fastpersist
    from fastpersist.patching import original_load

    from . import models
    from .common import options_for_load

    mechanism, folder = spec["mechanism"], spec["folder"]
    config = models.ModelConfig(**spec["config"])
    dtype = getattr(torch, spec["dtype"])
    options = _options(spec)
    with open(os.path.join(folder, spec["index"]), encoding="utf-8") as fh:
        weight_map = json.load(fh)["weight_map"]
    files = sorted(set(weight_map.values()))
    _warm_up()

    start = time.perf_counter()
    meta = mechanism == "torch.load(mmap=True) + load_state_dict(assign=True)"
    # init=False: a job about to restore its weights does not initialise them first
    model = models.build(config, dtype, device="meta" if meta else "cpu", init=False)
    built = time.perf_counter()
    if mechanism == "fastpersist.load_into":
        state = model.state_dict()  # shares every parameter's memory
        for name in files:
            target = {key: state[key] for key, file in weight_map.items() if file == name}
            fastpersist.load_into(target, os.path.join(folder, name), **dataclasses.asdict(options))
    else:
        state = {}
        for name in files:
            path = os.path.join(folder, name)
            if mechanism == "torch.load + load_state_dict":
                state.update(original_load()(path, weights_only=True))
            elif meta:
                state.update(original_load()(path, weights_only=True, mmap=True))
            elif mechanism == "fastpersist.load + load_state_dict":
                with options_for_load(options):
                    state.update(fastpersist.load(path, weights_only=True))
            else:
                raise ValueError(f"unknown restart mechanism {mechanism!r}")
        model.load_state_dict(state, assign=meta)
        del state
    restored = time.perf_counter()
    # The first step writes every parameter once: with torch.load(mmap=True)
    # that is where the file's pages are read and copied on write.
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0)
    end = time.perf_counter()

    restored_state = model.state_dict()  # untimed: the parent checks the values came from the files
    checks = {key: float(restored_state[key].flatten()[:4096].double().sum()) for key in spec["check_keys"]}
    return {"seconds": end - start, "checks": checks,
            "phases": {"build": built - start, "restore": restored - built, "first step": end - restored}}


def _safetensors_load(spec: dict) -> dict:
    """One cold load of safetensors files (every byte touched): safetensors'
    load_file or safe_open, fastpersist's load_file, or the raw engine."""
    import mmap

    import torch

    from . import common

    mechanism, paths = spec["mechanism"], spec["paths"]
    options = _options(spec)
    _warm_up()
    start = time.perf_counter()
    if mechanism == "raw engine read":
        for path in paths:
            size = os.path.getsize(path)
            memory = mmap.mmap(-1, -(-size // 4096) * 4096)
            address = torch.frombuffer(memory, dtype=torch.uint8).data_ptr()
            if common.raw_read(path, address, size, options, fresh_memory=True) != size:
                raise EOFError(path)
            # touched as the loads' tensors are summed: in their dtype (a uint8 sum runs ~200x slower)
            dtype = getattr(torch, spec.get("dtype", "bfloat16"))
            torch.frombuffer(memory, dtype=dtype, count=size // dtype.itemsize).sum()
        return {"seconds": time.perf_counter() - start}
    loaded = []
    if mechanism == "fastsafetensors (nogds, CPU)":  # every file at once, as its loader takes them
        from fastsafetensors import fastsafe_open

        with fastsafe_open(filenames=list(paths), nogds=True, device="cpu") as f:
            loaded.append({k: f.get_tensor(k) for k in f.keys()})
        paths = []
    elif mechanism == "runai-model-streamer":
        from runai_model_streamer import SafetensorsStreamer

        with SafetensorsStreamer() as streamer:
            streamer.stream_files(list(paths), device="cpu")
            loaded.append(dict(streamer.get_tensors()))
        paths = []
    import safetensors
    import safetensors.torch

    for path in paths:
        if mechanism == "safetensors load_file (mmap)":
            loaded.append(safetensors.torch.load_file(path))
        elif mechanism == "safetensors safe_open (pread)":
            with safetensors.safe_open(path, framework="pt", backend="pread") as f:
                loaded.append({k: f.get_tensor(k) for k in f.keys()})
        elif mechanism in AS_TRANSFORMERS_READS:
            from fastpersist import safetensors as fst
            from fastpersist.bench.common import options_for_load

            if mechanism.startswith("fastpersist"):
                with options_for_load(options):
                    loaded.append(_as_transformers_reads(fst.safe_open, path))
            else:
                loaded.append(_as_transformers_reads(
                    getattr(safetensors, "_fastpersist_original_safe_open", safetensors.safe_open), path))
        elif mechanism == "fastpersist load_file":
            from fastpersist import safetensors as fst
            from fastpersist.bench.common import options_for_load

            with options_for_load(options):
                loaded.append(fst.load_file(path))
        else:
            raise ValueError(f"unknown safetensors load {mechanism!r}")
    for tensors in loaded:
        common.touch_all(tensors)
    return {"seconds": time.perf_counter() - start}


# safe_open as transformers 5 reads a shard: every tensor by get_slice(name)[...], from 4 threads, in
# its own order of names (numbers compared as numbers: layer 2 before layer 10)
AS_TRANSFORMERS_READS = ("safetensors safe_open (mmap), 4 threads", "fastpersist safe_open, 4 threads")


def _as_transformers_reads(opener, path: str) -> dict:
    import re
    from concurrent.futures import ThreadPoolExecutor

    def natural(name: str) -> list:
        return [(0, int(part), "") if part.isdigit() else (1, 0, part) for part in re.split(r"(\d+)", name)]

    with opener(path, framework="pt") as f:
        names = sorted(f.keys(), key=natural)
        with ThreadPoolExecutor(4) as pool:
            return dict(zip(names, pool.map(lambda name: f.get_slice(name)[...], names)))


_MEASURES = {"load": _load, "save": _save, "restart": _restart, "safetensors_load": _safetensors_load}
