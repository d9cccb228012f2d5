"""Staged reads (read_pipeline.read_pieces from the page cache): what a
load to a GPU takes when its file is cached or on tmpfs. Parallel readers
pread runs of the pieces into staging buffers and copy each buffer to its
targets while reading into their other buffer. Driven here with CPU
targets through the same code (a CPU target is copied by address, a CUDA
one on the reader's stream); the GPU itself is tested in tests/test_gpu.py.
"""
import os
import random
import signal
import threading
import time
import zlib

import pytest
import torch

import fastpersist
from fastpersist import device_io, read_pipeline
from fastpersist.device_io import Piece
from fastpersist.helper_threads import ReadStopped, StopSignal
from fastpersist.options import Options

from test_read_interrupts import HELD_FOR, assert_still

MiB = 1 << 20
SIZE = 9 * MiB + 12345
DATA = random.Random(5).randbytes(SIZE)


@pytest.fixture
def data(tmp_path):
    path = tmp_path / "data.bin"
    path.write_bytes(DATA)
    fd = os.open(path, os.O_RDONLY)
    yield str(path), fd
    os.close(fd)


def target(nbytes):
    return torch.full((nbytes,), 0xEE, dtype=torch.uint8)


# pieces that exercise every way a run is cut: tiny ones a few bytes apart (one pread for several), a gap
# larger than GATHER_GAP, a piece larger than a staging buffer, the same bytes twice (tied tensors), a piece
# overlapping another's bytes, and the file's last byte
LAYOUT = [(0, 1), (8, 100), (200, 4000), (4300, 3), (300_000, 5 * MiB + 7), (300_000, 5 * MiB + 7),
          (301_000, 10), (7 * MiB, MiB), (SIZE - 1, 1)]


@pytest.mark.parametrize("threads", [1, 3])
@pytest.mark.parametrize("stage_bytes", [MiB, 4 * MiB])
def test_every_piece_gets_its_bytes_and_its_crc(data, threads, stage_bytes):
    path, fd = data
    pieces = [Piece(offset, nbytes, target(nbytes)) for offset, nbytes in LAYOUT]
    crcs = read_pipeline._staged_read(fd, path, pieces, threads, stage_bytes, checksums=True)
    for p in pieces:
        assert bytes(p.target.numpy()) == DATA[p.offset:p.offset + p.nbytes], (p.offset, p.nbytes)
        assert crcs[p.offset, p.nbytes] == zlib.crc32(DATA[p.offset:p.offset + p.nbytes])
    assert set(crcs) == set(LAYOUT)


def test_runs_are_cut_at_the_staging_buffer_and_gathered_across_small_gaps():
    pieces = [Piece(offset, nbytes, target(nbytes)) for offset, nbytes in LAYOUT]
    chunks = read_pipeline._stage_chunks(pieces, MiB)
    assert all(0 < hi - lo <= MiB for lo, hi, _ in chunks)
    assert chunks[0][:2] == (0, 4303)  # the four small pieces, one pread
    # every byte of every piece is in exactly one chunk's parts
    for key in set(LAYOUT):
        covered = sorted((a, b) for _, _, parts in chunks for k, a, b in parts if k == key)
        assert covered[0][0] == 0 and covered[-1][1] == key[1]
        assert all(x[1] == y[0] for x, y in zip(covered, covered[1:]))
        for lo, hi, parts in chunks:
            for k, a, b in parts:
                assert lo <= k[0] + a and k[0] + b <= hi


def test_the_readers_share_the_work(data, monkeypatch):
    path, fd = data
    seen = set()
    real = read_pipeline._pread_into

    def recording(*args):
        seen.add(threading.get_ident())
        time.sleep(0.01)  # each reader holds its chunk a moment: the others take the next ones
        return real(*args)

    monkeypatch.setattr(read_pipeline, "_pread_into", recording)
    piece = Piece(0, SIZE, target(SIZE))
    read_pipeline._staged_read(fd, path, [piece], 3, MiB, checksums=False)
    assert bytes(piece.target.numpy()) == DATA
    assert len(seen) == 3


@pytest.fixture
def outstanding(monkeypatch):
    """The staging buffers taken and not given back."""
    count = [0]
    pool = device_io.staging_buffers
    take, give = pool.take, pool.give
    monkeypatch.setattr(pool, "take", lambda n, *a: (count.__setitem__(0, count[0] + n), take(n, *a))[1])
    monkeypatch.setattr(pool, "give", lambda b, *a: (count.__setitem__(0, count[0] - len(b)), give(b, *a))[1])
    return count


def test_a_file_ending_early_raises_eof_and_gives_every_buffer_back(data, outstanding):
    path, fd = data
    pieces = [Piece(0, 3 * MiB, target(3 * MiB)), Piece(SIZE - 10, 20, target(20))]
    with pytest.raises(EOFError):
        read_pipeline._staged_read(fd, path, pieces, 2, MiB, checksums=False)
    assert outstanding == [0]


def test_a_readers_error_is_raised_once_and_the_others_stop(data, monkeypatch, outstanding):
    path, fd = data
    real = read_pipeline._pread_into
    calls = []

    def failing(fd_, path_, address, offset, nbytes):
        calls.append(offset)
        if offset >= 3 * MiB:
            raise OSError(5, "Input/output error (injected)", path_)
        return real(fd_, path_, address, offset, nbytes)

    monkeypatch.setattr(read_pipeline, "_pread_into", failing)
    with pytest.raises(OSError, match="injected"):
        read_pipeline._staged_read(fd, path, [Piece(0, SIZE, target(SIZE))], 2, MiB, checksums=False)
    assert len(calls) < 9  # the chunks after the failure were not read
    assert outstanding == [0]


def test_a_set_stop_ends_the_read(data):
    path, fd = data
    stop = StopSignal()
    stop.set()
    with pytest.raises(ReadStopped):
        read_pipeline._staged_read(fd, path, [Piece(0, SIZE, target(SIZE))], 2, MiB, checksums=False, stop=stop)


@pytest.fixture
def _sigint_raises():
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, previous)


def test_an_interrupt_leaves_only_once_the_readers_have_stopped(data, monkeypatch, _sigint_raises, outstanding):
    """Helper readers held in their pread while the caller is interrupted:
    the interrupt leaves read_pieces only once they have stopped, and
    nothing writes into the targets afterwards."""
    path, fd = data
    held, go = threading.Event(), threading.Event()
    real = read_pipeline._pread_into

    def waiting(*args):
        if threading.current_thread() is not threading.main_thread():
            held.set()
            go.wait(10)
        return real(*args)

    monkeypatch.setattr(read_pipeline, "_pread_into", waiting)
    main = threading.main_thread().ident

    def interrupt():
        held.wait(10)
        time.sleep(0.1)
        signal.pthread_kill(main, signal.SIGINT)
        time.sleep(HELD_FOR)
        go.set()

    threading.Thread(target=interrupt, daemon=True).start()
    piece = Piece(0, SIZE, target(SIZE))
    with pytest.raises(KeyboardInterrupt):
        read_pipeline._staged_read(fd, path, [piece], 3, MiB, checksums=False)
    assert_still(lambda: bytes(piece.target.numpy()), "the targets")
    assert outstanding == [0]


def test_read_pieces_stages_a_cached_file_and_sends_an_uncached_one_to_the_engine(data, monkeypatch):
    path, fd = data
    calls = []
    real = read_pipeline._staged_read
    monkeypatch.setattr(read_pipeline, "_staged_read", lambda *a, **k: (calls.append("staged"), real(*a, **k))[1])
    real_engine = device_io.read_into
    monkeypatch.setattr(device_io, "read_into", lambda *a, **k: (calls.append("engine"), real_engine(*a, **k))[1])
    for cached in (True, False):
        monkeypatch.setattr(read_pipeline, "through_page_cache", lambda *a, **k: cached)
        piece = Piece(100, SIZE - 200, target(SIZE - 200))
        assert read_pipeline.read_pieces(fd, path, SIZE, Options(), [piece], checksums=True) == \
            {(100, SIZE - 200): zlib.crc32(DATA[100:SIZE - 100])}
        assert bytes(piece.target.numpy()) == DATA[100:SIZE - 100]
    assert calls == ["staged", "engine"]
    # GPUDirect Storage, where it takes a piece, reads from the engine's side: tests/test_gds_path.py


def test_staging_buffers_take_the_engines_host_memory_among_the_readers():
    options = Options(buffer_size=16 * MiB, num_buffers=4, read_threads=8)
    big = [Piece(0, 1 << 30, torch.empty(0, dtype=torch.uint8))]
    assert read_pipeline._stage_bytes(options, big) == 4 * MiB  # 64 MiB among 8 readers' 2 buffers each
    assert read_pipeline._stage_bytes(options.replace(read_threads=2), big) == 16 * MiB
    assert read_pipeline._stage_bytes(options, [Piece(0, 100_000, torch.empty(0, dtype=torch.uint8))]) == MiB
    assert read_pipeline._stage_bytes(Options(buffer_size=MiB, num_buffers=2, read_threads=8), big) == MiB


def test_staging_buffers_are_kept_for_the_next_read_and_released_on_request(data):
    path, fd = data
    device_io.staging_buffers.release()
    read_pipeline._staged_read(fd, path, [Piece(0, SIZE, target(SIZE))], 2, MiB, checksums=False)
    kept = device_io.staging_buffers.take(4, MiB, False)
    device_io.staging_buffers.give(kept, MiB, False)
    assert device_io.staging_buffers.kept_bytes() == 4 * MiB
    read_pipeline._staged_read(fd, path, [Piece(0, SIZE, target(SIZE))], 2, MiB, checksums=False)
    assert device_io.staging_buffers.kept_bytes() == 4 * MiB  # the same four, not four more
    fastpersist.release_load_memory()  # what users call to give back what loads keep
    assert device_io.staging_buffers.kept_bytes() == 0
