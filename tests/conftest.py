import contextlib
import fcntl
import logging
import os
import subprocess
import traceback
import uuid

import pytest
import torch

os.environ.setdefault("FASTPERSIST_AUTOPATCH", "0")

import fastpersist  # noqa: E402
from fastpersist import _engine, read_pipeline  # noqa: E402
from fastpersist.options import Options  # noqa: E402

# Small buffers so that modest payloads span many buffers and requests.
SMALL = dict(buffer_size=64 << 10, num_buffers=2, request_size=16 << 10, queue_depth=8)



@contextlib.contextmanager
def torch_save_setting(name, value):
    """Sets torch.utils.serialization.config.save.<name> for a block.
    (pytest's monkeypatch cannot undo a setattr on torch's config proxies
    in every version: 9.2 deletes the setting, failing every later save.)"""
    from torch.utils.serialization import config

    old = getattr(config.save, name)
    setattr(config.save, name, value)
    try:
        yield
    finally:
        setattr(config.save, name, old)

def usable_engines():
    usable = []
    for kind in _engine.compiled_engines():
        try:
            _engine.release(_engine.acquire(Options(engine=kind, **SMALL)))
            usable.append(kind)
        except OSError:
            pass
    return usable


ENGINES = usable_engines()


@pytest.fixture(params=["psync", "libaio", "io_uring"])
def engine(request):
    """Each engine; one that is not compiled in or that the kernel refuses is a skip."""
    if request.param not in ENGINES:
        why = "not compiled in" if request.param not in _engine.compiled_engines() else "refused by this kernel"
        pytest.skip(f"the {request.param} engine is {why}")
    return request.param


@pytest.fixture(autouse=True)
def _restore_patching():
    """Every test starts unpatched, with torch's own save and load, and ends so."""
    fastpersist.unpatch()
    yield
    fastpersist.unpatch()
    assert torch.save is fastpersist.patching.original_save()
    assert torch.load is fastpersist.patching.original_load()


@pytest.fixture(autouse=True)
def _engine_reads_cached_files():
    """Loads read through the engine as for a file not in the page cache:
    every file a test writes is in the page cache, and would otherwise never
    reach the engine. Tests of the page-cache mode ask for it (page_cache_reads).
    (Set and put back by hand: a monkeypatch made here would be undone only
    after _restore_patching's checks, and so would every other of the test's.)"""
    read_pipeline.CACHED_ENOUGH = 2.0
    yield
    read_pipeline.CACHED_ENOUGH = _CACHED_ENOUGH


_CACHED_ENOUGH = read_pipeline.CACHED_ENOUGH


@pytest.fixture
def page_cache_reads(monkeypatch):
    """Loads of cached files read as users' do: through the page cache, in parallel."""
    monkeypatch.setattr(read_pipeline, "CACHED_ENOUGH", 0.9)


@pytest.fixture
def folder(tmp_path):
    """A folder on a real disk filesystem (tmp_path is on the root filesystem here)."""
    return tmp_path


def vanilla_load(path, **kwargs):
    """torch.load without any fastpersist involvement."""
    assert not fastpersist.is_patched()
    return torch.load(path, weights_only=False, **kwargs)


def fail_third_copy(monkeypatch):
    """torch.Tensor.copy_ raises on its third call from now on (a device
    copy failing); returns a function that puts the real copy_ back."""
    real_copy = torch.Tensor.copy_
    copies = []

    def failing(self, src, *args, **kwargs):
        copies.append(1)
        if len(copies) == 3:
            raise RuntimeError("device copy failed")
        return real_copy(self, src, *args, **kwargs)

    monkeypatch.setattr(torch.Tensor, "copy_", failing)
    return lambda: monkeypatch.setattr(torch.Tensor, "copy_", real_copy)


def leftovers(folder):
    """fastpersist's files in folder, once this process's pending releases
    (replaced checkpoints unlinked in the background) are done."""
    assert fastpersist.wait_for_releases(timeout=60)
    return sorted(name for name in os.listdir(folder) if "fastpersist" in name)


@contextlib.contextmanager
def mounted(fstype, size_kib=None, options=""):
    """Mounts a small filesystem of fstype on a fresh folder; skips the test
    where mounting is not permitted (no root, no loop devices)."""
    base = f"/tmp/fastpersist-mnt-{uuid.uuid4().hex[:8]}"
    os.makedirs(base)
    image = None
    try:
        if fstype == "ext4":
            image = base + ".img"
            with open(image, "wb") as f:
                f.truncate(size_kib * 1024)
            mkfs = subprocess.run(["mkfs.ext4", "-q", "-F", image], capture_output=True)
            if mkfs.returncode:
                pytest.skip(f"mkfs.ext4 unavailable: {mkfs.stderr.decode()[:200]}")
            cmd = ["mount", "-o", "loop" + ("," + options if options else ""), image, base]
        else:
            opts = ",".join(x for x in (f"size={size_kib}k" if size_kib else "", options) if x)
            cmd = ["mount", "-t", fstype] + (["-o", opts] if opts else []) + [fstype, base]
        result = subprocess.run(cmd, capture_output=True)
        if result.returncode:
            pytest.skip(f"cannot mount {fstype} here: {result.stderr.decode().strip()[:200]}")
        try:
            yield base
        finally:
            subprocess.run(["umount", "-l", base], capture_output=True)
    finally:
        with contextlib.suppress(OSError):
            os.rmdir(base)
        if image:
            with contextlib.suppress(OSError):
                os.unlink(image)


@pytest.fixture
def log_records(caplog):
    caplog.set_level(logging.DEBUG, logger="fastpersist")
    return caplog


def fork_child(body) -> int:
    """Forks a child that runs body() and exits 0 (once its background
    releases are done), or 1 with a traceback on stderr; returns its pid. One intra-op thread in the child: torch 2.13
    hangs in a forked child running a parallel op after the parent used its
    thread pool."""
    pid = os.fork()
    if pid == 0:  # pragma: no cover - runs in the child
        code = 1
        try:
            torch.set_num_threads(1)
            body()
            # os._exit skips atexit: wait for background releases as a normal exit would
            fastpersist.wait_for_releases()
            code = 0
        except BaseException:  # noqa: BLE001
            traceback.print_exc()
        finally:
            os._exit(code)
    return pid


def is_locked(path) -> bool:
    """True if another open file description holds an flock on path (as a
    live save does on its temporary); False if it is free or gone."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except FileNotFoundError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return False
    except BlockingIOError:
        return True
    finally:
        os.close(fd)  # drops our lock, if we got it


def safetensors_header(path):
    """A safetensors file's header as fastpersist reads it (entries in file order)."""
    from fastpersist import safetensors as fast_st

    fd = os.open(path, os.O_RDONLY)
    try:
        return fast_st.Header.read(fd, str(path), os.fstat(fd).st_size)
    finally:
        os.close(fd)


def evicted(path) -> bool:
    """Drops a file from the page cache (fsync, POSIX_FADV_DONTNEED); whether
    that worked (under half of it still cached: some filesystems keep it)."""
    from fastpersist.fileio import cached_fraction

    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        return (cached_fraction(fd, os.fstat(fd).st_size) or 0.0) < 0.5
    finally:
        os.close(fd)
