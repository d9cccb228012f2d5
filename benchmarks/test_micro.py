"""Microbenchmarks: save and load of one float32 tensor ({"weight": t}) per
engine and size, vanilla torch for reference, and the engine alone (raw
write and read of the same number of bytes). See conftest.py for the command
and its options. Groups put each operation and size together, so pytest-
benchmark's table compares engines and torch side by side; the JSON output
(--benchmark-json) carries bytes and GB/s per benchmark in extra_info.
"""
from __future__ import annotations

import dataclasses
import mmap
import os

import pytest

pytest.importorskip("pytest_benchmark")

import torch  # noqa: E402

import fastpersist  # noqa: E402
from fastpersist.bench import common  # noqa: E402
from fastpersist.patching import original_load, original_save  # noqa: E402


@pytest.fixture(scope="module")
def state(size_mb):
    tensor = torch.empty(size_mb * 10**6 // 4, dtype=torch.float32).uniform_()  # touched before any timing
    return {"weight": tensor}


@pytest.fixture(scope="module")
def checkpoint(workspace, state, size_mb):
    """The file every load reads, written by torch.save."""
    path = workspace.file(f"checkpoint-{size_mb}.pt")
    original_save()(state, path)
    common.fsync_path(path)
    yield path
    common.remove(path)


def _opts(engine: str) -> dict:
    return dataclasses.asdict(common.bench_options(engine=engine))


def _run(benchmark, group: str, nbytes: int, target, setup, rounds: int):
    benchmark.group = group
    benchmark.pedantic(target, setup=setup, rounds=rounds, iterations=1, warmup_rounds=0)
    median = benchmark.stats.stats.median
    benchmark.extra_info.update(bytes=nbytes, gb_per_s=nbytes / 1e9 / median if median else None)


def _fresh(path: str):
    def setup():
        common.remove(path)
    return setup


def _existing(path: str, write, dropper):
    write()  # a complete checkpoint to replace, once

    def setup():
        dropper.drop(path)
    return setup


# -- saves -------------------------------------------------------------------


def test_save_new(benchmark, workspace, state, size_mb, engine, rounds, checkpoint):
    path = workspace.file(f"new-{engine}.pt")
    opts = _opts(engine)
    _run(benchmark, f"save new {size_mb}MB", os.path.getsize(checkpoint),
         lambda: fastpersist.save(state, path, **opts), _fresh(path), rounds)
    common.remove(path)


def test_save_existing(benchmark, workspace, state, size_mb, engine, rounds, checkpoint, dropper):
    path = workspace.file(f"latest-{engine}.pt")
    opts = _opts(engine)

    def save():
        fastpersist.save(state, path, **opts)
    _run(benchmark, f"save existing {size_mb}MB", os.path.getsize(checkpoint), save,
         _existing(path, save, dropper), rounds)
    common.wait_for_background_work()
    common.remove(path)


def _torch_save(state, path):
    original_save()(state, path)
    common.fsync_path(path)


def test_torch_save_new(benchmark, workspace, state, size_mb, rounds, checkpoint):
    path = workspace.file("new-torch.pt")
    _run(benchmark, f"save new {size_mb}MB", os.path.getsize(checkpoint), lambda: _torch_save(state, path),
         _fresh(path), rounds)
    common.remove(path)


def test_torch_save_existing(benchmark, workspace, state, size_mb, rounds, checkpoint, dropper):
    path = workspace.file("latest-torch.pt")
    _run(benchmark, f"save existing {size_mb}MB", os.path.getsize(checkpoint), lambda: _torch_save(state, path),
         _existing(path, lambda: _torch_save(state, path), dropper), rounds)
    common.remove(path)


def test_raw_write(benchmark, workspace, state, size_mb, engine, rounds, checkpoint):
    """The engine alone: the tensor's bytes, no format, no CRC, fsync included."""
    path = workspace.file(f"raw-{engine}.bin")
    tensor = state["weight"]
    options = common.bench_options(engine=engine)

    def write():
        with fastpersist.FastFileWriter(path, exclusive=True, sole_writer=True, options=options) as w:
            w.write_address(tensor.data_ptr(), tensor.nbytes)
    _run(benchmark, f"save new {size_mb}MB", tensor.nbytes, write, _fresh(path), rounds)
    common.remove(path)


# -- loads -------------------------------------------------------------------


def _cold(path: str, dropper):
    def setup():
        dropper.drop(path)
    return setup


def test_load(benchmark, checkpoint, size_mb, engine, rounds, dropper):
    options = common.bench_options(engine=engine)

    def load():
        with common.options_for_load(options):
            common.touch_all(fastpersist.load(checkpoint, weights_only=True))
    _run(benchmark, f"load {size_mb}MB", os.path.getsize(checkpoint), load, _cold(checkpoint, dropper), rounds)


def test_load_into(benchmark, checkpoint, state, size_mb, engine, rounds, dropper):
    opts = _opts(engine)
    _run(benchmark, f"load {size_mb}MB", os.path.getsize(checkpoint),
         lambda: fastpersist.load_into(state, checkpoint, **opts), _cold(checkpoint, dropper), rounds)


def test_torch_load(benchmark, checkpoint, size_mb, rounds, dropper):
    _run(benchmark, f"load {size_mb}MB", os.path.getsize(checkpoint),
         lambda: common.touch_all(original_load()(checkpoint, weights_only=True)), _cold(checkpoint, dropper), rounds)


def test_torch_load_mmap(benchmark, checkpoint, size_mb, rounds, dropper):
    _run(benchmark, f"load {size_mb}MB", os.path.getsize(checkpoint),
         lambda: common.touch_all(original_load()(checkpoint, weights_only=True, mmap=True)),
         _cold(checkpoint, dropper), rounds)


def test_raw_read(benchmark, checkpoint, size_mb, engine, rounds, dropper):
    """The engine alone: the whole file into memory that exists and is touched,
    through the engine's buffers (the ceiling `fastpersist bench` uses)."""
    size = os.path.getsize(checkpoint)
    memory = mmap.mmap(-1, -(-size // 4096) * 4096)
    buffer = torch.frombuffer(memory, dtype=torch.uint8)
    buffer.fill_(1)
    options = common.bench_options(engine=engine)

    def read():
        assert common.raw_read(checkpoint, buffer.data_ptr(), size, options) == size
    _run(benchmark, f"load {size_mb}MB", size, read, _cold(checkpoint, dropper), rounds)
