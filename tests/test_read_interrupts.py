"""No reader writes after its load has returned or raised: an interrupt
(SIGINT's KeyboardInterrupt) delivered while a read's helper threads are
starting, while the caller waits for them, or in the middle of a read
leaves only once every reader has stopped, and is itself raised. Readers
are held at their next piece by a test hook (a slow device, made
deterministic) and let go after the interrupt: whatever they write then
must land before the exception leaves, never after.

Also: safe_open.close() waits for the piece its reader is on, not its whole
read-ahead run; the engine's read stops at its stop signal; and the patched
load_file of a cached file is safetensors' own mapping of the file whose
header it read."""
import ctypes
import mmap
import os
import random
import signal
import threading
import time

import pytest
import torch

import fastpersist
from conftest import evicted
import fastpersist.safetensors as fast_st
from fastpersist import _engine, read_pipeline
from fastpersist.options import Options

MiB = 1 << 20
HELD_FOR = 0.3  # how long held readers are kept after the interrupt


@pytest.fixture(autouse=True)
def _sigint_raises():
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, previous)


class Held:
    """Readers on threads other than the main one wait at their next piece
    (or engine read) until let go (``held`` is set once one waits); with ``main=True`` the
    main thread's own pieces wait too (an interrupt lands there)."""

    def __init__(self, monkeypatch, main: bool = False):
        self.held = threading.Event()
        self.go = threading.Event()
        real = read_pipeline._pread_run

        def waiting(*args, **kwargs):
            if main or threading.current_thread() is not threading.main_thread():
                self.held.set()
                self.go.wait(10)
            return real(*args, **kwargs)

        monkeypatch.setattr(read_pipeline, "_pread_run", waiting)
        real_engine = _engine.Engine.read_extents

        def engine_waiting(*args, **kwargs):
            if threading.current_thread() is not threading.main_thread():
                self.held.set()
                self.go.wait(10)
            return real_engine(*args, **kwargs)

        monkeypatch.setattr(_engine.Engine, "read_extents", engine_waiting)


def interrupt(when: threading.Event, held: Held, count: int = 1, after: float = 0.1) -> threading.Thread:
    """Sends SIGINT to the main thread count times (after seconds once
    ``when`` is set, then 50 ms apart), then lets the held readers go
    HELD_FOR seconds later."""
    main = threading.main_thread().ident

    def run():
        when.wait(10)
        time.sleep(after)
        for _ in range(count):
            signal.pthread_kill(main, signal.SIGINT)
            time.sleep(0.05)
        time.sleep(HELD_FOR)
        held.go.set()

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


def start_interrupted(monkeypatch, held: Held):
    """Thread.start of fastpersist's reader threads starts the thread, then
    raises KeyboardInterrupt (as a Ctrl-C landing in its wait for the new
    thread to run), once; the held readers are let go HELD_FOR later."""
    real = threading.Thread.start
    fired = []

    def start(self):
        real(self)
        if self.name.startswith("fastpersist-read") and not fired:
            fired.append(self)
            threading.Timer(HELD_FOR, held.go.set).start()
            raise KeyboardInterrupt

    monkeypatch.setattr(threading.Thread, "start", start)


def no_reader_alive() -> list:
    readers = ("fastpersist-read", "fastpersist-load", "fastpersist-prefault", "fastpersist-safetensors-reader")
    return [t.name for t in threading.enumerate() if t.name in readers]


def assert_still(read_bytes, what: str) -> None:
    """No reader is left (a thread that has stopped working may take a few
    ms to end; a held one is held HELD_FOR), and nothing changes
    read_bytes() any more. (A reader left over often fails in its pread
    instead of writing: the load has closed its descriptor. It writes where
    the next load has opened a file under the same number by then.)"""
    deadline = time.monotonic() + HELD_FOR / 3
    while no_reader_alive() and time.monotonic() < deadline:
        time.sleep(0.005)
    assert not no_reader_alive(), f"a reader outlived the load: {no_reader_alive()}"
    before = read_bytes()
    time.sleep(HELD_FOR + 0.4)
    assert read_bytes() == before, f"a reader wrote into {what} after the load had raised"
    assert not no_reader_alive(), no_reader_alive()


def _file(path, size, seed=0):
    path.write_bytes(random.Random(seed).randbytes(size))
    return path




def _interrupt_at(where, monkeypatch):
    """A Held hook and the interrupt for where: "start" (in Thread.start),
    "join" (while the caller waits for its helpers), "middle" (in the
    caller's own piece)."""
    held = Held(monkeypatch, main=where == "middle")
    if where == "start":
        start_interrupted(monkeypatch, held)
    else:  # "join": once the caller has read the pieces not held (a few 8 MiB pieces here take < 0.1 s)
        interrupt(held.held, held, after=0.5 if where == "join" else 0.1)
    return held


@pytest.mark.parametrize("where", ["start", "join", "middle"])
def test_page_cache_readers_stop_before_the_interrupt_leaves(folder, monkeypatch, where):
    size = 48 * MiB
    path = _file(folder / "data.bin", size)
    memory = mmap.mmap(-1, size)
    base = ctypes.addressof(ctypes.c_char.from_buffer(memory))
    _interrupt_at(where, monkeypatch)
    fd = os.open(path, os.O_RDONLY)
    try:
        with pytest.raises(KeyboardInterrupt):
            read_pipeline.pread_extents(fd, str(path), [(base, 0, size)], False, threads=4)
        assert_still(lambda: memory[:], "the destination")
    finally:
        os.close(fd)


@pytest.mark.parametrize("where", ["start", "join"])
def test_both_ways_readers_stop_before_the_interrupt_leaves(folder, monkeypatch, page_cache_reads, where):
    """A partly cached file: its cached spans read on a thread of their own
    (held), the rest by the engine on the caller's."""
    size = 48 * MiB
    path = _file(folder / "data.bin", size, 1)
    if not evicted(path):
        pytest.skip("this filesystem keeps the file in the page cache")
    fd = os.open(path, os.O_RDONLY)
    try:
        os.pread(fd, 16 * MiB, 16 * MiB)  # a third of the file in the page cache
        _engine.release(_engine.acquire(Options()))  # an engine idle
        memory = mmap.mmap(-1, size)
        base = ctypes.addressof(ctypes.c_char.from_buffer(memory))
        _interrupt_at(where, monkeypatch)
        with pytest.raises(KeyboardInterrupt):
            read_pipeline.read_extents(fd, str(path), size, Options(), [(base, 0, size)], False)
        assert_still(lambda: memory[:], "the destination")
    finally:
        os.close(fd)


@pytest.mark.parametrize("where", ["start", "join"])
def test_an_interrupted_load_file_leaves_the_next_loads_image_alone(folder, monkeypatch, page_cache_reads, where):
    """The issue's case: load_file's image goes back to the pool when the
    load raises; the next load takes it. A reader left running would write
    the first file's bytes over the second's tensors."""
    names = [f"t{i}" for i in range(12)]
    fast_st.save_file({n: torch.full((1 << 21,), float(i + 1)) for i, n in enumerate(names)},
                      folder / "a.safetensors")
    fast_st.save_file({n: torch.zeros(1 << 21) for n in names}, folder / "b.safetensors")
    for name in ("a.safetensors", "b.safetensors"):
        (folder / name).read_bytes()  # cached: read by the page-cache readers
    _interrupt_at(where, monkeypatch)
    with pytest.raises(KeyboardInterrupt):
        fast_st.load_file(folder / "a.safetensors", backend="pread")
    monkeypatch.undo()  # the next load's readers are not held (a reader still held is let go on its timer)
    second = fast_st.load_file(folder / "b.safetensors", backend="pread")
    assert_still(lambda: b"".join(t.numpy().tobytes() for t in second.values()), "the next load's tensors")
    assert all(not t.any() for t in second.values())


@pytest.mark.parametrize("where", ["start", "join", "middle"])
def test_an_interrupted_load_into_stops_writing_into_the_callers_tensors(folder, monkeypatch, page_cache_reads,
                                                                        where):
    state = {f"w{i}": torch.full((1 << 20,), float(i + 1)) for i in range(16)}
    fastpersist.save(state, folder / "s.pt")
    (folder / "s.pt").read_bytes()
    fastpersist.save({k: torch.zeros_like(v) for k, v in state.items()}, folder / "zeros.pt")
    (folder / "zeros.pt").read_bytes()
    target = {k: torch.zeros_like(v) for k, v in state.items()}
    _interrupt_at(where, monkeypatch)
    with pytest.raises(KeyboardInterrupt):
        fastpersist.load_into(target, folder / "s.pt")
    monkeypatch.undo()
    second = fastpersist.load(folder / "zeros.pt")  # the interrupted load's image memory, from the pool
    assert_still(lambda: b"".join(t.numpy().tobytes() for t in list(target.values()) + list(second.values())),
                 "the caller's tensors or the next load's")
    assert all(not t.any() for t in second.values())


@pytest.mark.parametrize("cached", [True, False], ids=["page-cache", "engine"])
def test_a_load_interrupted_twice_stops_its_read_before_leaving(folder, monkeypatch, cached):
    """fastpersist.load reads the file on a thread while it unpickles; two
    interrupts, one in each of its waits for that thread, still leave only
    once the read has stopped."""
    if cached:
        monkeypatch.setattr(read_pipeline, "CACHED_ENOUGH", 0.9)
    state = {f"w{i}": torch.full((1 << 20,), float(i + 1)) for i in range(24)}
    fastpersist.save(state, folder / "s.pt")
    (folder / "s.pt").read_bytes()
    held = Held(monkeypatch)
    interrupt(held.held, held, count=2)
    memory = []
    real = fastpersist.load_memory.image_memory
    monkeypatch.setattr(fastpersist.load_memory, "image_memory",
                        lambda size: (lambda got: (memory.append(got[0]), got)[1])(real(size)))
    with pytest.raises(KeyboardInterrupt):
        fastpersist.load(folder / "s.pt")
    image = memory[0]
    assert_still(lambda: image[:] if not image.closed else b"", "the load's image")


def test_the_engine_stops_at_its_stop_signal(folder):
    """fp_read_extents_until: a stop set while it reads ends it before the
    next buffer with ECANCELED; nothing is written into the destination
    after it returns; a stop set before reads nothing."""
    from fastpersist.helper_threads import StopSignal

    size = 128 * MiB
    path = _file(folder / "data.bin", size, 2)
    evicted(path)
    memory = mmap.mmap(-1, size)
    base = ctypes.addressof(ctypes.c_char.from_buffer(memory))
    opts = Options(buffer_size=64 << 10, num_buffers=2, request_size=64 << 10)  # 2048 passes: time to stop it
    stop = StopSignal()
    progress = ctypes.c_uint64(0)
    fd = os.open(path, os.O_RDONLY)
    try:
        engine = _engine.acquire(opts)
        try:
            def stop_soon():
                while progress.value < 4 * MiB:
                    time.sleep(0.0005)
                stop.set()

            threading.Thread(target=stop_soon, daemon=True).start()
            with pytest.raises(OSError) as raised:
                engine.read_extents(-1, fd, [(base, 0, size)], str(path), progress=progress, stop=stop.word)
            import errno

            assert raised.value.errno == errno.ECANCELED
            after = memory[:]
            assert after[-MiB:] == bytes(MiB), "stopped, yet the read went on to the end"
            time.sleep(0.2)
            assert memory[:] == after
            untouched = mmap.mmap(-1, 4096)
            with pytest.raises(OSError):
                engine.read_extents(-1, fd, [(ctypes.addressof(ctypes.c_char.from_buffer(untouched)), 0, 4096)],
                                    str(path), stop=stop.word)
            assert untouched[:] == bytes(4096)
            copied, _ = engine.read_extents(-1, fd, [(base, 0, 4096)], str(path))  # the engine is usable again
            assert copied == 4096
        finally:
            _engine.release(engine)
    finally:
        os.close(fd)


def test_safe_open_close_waits_for_a_piece_not_the_read_ahead(folder, monkeypatch, page_cache_reads):
    """close() while the reader reads ahead: it stops at its next piece, so
    the pieces read after close() began are those already in hand."""
    names = [f"t{i}" for i in range(8)]
    fast_st.save_file({n: torch.full((4 << 20,), float(i)) for i, n in enumerate(names)}, folder / "m.safetensors")
    (folder / "m.safetensors").read_bytes()  # cached: the page-cache readers, 8 MiB pieces
    closing = threading.Event()
    after_close = []
    real = read_pipeline._pread_run

    def slow(fd, path, run, *args, **kwargs):
        if closing.is_set():
            after_close.append(run[0][1])
        time.sleep(0.02)  # a slow device: the run ahead takes a while
        return real(fd, path, run, *args, **kwargs)

    monkeypatch.setattr(read_pipeline, "_pread_run", slow)
    opened = fast_st.safe_open(folder / "m.safetensors", framework="pt")
    opened.get_tensor("t0")  # starts the reader on the chunks ahead
    time.sleep(0.03)
    closing.set()
    started = time.perf_counter()
    opened.close()
    waited = time.perf_counter() - started
    threads = read_pipeline.read_threads(fastpersist.options.current_options())
    assert len(after_close) <= threads, (after_close, waited)


def test_the_patched_load_file_of_a_cached_file_is_safetensors_own_mapping(folder, page_cache_reads):
    """Patched or not, load_file of a cached file maps it (a /proc/self/maps
    entry) and a later write to the file shows in its tensors as it does
    in stock safetensors'."""
    import safetensors.torch as reference

    path = folder / "m.safetensors"
    reference.save_file({"x": torch.zeros(1 << 20), "y": torch.ones(16)}, path)
    path.read_bytes()
    seen = {}
    for patched in (False, True):
        if patched:
            fastpersist.patch()
        else:
            fastpersist.unpatch()
        loaded = reference.load_file(path)
        with open("/proc/self/maps") as maps:
            assert any(line.rstrip().endswith(str(path)) for line in maps), f"patched={patched}: not mapped"
        fd = os.open(path, os.O_WRONLY)
        try:
            os.pwrite(fd, b"\x00\x00\x80\x3f", 8 + len(path.read_bytes()[8:].split(b"}")[0]) + 1)
        finally:
            os.close(fd)
        seen[patched] = loaded["x"][0].item()
        reference.save_file({"x": torch.zeros(1 << 20), "y": torch.ones(16)}, path)
        path.read_bytes()
        del loaded
    fastpersist.unpatch()
    assert seen[True] == seen[False]


def test_a_file_renamed_over_between_header_and_mapping_is_not_mixed(folder, monkeypatch, page_cache_reads):
    """verify=True reads the header (and its checksums) from the open file;
    the mapping must be of that same file, not of whatever the name names
    by then."""
    path = folder / "m.safetensors"
    fast_st.save_file({"x": torch.arange(1000.0)}, path, checksums=True)
    fast_st.save_file({"other": torch.ones(10)}, folder / "new.safetensors", checksums=True)
    path.read_bytes()
    real = fast_st._mapped_as_safetensors_maps

    def replaced_meanwhile(fd, size):
        os.replace(folder / "new.safetensors", path)  # a save of the next checkpoint lands now
        return real(fd, size)

    monkeypatch.setattr(fast_st, "_mapped_as_safetensors_maps", replaced_meanwhile)
    out = fast_st.load_file(path, verify=True)
    assert list(out) == ["x"] and torch.equal(out["x"], torch.arange(1000.0))
