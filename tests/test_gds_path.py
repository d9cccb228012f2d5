"""The GPUDirect Storage data path (fastpersist.gds) on this machine: the
same Python code a GPU save and load take, driven by CPU storages whose
aligned middles a stand-in for cuFile moves with pwrite and pread (a
test-only switch). What this checks for real: where records are split, the
engine's write stream ended and begun again around each middle, the files
byte-identical to the bounce path's, CRC-32s computed by the device code
(fastpersist.device_crc, here on the CPU) and combined with the engine's,
the per-file and per-record fallbacks and their counts. The cuFile calls
themselves, and a GPU, are tested in tests/test_gpu.py."""
import importlib
import pickle
import logging
import zlib

import numpy as np
import pytest
import torch

import fastpersist
from fastpersist import FastFileWriter, _torch_api, device_crc, gds, torch_format

from conftest import SMALL, torch_save_setting

load_module = importlib.import_module("fastpersist.load")
MIDDLE = 8192  # the smallest middle taken in these tests (the library's is 1 MiB)


def state():
    g = torch.Generator().manual_seed(3)
    return {
        "big": torch.randn(300_001, generator=g),  # unaligned end
        "small": torch.randn(100, generator=g),  # no middle: through the buffers
        "ints": torch.randint(0, 1 << 30, (40_000,), dtype=torch.int64, generator=g),
        "half": torch.randn(7, 3001, generator=g).half(),
        "empty": torch.zeros(0),
        "step": 12,
    }


@pytest.fixture
def stand_in(monkeypatch):
    """CPU storages take the GDS path, their middles moved by the stand-in."""
    monkeypatch.setattr(_torch_api, "CAPTURE", "always")
    monkeypatch.setattr(torch_format, "STREAM_CPU_STORAGES", True)
    monkeypatch.setattr(load_module, "STREAM_LOADS", True)
    monkeypatch.setattr(gds, "STAND_IN_FOR_CPU", True)
    monkeypatch.setattr(gds, "MIN_BYTES", MIDDLE)
    monkeypatch.setattr(gds._HostStandIn, "FAIL_WRITE_AT", None)
    monkeypatch.setattr(gds._HostStandIn, "FAIL_READ_AT", None)
    monkeypatch.setattr(gds._HostStandIn, "REFUSE_FILES", False)
    monkeypatch.setattr(gds, "_reported", set())
    gds.reset_stats()
    yield
    gds.reset_stats()


def bounce_and_gds(tmp_path, obj, monkeypatch, **options):
    """The same save through the buffers and through the GDS path (same serialization id)."""
    monkeypatch.setattr(torch_format, "new_serialization_id", lambda: "7" * 40)
    for folder in ("bounce", "gds"):  # the same file name: torch names the records after it
        monkeypatch.setattr(gds, "STAND_IN_FOR_CPU", folder == "gds")
        (tmp_path / folder).mkdir()
        fastpersist.save(obj, tmp_path / folder / "c.pt", **SMALL, **options)
    return (tmp_path / "bounce" / "c.pt").read_bytes(), (tmp_path / "gds" / "c.pt").read_bytes()


@pytest.mark.parametrize("offset,nbytes,expected", [
    (0, 8192, (0, 8192)),
    (64, 8192 + 4032, (4032, 8192)),  # head to 4096, then two blocks
    (100, 8192, None),  # only one whole block inside
    (4096, 4096 * 3 + 5, (0, 12288)),
    (5000, 0, None),
])
def test_the_aligned_middle_of_a_record(offset, nbytes, expected):
    assert gds.aligned_middle(offset, nbytes, min_bytes=MIDDLE) == expected
    if expected:
        head, middle = expected
        assert (offset + head) % 4096 == 0 and middle % 4096 == 0 and head + middle <= nbytes


@pytest.mark.parametrize("n", [0, 1, 4095, 4096, 4097, 3 * 4096 + 11, 100_003])
def test_device_crc_is_zlibs(n):
    data = np.random.default_rng(n).integers(0, 256, size=n, dtype=np.uint8)
    for start in (0, 0xDEADBEEF):
        assert device_crc.crc32(torch.from_numpy(data), start) == zlib.crc32(data.tobytes(), start)


def test_device_crc_across_chunks(monkeypatch):
    monkeypatch.setattr(device_crc, "CHUNK", 3 * 4096)
    data = np.random.default_rng(5).integers(0, 256, size=50_001, dtype=np.uint8)
    assert device_crc.crc32(torch.from_numpy(data)) == zlib.crc32(data.tobytes())
    with pytest.raises(ValueError, match="1-D tensor of bytes"):
        device_crc.crc32(torch.zeros(4, dtype=torch.int32))


@pytest.mark.parametrize("compute_crc32", [True, False])
def test_a_gds_save_is_the_bounce_save_byte_for_byte(tmp_path, stand_in, monkeypatch, compute_crc32):
    obj = state()
    with torch_save_setting("compute_crc32", compute_crc32):
        bounce, through_gds = bounce_and_gds(tmp_path, obj, monkeypatch)
    assert through_gds == bounce
    done = gds.stats()
    assert done["bytes_written"] >= 1_000_000 and done["files"] == 1 and not done["fallbacks"]
    back = torch.load(tmp_path / "gds" / "c.pt")
    assert all(torch.equal(back[k], obj[k]) for k in ("big", "small", "ints", "half"))


def test_gds_writes_at_every_engine(tmp_path, stand_in, monkeypatch, engine):
    obj = state()
    monkeypatch.setattr(torch_format, "new_serialization_id", lambda: "7" * 40)
    for folder in ("gds", "bounce"):
        (tmp_path / folder).mkdir()
        fastpersist.save(obj, tmp_path / folder / "c.pt", engine=engine, **SMALL)
        monkeypatch.setattr(gds, "STAND_IN_FOR_CPU", False)
    assert (tmp_path / "gds" / "c.pt").read_bytes() == (tmp_path / "bounce" / "c.pt").read_bytes()
    assert gds.stats()["bytes_written"] > 0


def test_a_file_cufile_refuses_goes_through_the_buffers(tmp_path, stand_in, monkeypatch, caplog):
    monkeypatch.setattr(gds._HostStandIn, "REFUSE_FILES", True)
    caplog.set_level(logging.INFO, logger="fastpersist")
    obj = state()
    bounce, through_gds = bounce_and_gds(tmp_path, obj, monkeypatch)
    fastpersist.save(obj, tmp_path / "gds" / "again.pt", **SMALL)
    assert through_gds == bounce
    done = gds.stats()
    assert done["bytes_written"] == 0 and sum(done["fallbacks"].values()) == 2
    said = [r for r in caplog.records if "GPUDirect Storage refused" in r.getMessage()]
    # once per reason; under transfer="auto" it is information, where "gds" was asked for a warning
    assert len(said) == 1 and "cuFileHandleRegister refused the file" in said[0].getMessage()
    assert said[0].levelno == logging.INFO
    monkeypatch.setattr(gds, "_reported", set())
    fastpersist.save(obj, tmp_path / "gds" / "asked.pt", transfer="gds", **SMALL)
    said = [r for r in caplog.records if "GPUDirect Storage refused" in r.getMessage()]
    assert len(said) == 2 and said[1].levelno == logging.WARNING


def test_a_failed_middle_is_written_through_the_buffers(tmp_path, stand_in, monkeypatch):
    obj = state()
    monkeypatch.setattr(torch_format, "new_serialization_id", lambda: "7" * 40)
    monkeypatch.setattr(gds, "STAND_IN_FOR_CPU", False)
    (tmp_path / "bounce").mkdir()
    fastpersist.save(obj, tmp_path / "bounce" / "c.pt", **SMALL)
    plan = torch_format.CheckpointPlan.for_path(obj, str(tmp_path / "c.pt"), pickle, 2, False, "7" * 40)
    big, ints = (next(r for r in plan.records if r.source.nbytes == n) for n in (300_001 * 4, 40_000 * 8))
    assert big.layout.data_offset < ints.layout.data_offset  # big's middle goes first, then ints' fails
    head, _ = gds.aligned_middle(ints.layout.data_offset, ints.source.nbytes, MIDDLE)
    monkeypatch.setattr(gds._HostStandIn, "FAIL_WRITE_AT", ints.layout.data_offset + head)
    monkeypatch.setattr(gds, "STAND_IN_FOR_CPU", True)
    fastpersist.save(obj, tmp_path / "c.pt", **SMALL)
    assert (tmp_path / "c.pt").read_bytes() == (tmp_path / "bounce" / "c.pt").read_bytes()
    done = gds.stats()
    # big's middle went by GDS; the failure at ints' closed the file's handle, so the records after it
    # ("half" has a middle too) took the buffers without failing one by one
    assert done["fallbacks"] == {"cuFileWrite failed (test stand-in)": 1}
    assert done["bytes_written"] == gds.aligned_middle(big.layout.data_offset, big.source.nbytes, MIDDLE)[1]


def test_write_outside_needs_an_aligned_stream(tmp_path):
    with FastFileWriter(tmp_path / "x.bin", **SMALL) as w:
        w.write(b"abc")
        with pytest.raises(ValueError, match="not 4096-aligned"):
            w.write_outside(4096, lambda offset: None)


def test_write_outside_leaves_the_bytes_to_the_writer(tmp_path, engine):
    data = np.random.default_rng(2).integers(0, 256, size=3 * 4096 + 100, dtype=np.uint8).tobytes()
    path = tmp_path / "x.bin"
    with FastFileWriter(path, engine=engine, sole_writer=True, expected_size=len(data), **SMALL) as w:
        w.write(data[:4096])

        def put(offset):
            with open(path, "r+b") as f:
                f.seek(offset)
                f.write(data[offset:offset + 8192])

        w.write_outside(8192, put)
        assert w.tell() == 3 * 4096
        with pytest.raises(RuntimeError, match="refused"):
            w.write_outside(100, lambda offset: (_ for _ in ()).throw(RuntimeError("refused")))
        assert w.tell() == 3 * 4096  # the stream begins again where it stood
        w.write(data[3 * 4096:])
    assert path.read_bytes() == data


@pytest.mark.parametrize("how", ["load", "load_into"])
@pytest.mark.parametrize("verify", [False, True])
def test_a_gds_load_reads_the_middles(tmp_path, stand_in, monkeypatch, how, verify):
    obj = state()
    torch.save(obj, tmp_path / "c.pt")
    if how == "load":
        back = fastpersist.load(tmp_path / "c.pt", verify=verify)
    else:
        back = {k: torch.empty_like(v) if isinstance(v, torch.Tensor) else v for k, v in obj.items()}
        fastpersist.load_into(back, tmp_path / "c.pt", verify=verify)
    for k in ("big", "small", "ints", "half"):
        assert torch.equal(back[k], obj[k])
    assert gds.stats()["bytes_read"] >= 1_000_000


def test_verify_finds_a_flipped_byte_in_a_middle(tmp_path, stand_in):
    obj = state()
    torch.save(obj, tmp_path / "c.pt")
    raw = bytearray((tmp_path / "c.pt").read_bytes())
    where = bytes(raw).find(obj["big"].numpy().tobytes()[:64]) + 600_000  # inside big's middle
    raw[where] ^= 1
    (tmp_path / "c.pt").write_bytes(raw)
    assert fastpersist.load(tmp_path / "c.pt")["big"].numpy().tobytes() != obj["big"].numpy().tobytes()
    with pytest.raises(fastpersist.CheckpointError, match="CRC"):
        fastpersist.load(tmp_path / "c.pt", verify=True)
    assert gds.stats()["bytes_read"] > 0


def test_a_failed_middle_read_goes_through_the_buffers(tmp_path, stand_in, monkeypatch):
    obj = state()
    torch.save(obj, tmp_path / "c.pt")
    plan = torch_format.CheckpointPlan.for_path(obj, str(tmp_path / "c.pt"), pickle,
                                                2, False, "7" * 40)
    big = next(r for r in plan.records if r.source.nbytes == 300_001 * 4)
    head, _ = gds.aligned_middle(big.layout.data_offset, big.source.nbytes, MIDDLE)
    monkeypatch.setattr(gds._HostStandIn, "FAIL_READ_AT", big.layout.data_offset + head)
    back = fastpersist.load(tmp_path / "c.pt", verify=True)
    assert torch.equal(back["big"], obj["big"]) and torch.equal(back["ints"], obj["ints"])
    assert torch.equal(back["half"], obj["half"])
    # the first middle failed: the file's handle closed, and its later middles came through the buffers
    assert gds.stats()["fallbacks"] == {"cuFileRead failed (test stand-in)": 1}
    assert gds.stats()["bytes_read"] == 0


def test_a_middle_another_piece_shares_goes_through_the_buffers(stand_in):
    """Tied tensors share file bytes: GDS reads a piece's middle only where no
    other piece needs those bytes (the engine then reads them for both)."""
    from fastpersist.device_io import Piece, _direct_middles

    def piece(offset, nbytes):
        return Piece(offset, nbytes, torch.empty(nbytes, dtype=torch.uint8))

    pieces = [piece(0, 40960),          # 0: middle [0, 40960)
              piece(0, 40960),          # 1: the same bytes (tied): neither takes GDS
              piece(65536, 40000),      # 2: middle [65536, 102400)
              piece(65536 + 100, 50),   # 3: inside 2's middle: 2 goes through the buffers
              piece(131072, 32768 + 10),  # 4: middle [131072, 163840)
              piece(163840, 5),         # 5: shares only 4's tail: 4 keeps its middle
              piece(200000, 100)]       # 6: too small for a middle
    assert _direct_middles(pieces, "auto", False) == {4: (0, 32768)}
    assert _direct_middles([pieces[0], pieces[2]], "auto", False) == {0: (0, 40960), 1: (0, 36864)}


def test_device_crc_without_device_memory_takes_the_host(monkeypatch):
    def no_memory(chunk):
        raise torch.OutOfMemoryError("CUDA out of memory (simulated)")

    monkeypatch.setattr(device_crc, "CHUNK", 3 * 4096)
    data = np.random.default_rng(9).integers(0, 256, size=20_000, dtype=np.uint8)
    calls = []
    real = device_crc._register
    # the second chunk finds no memory: the others are computed by the device code
    monkeypatch.setattr(device_crc, "_register",
                        lambda chunk: (calls.append(1), no_memory(chunk) if len(calls) == 2 else real(chunk))[1])
    assert device_crc.crc32(torch.from_numpy(data), 7) == zlib.crc32(data.tobytes(), 7)
    assert len(calls) == 2


@pytest.mark.parametrize("options", [dict(direct=False), dict(atomic=False), dict(atomic=False, direct=False),
                                     dict(fsync=False, request_size=4096, buffer_size=8192)])
def test_gds_writes_under_other_options(tmp_path, stand_in, monkeypatch, options):
    """Buffered descriptors, a file written in place (not the sole-writer
    temporary), tiny buffers: the same bytes as the bounce path."""
    obj = state()
    (tmp_path / "gds").mkdir()
    (tmp_path / "gds" / "c.pt").write_bytes(b"an older, longer checkpoint" * 200_000)  # replaced in place
    monkeypatch.setattr(torch_format, "new_serialization_id", lambda: "7" * 40)
    fastpersist.save(obj, tmp_path / "gds" / "c.pt", **{**SMALL, **options})
    monkeypatch.setattr(gds, "STAND_IN_FOR_CPU", False)
    (tmp_path / "bounce").mkdir()
    fastpersist.save(obj, tmp_path / "bounce" / "c.pt", **{**SMALL, **options})
    assert (tmp_path / "gds" / "c.pt").read_bytes() == (tmp_path / "bounce" / "c.pt").read_bytes()
    assert gds.stats()["bytes_written"] > 0
