"""The read pipeline (fastpersist.read_pipeline): parallel reads through the
page cache land every byte where asked, with the CRCs of what they read;
the source picks the mode per file; every load reads through it."""
import ctypes
import mmap
import os
import random
import threading
import time
import zlib

import pytest
import torch

import fastpersist
from conftest import evicted
from fastpersist import _engine, read_pipeline
from fastpersist.options import Options
from fastpersist.patching import original_load, original_save

MiB = 1 << 20


def _file(folder, size: int, seed: int = 0):
    path = folder / "data.bin"
    path.write_bytes(random.Random(seed).randbytes(size))
    return path


def _extents(rng: random.Random, size: int, base: int, count: int):
    """Extents of the file (small and large, gaps, repeats, overlaps), each
    with a destination of its own in the memory at base."""
    extents, at = [], 0
    for _ in range(count):
        kind = rng.random()
        if kind < 0.5:
            n = rng.randrange(0, 9000)  # small, as a checkpoint's biases and norms
        elif kind < 0.8:
            n = rng.randrange(1, 3 * read_pipeline.PIECE)  # cut into pieces
        else:
            n = rng.randrange(read_pipeline.PIECE - 4096, read_pipeline.PIECE + 4096)
        offset = rng.randrange(0, size - n + 1)
        extents.append((base + at, offset, n))
        at += n + rng.randrange(0, 64)  # unaligned destinations too
    extents.append(extents[len(extents) // 2])  # the same bytes asked twice (tied weights): read once
    return extents, at


@pytest.mark.parametrize("threads", [1, 2, 3, 8])
@pytest.mark.parametrize("populate", [False, True])
def test_parallel_reads_land_every_extent_with_its_crc(folder, threads, populate):
    size = 40 * MiB + 123
    path = _file(folder, size, threads)
    data = path.read_bytes()
    rng = random.Random(threads * 2 + populate)
    memory = mmap.mmap(-1, 1 << 30)  # touched only where the extents land
    base = ctypes.addressof(ctypes.c_char.from_buffer(memory))
    extents, used = _extents(rng, size, base, 40)
    assert used <= len(memory)
    fd = os.open(path, os.O_RDONLY)
    try:
        crcs = read_pipeline.pread_extents(fd, str(path), extents, checksums=True, threads=threads,
                                           populate=populate)
    finally:
        os.close(fd)
    for address, offset, n in extents:
        got = memory[address - base:address - base + n]
        assert got == data[offset:offset + n], (offset, n)
        if n:
            assert crcs[offset, n] == zlib.crc32(data[offset:offset + n]), (offset, n)
    assert len(crcs) == len({(o, n) for _, o, n in extents if n})


def test_a_large_read_is_shared_among_the_threads(folder, monkeypatch):
    path = _file(folder, 64 * MiB)
    readers = set()
    real = read_pipeline._read_unit

    def spy(*args, **kwargs):
        # each reader's first piece waits (2 s at most) until all four have one: on 2 CPUs the first
        # readers may otherwise take every piece before the last one runs
        readers.add(threading.get_ident())
        deadline = time.monotonic() + 2
        while len(readers) < 4 and time.monotonic() < deadline:
            time.sleep(0.001)
        return real(*args, **kwargs)

    monkeypatch.setattr(read_pipeline, "_read_unit", spy)
    target = torch.empty(64 * MiB, dtype=torch.uint8)
    fd = os.open(path, os.O_RDONLY)
    try:
        read_pipeline.pread_extents(fd, str(path), [(target.data_ptr(), 0, 64 * MiB)], False, threads=4)
    finally:
        os.close(fd)
    assert len(readers) == 4
    assert bytes(target.numpy()) == path.read_bytes()


def test_a_file_that_ends_early_raises_eoferror(folder):
    path = _file(folder, 3 * read_pipeline.PIECE)
    target = torch.empty(4 * read_pipeline.PIECE, dtype=torch.uint8)
    fd = os.open(path, os.O_RDONLY)
    try:
        with pytest.raises(EOFError):
            read_pipeline.pread_extents(fd, str(path), [(target.data_ptr(), 0, 4 * read_pipeline.PIECE)], False,
                                        threads=4)
    finally:
        os.close(fd)


def test_an_error_names_the_file_and_offset(folder):
    path = _file(folder, 16 * MiB)
    target = torch.empty(16 * MiB, dtype=torch.uint8)
    fd = os.open(path, os.O_WRONLY)  # reading a write-only descriptor: EBADF
    try:
        with pytest.raises(OSError, match=r"page-cache read at offset \d+") as raised:
            read_pipeline.pread_extents(fd, str(path), [(target.data_ptr(), 0, 16 * MiB)], False, threads=2)
        assert raised.value.filename == str(path)
    finally:
        os.close(fd)


def test_read_threads_default_and_option():
    assert 2 <= read_pipeline.read_threads(Options()) <= 8
    assert read_pipeline.read_threads(Options(read_threads=5)) == 5
    with pytest.raises(ValueError, match="read_threads"):
        Options(read_threads=-1)




def test_the_source_decides_the_mode(folder, page_cache_reads, monkeypatch):
    """A file in the page cache is read from there; one that is not, from
    the device through the engine; a small one with no engine idle, from
    the page cache."""
    path = _file(folder, 80 * MiB)
    options = Options()
    fd = os.open(path, os.O_RDONLY)
    try:
        os.pread(fd, 80 * MiB, 0)
        assert read_pipeline.through_page_cache(fd, 80 * MiB, options)
        if not evicted(path):
            pytest.skip("this filesystem keeps the file in the page cache")
        assert not read_pipeline.through_page_cache(fd, 80 * MiB, options)
        _engine.clear_pool()
        assert read_pipeline.through_page_cache(fd, 80 * MiB, options) is False
        monkeypatch.setattr(read_pipeline, "SMALL_FILE_BYTES", 100 * MiB)
        assert read_pipeline.through_page_cache(fd, 80 * MiB, options)  # small, and no engine idle
    finally:
        os.close(fd)


def _modes(monkeypatch) -> list:
    """The modes the pipeline reads in from now on, in order: "pread" (page cache) or "engine"."""
    modes = []
    real_pread, real_engine = read_pipeline.pread_extents, read_pipeline.engine_read_extents
    monkeypatch.setattr(read_pipeline, "pread_extents", lambda *a, **k: (modes.append("pread"), real_pread(*a, **k))[1])
    monkeypatch.setattr(read_pipeline, "engine_read_extents",
                        lambda *a, **k: (modes.append("engine"), real_engine(*a, **k))[1])
    return modes


def _state():
    g = torch.Generator().manual_seed(0)
    return {"emb": torch.randn(3000, 1024, generator=g), "tied": None, "b": torch.randn(7, generator=g),
            "h": torch.randn(512, 512, generator=g).half(), "step": 11}


@pytest.mark.parametrize("cached", [True, False], ids=["page-cache", "engine"])
def test_every_load_reads_through_the_pipeline(folder, monkeypatch, page_cache_reads, cached):
    """torch loads, load_into and safetensors' loads, cached or not, give
    what torch (or safetensors) gives, through the mode the file calls for."""
    state = _state()
    state["tied"] = state["emb"]
    original_save()(state, folder / "s.pt")
    if not cached and not evicted(folder / "s.pt"):
        pytest.skip("this filesystem keeps the file in the page cache")
    modes = _modes(monkeypatch)
    _engine.release(_engine.acquire(fastpersist.options.current_options()))  # an engine idle: no small-file rule
    ours = fastpersist.load(folder / "s.pt")
    # (not cached: reading the index brings the file's last span in, which the page-cache readers may take)
    assert modes == ["pread"] if cached else "engine" in modes
    theirs = original_load()(folder / "s.pt")  # after: its read brings the file into the page cache
    assert ours["emb"].data_ptr() == ours["tied"].data_ptr()
    for k in ("emb", "b", "h"):
        assert torch.equal(ours[k], theirs[k])
    target = {"emb": torch.zeros(3000, 1024), "tied": torch.zeros(3000, 1024), "b": torch.zeros(7),
              "h": torch.zeros(512, 512, dtype=torch.half), "step": 0}
    if not cached:
        evicted(folder / "s.pt")
    fastpersist.load_into(target, folder / "s.pt", verify=True)
    for k in ("emb", "tied", "b", "h"):
        assert torch.equal(target[k], theirs[k])


def test_a_partly_cached_file_is_read_both_ways_at_once(folder, page_cache_reads, monkeypatch):
    """Spans in the page cache through the readers, the rest through the
    engine: every byte where asked, each extent's CRC whole."""
    size = 48 * MiB + 1000
    path = _file(folder, size, 5)
    data = path.read_bytes()
    if not evicted(path):
        pytest.skip("this filesystem keeps the file in the page cache")
    fd = os.open(path, os.O_RDONLY)
    try:
        os.pread(fd, 12 * MiB, 20 * MiB)  # spans 10..15 in the page cache: a quarter of the file
        modes = {}
        real_pread, real_engine = read_pipeline.pread_extents, read_pipeline.engine_read_extents
        monkeypatch.setattr(read_pipeline, "pread_extents",
                            lambda fd, path, ext, *a, **k: (modes.setdefault("pread", []).extend(ext),
                                                            real_pread(fd, path, ext, *a, **k))[1])
        monkeypatch.setattr(read_pipeline, "engine_read_extents",
                            lambda e, d, fd, path, ext, *a, **k: (modes.setdefault("engine", []).extend(ext),
                                                                  real_engine(e, d, fd, path, ext, *a, **k))[1])
        _engine.release(_engine.acquire(Options()))
        memory = mmap.mmap(-1, 2 * size)
        base = ctypes.addressof(ctypes.c_char.from_buffer(memory))
        extents = [(base, 0, 30 * MiB), (base + 30 * MiB, 30 * MiB, size - 30 * MiB), (base + size, 100, 4000),
                   (base + size + 8192, 19 * MiB, 3 * MiB), (base + size + 8192, 19 * MiB, 3 * MiB)]
        crcs = read_pipeline.read_extents(fd, str(path), size, Options(), extents, checksums=True, fresh=True)
    finally:
        os.close(fd)
    # (the kernel's read-ahead may have brought in more than was read: the spans around are either's)
    cached = sorted((o, o + n) for _, o, n in modes["pread"])
    assert any(a <= 20 * MiB and b >= 30 * MiB for a, b in cached) and any(a <= 30 * MiB < 32 * MiB <= b
                                                                          for a, b in cached)
    assert all(o + n <= 20 * MiB or o >= 32 * MiB for _, o, n in modes["engine"]) and modes["engine"]
    for address, offset, n in extents:
        assert memory[address - base:address - base + n] == data[offset:offset + n]
        assert crcs[offset, n] == zlib.crc32(data[offset:offset + n])
    assert len(crcs) == 4


@pytest.mark.parametrize("cached", [True, False], ids=["page-cache", "engine"])
def test_safetensors_loads_read_through_the_pipeline(folder, monkeypatch, page_cache_reads, cached):
    """load_file and safe_open (as transformers reads a shard) read a cached
    file through the page-cache readers and one not cached through the
    engine, with safetensors' own values."""
    safetensors_torch = pytest.importorskip("safetensors.torch")
    from fastpersist import safetensors as fst

    g = torch.Generator().manual_seed(1)
    tensors = {f"h.{i}.w": torch.randn(1024, 2048, generator=g).bfloat16() for i in range(24)}
    tensors["bias"] = torch.randn(3, generator=g)
    path = folder / "m.safetensors"
    fst.save_file(tensors, path)  # written with O_DIRECT: not in the page cache
    if cached:
        path.read_bytes()
    elif not evicted(path):
        pytest.skip("this filesystem keeps the file in the page cache")
    modes = _modes(monkeypatch)
    _engine.release(_engine.acquire(fastpersist.options.current_options()))
    ours = fst.load_file(path)
    # cached: mapped as safetensors maps it (no read); not cached: the header's read brings the first
    # span in, which the page-cache readers may take
    assert modes == [] if cached else "engine" in modes
    if not cached:
        evicted(path)
    modes.clear()
    with fst.safe_open(path, "pt") as f:
        opened = {name: f.get_slice(name)[...] for name in sorted(f.keys(), reverse=True)}
    if cached:  # (not cached: the engine's passes with their progress, safe_open's own)
        assert set(modes) == {"pread"}
    theirs = safetensors_torch.load(path.read_bytes())
    for name, value in theirs.items():
        assert torch.equal(ours[name], value) and torch.equal(opened[name], value), name


def test_a_cached_safetensors_file_is_mapped_as_safetensors_maps_it(folder, monkeypatch, page_cache_reads):
    """load_file to the CPU of a file in the page cache takes safetensors'
    own mapping (what safetensors users had, and faster than any copy);
    verify=True still checks it; backend="pread" and a file not cached are
    read by the pipeline."""
    safetensors_torch = pytest.importorskip("safetensors.torch")
    from fastpersist import safetensors as fst

    tensors = {"w": torch.randn(256, 1024), "b": torch.arange(5)}
    path = folder / "m.safetensors"
    fst.save_file(tensors, path, checksums=True)
    own = []
    real_own = fst._safetensors_own
    monkeypatch.setattr(fst, "_safetensors_own",
                        lambda name: (own.append(name), real_own(name))[1])
    path.read_bytes()  # into the page cache
    for kwargs in ({}, {"verify": True}, {"backend": "mmap"}):
        own.clear()
        out = fst.load_file(path, **kwargs)
        assert "load_file" in own, kwargs
        assert all(torch.equal(out[k], v) for k, v in tensors.items())
    own.clear()
    fst.load_file(path, backend="pread")
    assert "load_file" not in own
    blob = bytearray(path.read_bytes())
    blob[-1] ^= 0xFF  # the last byte of the last tensor's data
    path.write_bytes(bytes(blob))
    with pytest.raises(fst.SafetensorsFileError, match="fails its CRC-32"):
        fst.load_file(path, verify=True)
    assert safetensors_torch.load_file(path)["w"].shape == (256, 1024)


def test_a_short_last_span_counts_its_own_pages(folder, page_cache_reads):
    """A file not in the page cache whose last span is shorter than MIXED_SPAN
    goes to the engine whole (its last span's few cached pages are counted
    against its own length, not MIXED_SPAN's)."""
    path = _file(folder, 3 * read_pipeline.MIXED_SPAN + 300 * 4096)
    if not evicted(path):
        pytest.skip("this filesystem keeps the file in the page cache")
    fd = os.open(path, os.O_RDONLY)
    try:
        os.pread(fd, 4096, 3 * read_pipeline.MIXED_SPAN)  # one page of the short last span (and read-ahead)
        size = os.fstat(fd).st_size
        cached, uncached = read_pipeline._split_by_residency(fd, size, [(0, 0, size)])
    finally:
        os.close(fd)
    assert not [p for p in cached if p[1] < 3 * read_pipeline.MIXED_SPAN]
    assert sum(p[2] for p in cached + uncached) == size
