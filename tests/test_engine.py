"""The C engine through its binding: real files, every engine, awkward sizes and offsets."""
import errno
import os
import subprocess
import sys
import time
import zlib

import numpy as np
import pytest

from fastpersist import FastFileWriter, _engine
from fastpersist.options import Options

from conftest import ENGINES, SMALL, mounted

SIZES = [0, 1, 4095, 4096, 4097, 3 * (64 << 10) + 123]  # the last spans several 64 KiB buffers
PAYLOAD = np.random.default_rng(0).integers(0, 256, size=1 << 20, dtype=np.uint8)


def aligned_array(nbytes, shift=0):
    raw = np.empty(nbytes + 2 * 4096, dtype=np.uint8)
    start = (-raw.ctypes.data) % 4096 + shift
    return raw, raw[start:start + nbytes]


def test_all_engines_compiled_here():
    """The project's set-up installs liburing-dev and libaio-dev: in CI every
    engine must be compiled in; elsewhere a missing one is a skip."""
    assert "psync" in ENGINES
    missing = sorted({"psync", "libaio", "io_uring"} - set(_engine.compiled_engines()))
    if missing and not os.environ.get("CI"):
        pytest.skip(f"not compiled in here: {', '.join(missing)} (install liburing-dev / libaio-dev and rebuild)")
    assert missing == []


@pytest.mark.parametrize("direct", [True, False])
@pytest.mark.parametrize("offset", [0, 1, 4096, 5000])
@pytest.mark.parametrize("size", SIZES)
def test_write_then_read_back(tmp_path, engine, direct, offset, size):
    path = tmp_path / "f.bin"
    data = PAYLOAD[:size]
    with FastFileWriter(path, offset, engine=engine, direct=direct, **SMALL) as w:
        # uneven pieces so buffer boundaries fall everywhere
        pos = 0
        for piece in (1, 4095, 70000, 3, 1 << 20):
            n = min(piece, size - pos)
            w.write_address(data[pos:].ctypes.data, n)
            pos += n
        assert w.tell() == offset + size
    content = path.read_bytes()
    if size == 0:
        assert content == b""  # nothing written: the file is created, not extended to the offset
    else:
        assert content == b"\0" * offset + data.tobytes()

    e = _engine.acquire(Options(engine=engine, **SMALL))
    try:
        for shift in (offset % 4096, 0, 1):  # aligned alike (O_DIRECT straight in) and not (bounced)
            raw, dst = aligned_array(size, shift)
            bfd = os.open(path, os.O_RDONLY)
            dfd = os.open(path, os.O_RDONLY | os.O_DIRECT) if direct else -1
            try:
                got = e.pread_into(dfd, bfd, dst.ctypes.data, size, offset, str(path))
            finally:
                os.close(bfd)
                if dfd >= 0:
                    os.close(dfd)
            assert got == size
            assert dst.tobytes() == data.tobytes()
    finally:
        _engine.release(e)


def test_crc_matches_zlib(engine, tmp_path):
    data = PAYLOAD[: 300_001]
    with FastFileWriter(tmp_path / "c.bin", engine=engine, **SMALL) as w:
        crc = w.write_address(data.ctypes.data, 100, 0)
        crc = w.write_address(data[100:].ctypes.data, len(data) - 100, crc)
    assert crc == zlib.crc32(data.tobytes())
    assert _engine.crc32(b"hello world") == zlib.crc32(b"hello world")


def test_read_past_end_of_file_is_short(engine, tmp_path):
    path = tmp_path / "short.bin"
    path.write_bytes(PAYLOAD[:10_000].tobytes())
    e = _engine.acquire(Options(engine=engine, **SMALL))
    try:
        raw, dst = aligned_array(20_000)
        bfd = os.open(path, os.O_RDONLY)
        dfd = os.open(path, os.O_RDONLY | os.O_DIRECT)
        try:
            got = e.pread_into(dfd, bfd, dst.ctypes.data, 20_000, 0, str(path))
        finally:
            os.close(bfd)
            os.close(dfd)
        assert got == 10_000
        assert dst[:10_000].tobytes() == PAYLOAD[:10_000].tobytes()
    finally:
        _engine.release(e)


def test_several_writers_fill_one_file(engine, tmp_path):
    """Disjoint, unaligned ranges written by separate streams form one exact file."""
    path = tmp_path / "shared.bin"
    data = PAYLOAD[:500_000]
    bounds = [0, 7, 70_001, 262_144, 300_000, 500_000]
    writers = [FastFileWriter(path, lo, engine=engine, **SMALL) for lo in bounds[:-1]]
    for w, lo, hi in zip(writers, bounds, bounds[1:]):
        w.write_address(data[lo:].ctypes.data, hi - lo)
    for w in reversed(writers):
        w.close()
    assert path.read_bytes() == data.tobytes()


def test_error_carries_errno_path_and_operation(engine, tmp_path):
    e = _engine.acquire(Options(engine=engine, **SMALL))
    try:
        fd = os.open(tmp_path / "ro.bin", os.O_RDONLY | os.O_CREAT)
        try:
            e.begin(-1, fd, 0, str(tmp_path / "ro.bin"))
            with pytest.raises(OSError) as info:
                e.write(b"x" * 200_000)
                e.end()
            e.abort()
        finally:
            os.close(fd)
        assert info.value.errno == errno.EBADF
        assert info.value.filename == str(tmp_path / "ro.bin")
        assert "write" in str(info.value)
    finally:
        _engine.release(e)


def test_bad_engine_options_are_named():
    with pytest.raises(ValueError, match="buffer_size"):
        Options(buffer_size=1000)
    with pytest.raises(ValueError, match="num_buffers"):
        Options(num_buffers=1)
    with pytest.raises(ValueError, match="engine"):
        Options(engine="spdk")
    with pytest.raises(TypeError, match="bufer_size"):
        Options().replace(bufer_size=4096)


def test_buffered_fallback_where_o_direct_is_refused(engine):
    """ramfs refuses O_DIRECT at open: the same bytes go through the page cache."""
    with mounted("ramfs") as mnt:
        path = os.path.join(mnt, "f.bin")
        data = PAYLOAD[:200_003]
        with FastFileWriter(path, engine=engine, **SMALL) as w:
            assert not w.direct
            w.write(data)
        with open(path, "rb") as f:
            assert f.read() == data.tobytes()


def test_unlocked_buffers_still_work(engine, tmp_path):
    with FastFileWriter(tmp_path / "u.bin", engine=engine, lock_memory=False, **SMALL) as w:
        w.write(b"abc" * 50_000)
    assert (tmp_path / "u.bin").read_bytes() == b"abc" * 50_000


def test_memlock_refusal_is_reported_once(tmp_path):
    """Without CAP_IPC_LOCK and a tiny RLIMIT_MEMLOCK, mlock fails; saves still work."""
    import shutil
    import subprocess
    import sys

    if not shutil.which("capsh") or os.geteuid() != 0:
        pytest.skip("needs root and capsh to drop CAP_IPC_LOCK")
    script = (
        "import logging, resource, torch, fastpersist, sys\n"
        "logging.basicConfig(level=logging.INFO, stream=sys.stdout)\n"
        "resource.setrlimit(resource.RLIMIT_MEMLOCK, (65536, 65536))\n"
        f"fastpersist.save({{'a': torch.arange(1000)}}, {str(tmp_path / 'm.pt')!r})\n"
        f"fastpersist.save({{'a': torch.arange(1000)}}, {str(tmp_path / 'm.pt')!r})\n"
        f"print('loaded', torch.load({str(tmp_path / 'm.pt')!r})['a'].sum().item())\n"
    )
    out = subprocess.run(
        ["capsh", "--drop=cap_ipc_lock", "--", "-c", f"{sys.executable} -c \"$0\"", script],
        capture_output=True, text=True, env={**os.environ, "FASTPERSIST_AUTOPATCH": "0"},
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.count("could not lock") == 1, out.stdout
    assert "loaded 499500" in out.stdout


def test_auto_falls_back_when_kernel_refuses_io_uring(tmp_path):
    """With io_uring_setup refused (EPERM) auto takes libaio, says why in one
    log line, and saves still work. The refusal is a seccomp filter in a
    child process: the machine-wide kernel.io_uring_disabled would break
    every other io_uring user while the test runs."""
    import subprocess
    import sys

    import _seccomp

    try:
        _seccomp.native_arch()
    except _seccomp.Unavailable as exc:
        pytest.skip(str(exc))
    missing = {"io_uring", "libaio"} - set(_engine.compiled_engines())
    if missing:
        pytest.skip(f"not compiled in here: {', '.join(sorted(missing))}")
    path = str(tmp_path / "a.pt")
    script = (
        "import errno, sys\n"
        f"sys.path.insert(0, {os.path.dirname(_seccomp.__file__)!r})\n"
        "import _seccomp\n"
        "try:\n"
        "    _seccomp.refuse_io_uring_setup()  # before anything could start a ring or a thread\n"
        "except _seccomp.Unavailable as exc:\n"
        "    print('seccomp unavailable:', exc)\n"
        "    sys.exit(0)\n"
        "print('raw io_uring_setup:', errno.errorcode.get(_seccomp.io_uring_setup_errno(), 'ring'))\n"
        "import logging, torch, fastpersist\n"
        "from fastpersist import _engine\n"
        "from fastpersist.options import Options\n"
        "logging.basicConfig(level=logging.INFO, stream=sys.stdout)\n"
        f"fastpersist.save({{'a': torch.arange(10)}}, {path!r})\n"
        f"fastpersist.save({{'a': torch.arange(10)}}, {path!r})\n"
        "print('auto chose', _engine._auto_kind)\n"
        "try:\n"
        "    _engine.Engine('io_uring', Options())\n"
        "    print('io_uring engine: started')\n"
        "except OSError as exc:\n"
        "    print('io_uring engine:', errno.errorcode.get(exc.errno))\n"
        f"print('loaded', torch.load({path!r})['a'].tolist())\n"
    )
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                         env={**os.environ, "FASTPERSIST_AUTOPATCH": "0"})
    assert out.returncode == 0, out.stderr
    if out.stdout.startswith("seccomp unavailable:"):
        pytest.skip(out.stdout.strip())
    # the filter is in force in the child: without these the fallback below proves nothing
    assert "raw io_uring_setup: EPERM" in out.stdout, out.stdout
    assert "io_uring engine: EPERM" in out.stdout, out.stdout
    assert "auto chose libaio" in out.stdout, out.stdout
    assert out.stdout.count("using the libaio engine (io_uring:") == 1, out.stdout
    assert f"loaded {list(range(10))}" in out.stdout, out.stdout


@pytest.fixture
def read_file(tmp_path):
    """A 3 MB file of PAYLOAD bytes, opened buffered and O_DIRECT."""
    path = tmp_path / "extents.bin"
    data = np.tile(PAYLOAD, -(-3_000_000 // len(PAYLOAD)))[:3_000_000]
    path.write_bytes(data.tobytes())
    bfd = os.open(path, os.O_RDONLY)
    dfd = os.open(path, os.O_RDONLY | os.O_DIRECT)
    yield path, data, dfd, bfd
    os.close(bfd)
    os.close(dfd)


@pytest.mark.parametrize("direct", [True, False])
def test_read_extents_scatter_with_crcs(engine, read_file, direct):
    path, data, dfd, bfd = read_file
    # sorted, disjoint ranges: adjacent, small gaps, gaps larger than a buffer, empty, at EOF
    extents, pos = [], 5
    for gap, length in [(0, 1), (0, 4095), (3, 4097), (200_000, 70_000), (1, 0), (0, 65536 * 3 + 17),
                        (7, 12), (500_000, 1_000_000)]:
        pos += gap
        extents.append((pos, length))
        pos += length
    extents.append((len(data) - 333, 333))
    destinations = [np.zeros(n + 1, dtype=np.uint8)[1:] if i % 2 else np.zeros(n, dtype=np.uint8)
                    for i, (_, n) in enumerate(extents)]  # odd ones deliberately misaligned
    table = [(d.ctypes.data, off, n) for d, (off, n) in zip(destinations, extents)]
    e = _engine.acquire(Options(engine=engine, **SMALL))
    try:
        copied, crcs = e.read_extents(dfd if direct else -1, bfd, table, str(path), checksums=True)
    finally:
        _engine.release(e)
    assert copied == sum(n for _, n in extents)
    for d, (off, n), crc in zip(destinations, extents, crcs):
        assert d.tobytes() == data[off:off + n].tobytes()
        assert crc == zlib.crc32(data[off:off + n].tobytes())


@pytest.mark.parametrize("direct", [True, False])
def test_read_extents_reports_its_progress_while_it_reads(engine, read_file, direct):
    """progress: another thread watching it during the pass sees it rise to
    the end, and each extent wholly below what it saw is already in place."""
    import ctypes
    import threading

    path, data, dfd, bfd = read_file
    sizes = [100_000] * 29 + [len(data) - 2_900_000]  # many buffers: copied out on the helper thread
    destinations = [np.zeros(n, dtype=np.uint8) for n in sizes]
    offsets = np.cumsum([0] + sizes[:-1]).tolist()
    table = [(d.ctypes.data, off, n) for d, off, n in zip(destinations, offsets, sizes)]
    progress = ctypes.c_uint64(0)
    seen, wrong, done = [], [], threading.Event()

    def watch():
        while not done.is_set():
            at = progress.value
            seen.append(at)
            wrong.extend(i for i, (off, n) in enumerate(zip(offsets, sizes))
                         if off + n <= at and destinations[i][-1] != data[off + n - 1])

    watcher = threading.Thread(target=watch)
    watcher.start()
    e = _engine.acquire(Options(engine=engine, **SMALL))
    try:
        copied, _ = e.read_extents(dfd if direct else -1, bfd, table, str(path), progress=progress)
    finally:
        done.set()
        watcher.join()
        _engine.release(e)
    assert copied == len(data) and progress.value >= len(data)
    assert seen == sorted(seen), "progress went back"
    assert not wrong, f"extents {sorted(set(wrong))} not in place below the progress seen"
    assert all(d.tobytes() == data[off:off + n].tobytes() for d, off, n in zip(destinations, offsets, sizes))


def test_read_extents_refuses_unsorted_or_overlapping(read_file):
    path, data, dfd, bfd = read_file
    dst = np.zeros(100, dtype=np.uint8)
    e = _engine.acquire(Options(**SMALL))
    try:
        for table in ([(dst.ctypes.data, 50, 10), (dst.ctypes.data, 0, 10)],
                      [(dst.ctypes.data, 0, 60), (dst.ctypes.data, 50, 10)]):
            with pytest.raises(OSError) as info:
                e.read_extents(dfd, bfd, table, str(path))
            assert info.value.errno == errno.EINVAL
    finally:
        _engine.release(e)


@pytest.mark.parametrize("present", [4000, 400_000])  # copied inline / on the copy-out thread (> 2 buffers)
def test_read_extents_short_at_end_of_file(engine, read_file, present):
    path, data, dfd, bfd = read_file
    dst = np.zeros(present + 10_000, dtype=np.uint8)
    e = _engine.acquire(Options(engine=engine, **SMALL))
    try:
        copied, crcs = e.read_extents(dfd, bfd, [(dst.ctypes.data, len(data) - present, len(dst))], str(path),
                                      checksums=True)
    finally:
        _engine.release(e)
    assert copied == present
    assert dst[:present].tobytes() == data[-present:].tobytes()
    assert not dst[present:].any()
    assert crcs == [zlib.crc32(data[-present:].tobytes())]


def test_pread_into_fresh_memory_with_prefault(engine, tmp_path):
    """Into a fresh mapping faulted in by fileio.prefaulting meanwhile (large
    enough for its threads), at an unaligned start and end."""
    from fastpersist.fileio import prefaulting

    import mmap

    size = 40 << 20
    path = tmp_path / "big.bin"
    data = np.random.default_rng(3).integers(0, 256, size + 8192, dtype=np.uint8)
    path.write_bytes(data.tobytes())
    offset = 4096 * 3 + 100
    n = size - 20_000
    memory = mmap.mmap(-1, size + 8192)
    view = np.frombuffer(memory, dtype=np.uint8)
    e = _engine.acquire(Options(engine=engine))
    bfd = os.open(path, os.O_RDONLY)
    dfd = os.open(path, os.O_RDONLY | os.O_DIRECT)
    try:
        with prefaulting([(view.ctypes.data + 100, offset, n)]):
            got = e.pread_into(dfd, bfd, view.ctypes.data + 100, n, offset, str(path))
    finally:
        os.close(bfd)
        os.close(dfd)
        _engine.release(e)
    assert got == n
    assert view[100:100 + n].tobytes() == data[offset:offset + n].tobytes()
    assert not view[:100].any() and not view[100 + n:].any()  # nothing written outside
    del view
    memory.close()


@pytest.mark.parametrize("threads", [1, 2, 3])
def test_prefaulting_brings_memory_in_without_changing_it(threads, monkeypatch):
    """fileio.prefaulting, which loads enter before taking an engine: the
    helpers fault the extents' pages in while the block runs, however many
    share the pieces, and leave what the memory holds as it was."""
    import ctypes
    import mmap
    import time

    from fastpersist import fileio
    from fastpersist.fileio import _libc, prefaulting

    import threading

    monkeypatch.setattr(fileio._Prefault, "MAX_THREADS", threads)
    monkeypatch.setattr(fileio, "_usable_cpus", lambda: 8)
    populated = []  # (address, thread) of every madvise
    real_madvise = _libc().madvise

    def counting_madvise(address, n, advice):
        populated.append((address, threading.current_thread()))  # kept: an ident is reused once a thread ends
        return real_madvise(address, n, advice)

    monkeypatch.setattr(_libc(), "madvise", counting_madvise)

    size, page = 24 << 20, mmap.PAGESIZE
    memory = mmap.mmap(-1, size)
    memory[:5] = b"keep!"  # one page already in, with data
    address = ctypes.addressof(ctypes.c_char.from_buffer(memory))
    resident = (ctypes.c_ubyte * (size // page))()

    def pages_in():
        assert _libc().mincore(address, size, resident) == 0
        return sum(b & 1 for b in resident)

    assert pages_in() < size // page // 2
    half = size // 2  # two extents, the second first in the file: pieces counted across both
    with prefaulting([(address + half, 4096, half - page), (address + page, 4096 + half, half - page)]):
        deadline = time.monotonic() + 10
        while pages_in() < size // page - 1 and time.monotonic() < deadline:
            time.sleep(0.01)
    assert pages_in() >= size // page - 1  # all but the last page, outside the extent
    assert memory[:5] == b"keep!" and not any(memory[page:size - page])
    addresses = [a for a, _ in populated]
    assert len(addresses) == len(set(addresses)) == 4  # two pieces per extent, each once
    assert len({t for _, t in populated}) == min(threads, 3)  # ~24 MiB in all: three 8 MiB stretches
    memory.close()


@pytest.mark.parametrize("first_closes", ["head", "tail"])
def test_two_writers_of_one_file_keep_each_others_bytes(engine, tmp_path, first_closes):
    """A writer that truncates and starts the file does not own its end unless
    it says so (sole_writer): the second writer's range survives either
    closing order."""
    path = tmp_path / "two.bin"
    data = PAYLOAD[:400_000]
    head = FastFileWriter(path, 0, truncate=True, engine=engine, **SMALL)
    tail = FastFileWriter(path, 150_001, engine=engine, **SMALL)
    head.write_address(data.ctypes.data, 150_001)
    tail.write_address(data[150_001:].ctypes.data, len(data) - 150_001)
    order = (head, tail) if first_closes == "head" else (tail, head)
    for w in order:
        w.close()
    assert path.read_bytes() == data.tobytes()


def test_sole_writer_cuts_the_file_to_its_end(engine, tmp_path):
    path = tmp_path / "sole.bin"
    path.write_bytes(b"\xff" * 1_000_000)
    with FastFileWriter(path, 0, sole_writer=True, engine=engine, **SMALL) as w:
        w.write(b"abc" * 100_001)
    assert path.read_bytes() == b"abc" * 100_001



@pytest.mark.parametrize("direct", [True, False])
@pytest.mark.parametrize("offset", [0, 5000])
def test_filled_requests_go_to_the_device_before_the_buffer_is_full(engine, tmp_path, direct, offset):
    """A stream queues each whole request as soon as it is filled: the
    device starts on a buffer's first bytes while the rest is copied (a
    small file's only buffer used to wait for all of its copy). Here a
    buffer is 1 MiB: its first 256 KiB reach the file while the stream is
    still open, and the whole file is right after close."""
    path = tmp_path / "eager.bin"
    data = PAYLOAD[:300_000]
    with FastFileWriter(path, offset, engine=engine, direct=direct, buffer_size=1 << 20, num_buffers=2,
                        request_size=64 << 10, queue_depth=8) as w:
        w.write_address(data.ctypes.data, len(data))
        want = data[:256 << 10].tobytes()
        for _ in range(1000):  # completion is asynchronous: up to 10 s
            with open(path, "rb") as f:
                f.seek(offset + (64 << 10))  # past a head the stream may hold back until it is aligned
                if f.read(len(want) - (64 << 10) - 4096) == want[64 << 10:-4096]:
                    break
            time.sleep(0.01)
        else:
            pytest.fail("nothing of the stream reached the file before close")
    assert path.read_bytes() == b"\0" * offset + data.tobytes()

@pytest.mark.parametrize("field, value", [
    ("buffer_size", (1 << 30) + 4096), ("request_size", (1 << 30) + 4096), ("num_buffers", 65),
    ("num_buffers", 1), ("queue_depth", 4097), ("queue_depth", 0), ("buffer_size", 0), ("request_size", 1000),
])
def test_engine_refuses_configurations_out_of_bounds(field, value):
    """The C engine checks its own bounds (32-bit io_uring lengths, stack
    arrays sized by num_buffers), whatever the Python layer allows."""
    lib, ffi = _engine._load()
    cfg = ffi.new("struct fp_config *", dict(kind=0, buffer_size=64 << 10, num_buffers=2, queue_depth=8,
                                             request_size=16 << 10, lock_memory=0))
    out = ffi.new("struct fp_engine **")
    assert lib.fp_engine_create(cfg, out) == 0
    lib.fp_engine_destroy(out[0])
    setattr(cfg, field, value)
    assert lib.fp_engine_create(cfg, out) == -errno.EINVAL
    assert out[0] == ffi.NULL
    with pytest.raises(ValueError, match=field):
        Options(**{field: value})


def test_pool_bounds_live_engines_and_waits_for_a_free_one():
    import gc
    import threading

    opts = Options(engine="psync", max_engines=1, **SMALL)
    _engine.clear_pool()
    first = _engine.acquire(opts)
    got = []
    t = threading.Thread(target=lambda: got.append(_engine.acquire(opts)))
    t.start()
    t.join(0.3)
    assert t.is_alive() and not got  # waits: one engine of this configuration at most
    _engine.release(first)
    t.join(5)
    assert got == [first]  # the released engine, not a new one
    assert _engine.pool_size() == 1
    # an engine dropped without release() stops counting: no one waits forever
    del first, got[:]
    gc.collect()
    assert _engine.pool_size() == 0
    e = _engine.acquire(opts)
    nested = _engine.acquire(opts)  # the same thread may exceed the bound: no self-deadlock
    assert e is not nested and _engine.pool_size() == 2
    _engine.release(nested)
    _engine.release(e)
    _engine.clear_pool()
    assert _engine.pool_size() == 0


@pytest.mark.parametrize("sizes", [(0, 0), (1, 0), (0, 1), (3, 5), (4096, 70_001), (1 << 20, 12_345)])
def test_crc32_combine_matches_the_crc_of_the_concatenation(sizes):
    pieces = [PAYLOAD[:sizes[0]].tobytes(), PAYLOAD[-sizes[1]:].tobytes() if sizes[1] else b""]
    combined = _engine.crc32_combine(zlib.crc32(pieces[0]), zlib.crc32(pieces[1]), len(pieces[1]))
    assert combined == zlib.crc32(pieces[0] + pieces[1])


@pytest.mark.parametrize("threads", [1, 2, 3, 64])
def test_copy_many_copies_every_item_exactly(threads):
    """fp_copy_many: items of many sizes (0, 1, odd, several MiB) laid end to
    end and shared among threads across item boundaries; every byte where
    it belongs and none outside."""
    rng = np.random.default_rng(threads)
    sizes = [0, 1, 4095, 4097, 3 << 20, 17, 5 << 20, 1 << 20, 123457]
    sources = [rng.integers(0, 256, n, dtype=np.uint8) for n in sizes]
    target = np.zeros(sum(sizes) + 64 * len(sizes), dtype=np.uint8)
    copies, at = [], 0
    for src in sources:
        copies.append((src.ctypes.data, target.ctypes.data + at, src.size))
        at += src.size + 64
    _engine.copy_many(copies, threads)
    at = 0
    for src in sources:
        assert np.array_equal(target[at:at + src.size], src)
        assert not target[at + src.size:at + src.size + 64].any()
        at += src.size + 64


def test_copy_many_refuses_a_bad_thread_count():
    with pytest.raises(OSError, match="threads=65"):
        _engine.copy_many([(1, 2, 3)], 65)
    _engine.copy_many([], 0)  # nothing to copy: nothing checked


def test_crc32_is_zlibs_with_isal_loaded_at_run_time_and_without():
    """fp_crc32 loads ISA-L (libisal.so.2) at run time where it is installed
    and runs zlib's CRC otherwise (FASTPERSIST_NO_ISAL=1 forces that here):
    the same values either way, and `crc32_implementation` says which."""
    script = ("import zlib, os\n"
              "from fastpersist import _engine\n"
              "data = os.urandom(3 << 20)\n"
              "assert _engine.crc32(data) == zlib.crc32(data)\n"
              "assert _engine.crc32(data[1000:], _engine.crc32(data[:1000])) == zlib.crc32(data)\n"
              "print(_engine.crc32_implementation())\n")
    seen = []
    for env in ({}, {"FASTPERSIST_NO_ISAL": "1"}):
        out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120,
                             env={**os.environ, "FASTPERSIST_AUTOPATCH": "0", **env})
        assert out.returncode == 0, out.stderr
        seen.append(out.stdout.strip())
    assert seen[1].startswith("zlib")
    import ctypes.util
    if ctypes.util.find_library("isal"):
        assert seen[0].startswith("ISA-L")
