"""safetensors files through fastpersist (fastpersist.safetensors), against
the installed safetensors: the same bytes (golden: safetensors' own output
for each case), each library loading the other's files bit-exactly, the
same refusals, clean errors for broken files, atomic saves, and
transformers / accelerate through the patch with no code change."""
import json
import os
import struct
import subprocess
import sys

import pytest
import torch

st = pytest.importorskip("safetensors.torch", reason="safetensors is not installed")
import safetensors  # noqa: E402

import fastpersist  # noqa: E402
from fastpersist import safetensors as fst  # noqa: E402
from fastpersist.safetensors import SafetensorsFileError  # noqa: E402

from conftest import leftovers  # noqa: E402

# the originals, whatever the patch has done to the names
ORIGINAL_SAVE_FILE = getattr(st, "_fastpersist_original_save_file", st.save_file)
ORIGINAL_LOAD_FILE = getattr(st, "_fastpersist_original_load_file", st.load_file)
ORIGINAL_SAFE_OPEN = getattr(safetensors, "_fastpersist_original_safe_open", safetensors.safe_open)


def of_dtype(dtype, shape, seed=0):
    g = torch.Generator().manual_seed(seed)
    n = 1
    for d in shape:
        n *= d
    if dtype.itemsize == 1 and dtype != torch.bool:  # float8, float4 pairs, int8, uint8: any byte
        return torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g).view(dtype).reshape(shape)
    if dtype == torch.bool:
        return (torch.randint(0, 2, shape, generator=g) == 1)
    if dtype.is_complex:
        return torch.randn(shape, dtype=dtype, generator=g)
    if dtype.is_floating_point:
        return torch.randn(shape, generator=g).to(dtype)
    return torch.randint(0, 100, shape, generator=g).to(dtype)


DTYPES = [d for d in st._SIZE if isinstance(d, torch.dtype)]


def corpus():
    """(name, tensors, metadata) cases."""
    cases = [("every dtype", {f"t_{str(d)[6:]}": of_dtype(d, (3, 4), i) for i, d in enumerate(DTYPES)}, None)]
    cases.append(("0-d and empty", {"scalar": torch.tensor(2.5), "empty": torch.zeros(0, 3), "none": torch.zeros(0),
                                    "i": torch.tensor(7, dtype=torch.int64)}, {"format": "pt"}))
    cases.append(("unicode names and metadata", {"gewicht.ü": torch.ones(2), "名前": torch.arange(3), "a\"b\\c": torch.zeros(1)},
                  {"note": "ünïcode \" \\ \n ✓"}))
    g = torch.Generator().manual_seed(3)
    layout = {}
    for layer in range(4):  # a GPT-2-like block layout, bf16 and f32 mixed
        p = f"transformer.h.{layer}."
        layout[p + "ln_1.weight"] = torch.randn(64, generator=g)
        layout[p + "ln_1.bias"] = torch.randn(64, generator=g)
        layout[p + "attn.c_attn.weight"] = torch.randn(64, 192, generator=g).bfloat16()
        layout[p + "attn.c_attn.bias"] = torch.randn(192, generator=g).bfloat16()
        layout[p + "mlp.c_fc.weight"] = torch.randn(64, 256, generator=g).bfloat16()
    layout["transformer.wte.weight"] = torch.randn(500, 64, generator=g)
    cases.append(("gpt2-like", layout, {"format": "pt"}))
    cases.append(("no tensors", {}, {"format": "pt"}))
    return cases


CASES = corpus()


def raw_bytes(t):
    return t.contiguous().reshape(-1).view(torch.uint8) if t.numel() else torch.zeros(0, dtype=torch.uint8)


def assert_same(a: dict, b: dict):
    assert list(sorted(a)) == list(sorted(b))
    for k in a:
        assert a[k].dtype == b[k].dtype and a[k].shape == b[k].shape, k
        assert torch.equal(raw_bytes(a[k]), raw_bytes(b[k])), k


@pytest.mark.parametrize("name,tensors,metadata", CASES, ids=[c[0] for c in CASES])
def test_files_are_safetensors_own_bytes(tmp_path, name, tensors, metadata):
    ours, theirs = tmp_path / "ours.safetensors", tmp_path / "theirs.safetensors"
    fst.save_file(tensors, ours, metadata=metadata)
    ORIGINAL_SAVE_FILE(tensors, str(theirs), metadata=metadata)
    assert ours.read_bytes() == theirs.read_bytes()
    assert fst.save(tensors, metadata) == st.save(tensors, metadata)
    # each loads the other's file, bit for bit
    assert_same(fst.load_file(theirs), tensors)
    assert_same(ORIGINAL_LOAD_FILE(str(ours)), tensors)
    assert_same(fst.load(theirs.read_bytes()), tensors)
    assert leftovers(tmp_path) == []


def test_metadata_of_several_keys(tmp_path):
    """safetensors writes several metadata keys in an order that changes from
    process to process (a hash map's); everything else is its bytes."""
    tensors = {"w": torch.randn(10), "b": torch.zeros(3, dtype=torch.int32)}
    metadata = {"format": "pt", "step": "100", "z": "last"}
    ours = fst.save(tensors, metadata)
    theirs = st.save(tensors, metadata)
    n_ours, n_theirs = struct.unpack("<Q", ours[:8])[0], struct.unpack("<Q", theirs[:8])[0]
    assert n_ours == n_theirs and ours[8 + n_ours:] == theirs[8 + n_theirs:]
    assert json.loads(ours[8:8 + n_ours]) == json.loads(theirs[8:8 + n_theirs])
    with fst.safe_open(_write(tmp_path / "m.safetensors", ours)) as f:
        assert f.metadata() == metadata


def test_the_data_section_can_begin_on_a_page(tmp_path):
    tensors = {"w": torch.randn(1000), "h": torch.randn(7).half()}
    path = tmp_path / "p.safetensors"
    fst.save_file(tensors, path, metadata={"format": "pt"}, align=4096)
    (n,) = struct.unpack("<Q", path.read_bytes()[:8])
    assert (8 + n) % 4096 == 0
    assert_same(ORIGINAL_LOAD_FILE(str(path)), tensors)
    assert_same(fst.load_file(path), tensors)
    with pytest.raises(ValueError, match="align=12"):
        fst.save_file(tensors, path, align=12)


def _write(path, data):
    path.write_bytes(data)
    return path


@pytest.mark.parametrize("index", [(), (slice(None),), (Ellipsis,), (slice(1, 3),), (slice(2, None), 1),
                                   (slice(None), slice(0, 2)), (1,), (-1, slice(1, 3)), (slice(0, 4, 2),),
                                   (slice(5, 1),)])
def test_slices_are_safetensors_slices(tmp_path, index):
    tensors = {"m": torch.arange(40, dtype=torch.float32).reshape(4, 10), "s": torch.tensor(3.0)}
    path = _write(tmp_path / "s.safetensors", st.save(tensors))
    with ORIGINAL_SAFE_OPEN(str(path), framework="pt") as theirs, fst.safe_open(path, framework="pt") as ours:
        assert ours.keys() == theirs.keys() and ours.metadata() == theirs.metadata()
        a, b = ours.get_slice("m"), theirs.get_slice("m")
        assert a.get_shape() == b.get_shape() and a.get_dtype() == b.get_dtype()
        key = index if index != () else Ellipsis
        assert torch.equal(a[key], b[key])
        assert torch.equal(ours.get_tensor("s"), theirs.get_tensor("s"))
        with pytest.raises(KeyError, match="nope"):
            ours.get_tensor("nope")


def test_tensors_handed_out_twice_share_no_memory(tmp_path):
    """Each get_tensor or slice is memory of its own (safetensors' mmap
    backend hands a name asked twice one memory; fastpersist's chunks are
    let go of once handed out): writing into one changes no other (the
    first is a view of the file's read, a repeat or an overlapping slice a
    copy)."""
    tensors = {"m": torch.arange(40, dtype=torch.float32).reshape(4, 10), "v": torch.ones(8)}
    path = _write(tmp_path / "s.safetensors", st.save(tensors))
    with fst.safe_open(path, framework="pt") as f:
        first, again = f.get_tensor("m"), f.get_tensor("m")
        rows = f.get_slice("m")[1:3]
        other = f.get_tensor("v")
        first.zero_()
        assert torch.equal(again, tensors["m"]) and torch.equal(rows, tensors["m"][1:3])
        assert torch.equal(other, tensors["v"])
        assert first.untyped_storage().data_ptr() != again.untyped_storage().data_ptr()


def reads_of(monkeypatch, chunk: int, ahead: int = 1 << 30) -> list:
    """safe_open reading every file in chunks of about chunk bytes, holding at
    most ahead bytes read ahead; returns the list each read appends
    (thread name, offset, bytes) to: a pass of the reader over chunks, or a
    read of a caller's own bytes."""
    import threading

    monkeypatch.setattr(fst, "CHUNK", chunk)
    monkeypatch.setattr(fst, "AHEAD", ahead)
    reads = []
    real_run, real_span = fst._read_run, fst._read_span

    def run(fd, path, extents, progress, opts, *rest):
        reads.append((threading.current_thread().name, extents[0][1], sum(e[2] for e in extents)))
        return real_run(fd, path, extents, progress, opts, *rest)

    def span(fd, path, offset, nbytes, opts):
        reads.append((threading.current_thread().name, offset, nbytes))
        return real_span(fd, path, offset, nbytes, opts)

    monkeypatch.setattr(fst, "_read_run", run)
    monkeypatch.setattr(fst, "_read_span", span)
    return reads


def read_each(f, tensors: dict, names) -> int:
    """Reads the named tensors from an open safe_open in that order, each equal
    to the one saved; returns the size of the file's data section."""
    for name in names:
        assert torch.equal(f.get_tensor(name), tensors[name]), name
    return os.path.getsize(f.path) - f._header.data_start


def read_once_each(reads: list, data_start: int, data: int) -> None:
    """The reads cover the data section exactly: every byte once."""
    spans = sorted((offset, offset + nbytes) for _, offset, nbytes in reads)
    assert spans[0][0] == data_start and spans[-1][1] == data_start + data, spans
    assert all(a[1] == b[0] for a, b in zip(spans, spans[1:])), spans


def test_a_slice_of_rows_reads_those_rows_only(tmp_path, monkeypatch):
    """A slice reads its rows, never the chunk around them (one slice of a
    50 GB shard reads that slice). Rows from a chunk held (read, some of its
    tensors not yet handed out) are copied from it with no read; once a
    chunk's tensors are all handed out it is let go of, and rows are read
    for themselves. Either way a slice shares no memory with the tensor."""
    tensors = {"big": torch.randn(1000, 256), "next": torch.randn(64), "rows": torch.randn(16, 4)}
    path = tmp_path / "big.safetensors"
    fst.save_file(tensors, path)
    reads = reads_of(monkeypatch, 200 * 1024)
    with fst.safe_open(path) as f:
        start = f._header.data_start + f._header.entries["big"].begin
        rows = f.get_slice("big")[10:20]
        more = f.get_slice("big")[20:30]
        assert [(o, n) for _, o, n in reads] == [(start + 10 * 1024, 10 * 1024), (start + 20 * 1024, 10 * 1024)]
        assert torch.equal(rows, tensors["big"][10:20]) and torch.equal(more, tensors["big"][20:30])
        reads.clear()
        assert torch.equal(f.get_tensor("next"), tensors["next"])  # reads the chunk "next" and "rows" share
        assert len(reads) == 1
        copied = f.get_slice("rows")[3:5]
        assert len(reads) == 1 and torch.equal(copied, tensors["rows"][3:5])
        whole = f.get_tensor("rows")
        whole.zero_()
        assert torch.equal(copied, tensors["rows"][3:5]), "a slice shares memory with the tensor"
        reads.clear()
        big = f.get_tensor("big")  # its own chunk, let go of once handed out
        again = f.get_slice("big")[5:7]
        assert [n for _, _, n in reads] == [1000 * 1024, 2 * 1024], reads
        big.zero_()
        assert torch.equal(again, tensors["big"][5:7])


@pytest.mark.parametrize("through", ["engine", "page cache"])
def test_names_asked_for_from_threads_in_any_order_read_each_byte_once(tmp_path, monkeypatch, through):
    """safetensors orders a file by dtype, then name; transformers asks for
    names in its own order (layer 2 before layer 10), from several threads.
    Each byte is read once, by the reader thread, whatever the order; the
    same through the engine's passes (their progress) as through the page
    cache (this file is there: the engine is made to read it)."""
    import random
    import threading
    from concurrent.futures import ThreadPoolExecutor

    if through == "engine":
        monkeypatch.setattr(fst, "_through_page_cache", lambda *args: False)

    tensors = {}
    for i in range(40):
        tensors[f"layer.{i}.norm"] = torch.randn(256)  # float32: the first group in the file
        tensors[f"layer.{i}.weight"] = torch.randn(256, 64).to(torch.bfloat16)
    path = tmp_path / "mixed.safetensors"
    fst.save_file(tensors, path)
    names = sorted(tensors, key=lambda n: (int(n.split(".")[1]), n))
    for order in (names, random.Random(7).sample(names, len(names))):
        reads = reads_of(monkeypatch, 64 << 10)
        with fst.safe_open(path) as f, ThreadPoolExecutor(4) as pool:
            got = dict(zip(order, pool.map(f.get_tensor, order)))
            data = os.path.getsize(path) - f._header.data_start
            read_once_each(reads, f._header.data_start, data)
            assert all(who == "fastpersist-safetensors-reader" for who, _, _ in reads), reads
            assert all(c.state == fst._Chunk.DONE and c.buffer is None for c in f._chunks)
        assert all(torch.equal(got[n], tensors[n]) for n in names)
    assert not any(t.name == "fastpersist-safetensors-reader" for t in threading.enumerate())


def test_read_ahead_stays_within_its_budget(tmp_path, monkeypatch):
    """One tensor asked for reads its chunk and little more; names asked for
    in order are read ahead in passes over several chunks, never holding
    more than AHEAD unhanded bytes beyond the chunk asked for."""
    tensors = {f"t{i:02d}": torch.randn(5000 + 37 * i) for i in range(60)}  # ~20 KB each
    path = tmp_path / "seq.safetensors"
    fst.save_file(tensors, path)
    reads = reads_of(monkeypatch, 64 << 10, ahead=256 << 10)
    held = []
    real = fst.safe_open._hand_out

    def hand_out(self, *args):
        held.append(self._held)
        return real(self, *args)

    monkeypatch.setattr(fst.safe_open, "_hand_out", hand_out)
    with fst.safe_open(path) as f:
        assert torch.equal(f.get_tensor("t00"), tensors["t00"])
        reader = f._reader
        if reader is not None:
            reader.join()
        first = sum(n for _, _, n in reads)
        assert first <= 2 * (64 << 10) + 16 * tensors["t00"].nbytes, reads  # its chunk, and what t00's size allows
        data = read_each(f, tensors, f.offset_keys())
        read_once_each(reads, f._header.data_start, data)
    assert max(held) <= (256 << 10) + (64 << 10), held
    assert any(n > (64 << 10) for _, _, n in reads), "no pass read more than a chunk"


def test_a_chunks_tensors_are_handed_out_before_its_pass_ends(tmp_path, monkeypatch):
    """A pass of the reader over several chunks sets their progress as they
    arrive: the first chunk's tensors are handed out while the pass goes on."""
    import threading

    tensors = {f"t{i}": torch.full((4096,), float(i)) for i in range(8)}  # 16 KiB each
    path = tmp_path / "progress.safetensors"
    fst.save_file(tensors, path)
    monkeypatch.setattr(fst, "CHUNK", 16 << 10)
    first_handed_out = threading.Event()
    passes = []
    real = fst._read_run

    def run(fd, path, extents, progress, opts, *rest):
        real(fd, path, extents[:1], progress, opts, *rest)  # the first chunk arrives
        passes.append(first_handed_out.wait(10))  # the rest waits for the consumer
        real(fd, path, extents[1:], progress, opts, *rest) if extents[1:] else None

    monkeypatch.setattr(fst, "_read_run", run)
    with fst.safe_open(path) as f:
        for i, name in enumerate(f.offset_keys()):
            assert torch.equal(f.get_tensor(name), tensors[name])
            first_handed_out.set()
    assert passes and passes[0], "the first tensor waited for the whole pass"


def test_a_file_cut_short_while_open_raises_in_the_thread_that_asks(tmp_path, monkeypatch):
    """A pass that fails (here, the file truncated after it was opened) is
    not an error of the reader thread: the thread asking for a tensor of it
    reads it itself and gets the error, naming that tensor; the tensors
    before the cut load."""
    tensors = {f"t{i}": torch.randn(8192) for i in range(6)}
    path = tmp_path / "cut.safetensors"
    fst.save_file(tensors, path)
    reads = reads_of(monkeypatch, 64 << 10)  # two tensors a chunk
    with fst.safe_open(path) as f:
        os.truncate(path, f._header.data_start + 3 * 32768 + 100)  # inside t3
        for name in ("t0", "t1", "t2"):
            assert torch.equal(f.get_tensor(name), tensors[name])
        with pytest.raises(SafetensorsFileError, match="ended inside tensor 't3'"):
            f.get_tensor("t3")
    assert any(who == "MainThread" for who, _, _ in reads), "the chunk was not read again by the thread asking"


def returns_in_time(call, seconds: float = 20):
    """call() on a thread; its result, failing the test where it has not
    returned in time (a request left waiting forever) instead of hanging."""
    import threading

    result = []
    worker = threading.Thread(target=lambda: result.append(call()), daemon=True)
    worker.start()
    worker.join(seconds)
    assert not worker.is_alive(), "the request is still waiting"
    assert result, "the request raised"
    return result[0]


def test_a_failed_read_ahead_leaves_no_request_waiting(tmp_path, monkeypatch):
    """A pass that fails (a transient error) stops the reader; a tensor asked
    for meanwhile, outside that pass, is still read (by the next reader)."""
    import time

    tensors = {f"t{i:02d}": torch.randn(8192) for i in range(40)}  # 32 KiB each, two a chunk
    path = tmp_path / "ahead.safetensors"
    fst.save_file(tensors, path)
    reads_of(monkeypatch, 64 << 10)
    real, passes = fst._read_run, []

    def run(fd, path, extents, progress, opts, *rest):
        passes.append(extents[0][1])
        if len(passes) == 2:  # the read ahead after t00's chunk
            time.sleep(0.2)  # while t38 is asked for
            raise OSError(12, "Cannot allocate memory")
        return real(fd, path, extents, progress, opts, *rest)

    monkeypatch.setattr(fst, "_read_run", run)
    with fst.safe_open(path) as f:
        assert torch.equal(f.get_tensor("t00"), tensors["t00"])
        assert torch.equal(returns_in_time(lambda: f.get_tensor("t38")), tensors["t38"])
        assert len(passes) >= 3
        read_each(f, tensors, [n for n in tensors if n not in ("t00", "t38")])


@pytest.mark.parametrize("fault", ["no memory for a pass", "no thread"])
def test_a_reader_that_cannot_run_leaves_no_request_waiting(tmp_path, monkeypatch, fault):
    """No memory for a pass's buffers, or no thread to read with: the tensor
    asked for is read by the thread asking, and the next ones as usual."""
    import threading

    tensors = {f"t{i}": torch.randn(8192) for i in range(6)}
    path = tmp_path / "faults.safetensors"
    fst.save_file(tensors, path)
    reads = reads_of(monkeypatch, 64 << 10)
    failed = []
    if fault == "no memory for a pass":
        real = fst._new_buffer

        def new_buffer(nbytes):
            if threading.current_thread().name == "fastpersist-safetensors-reader" and not failed:
                failed.append(nbytes)
                raise MemoryError
            return real(nbytes)

        monkeypatch.setattr(fst, "_new_buffer", new_buffer)
    else:
        real_start = threading.Thread.start

        def start(thread):
            if thread.name == "fastpersist-safetensors-reader" and not failed:
                failed.append(thread)
                raise RuntimeError("can't start new thread")
            return real_start(thread)

        monkeypatch.setattr(threading.Thread, "start", start)
    with fst.safe_open(path) as f:
        assert torch.equal(returns_in_time(lambda: f.get_tensor("t0")), tensors["t0"])
        assert failed
        read_each(f, tensors, ["t1", "t2", "t3", "t4", "t5"])
    read_once_each(reads, f._header.data_start, os.path.getsize(path) - f._header.data_start)


def test_a_tensor_at_its_alignment_in_the_file_is_at_it_in_memory(tmp_path, monkeypatch):
    """A chunk may begin at an odd offset (a file from another writer, with
    one-byte tensors first): its float32 tensor aligned in the file is
    handed out aligned in memory (a copy where the chunk's view is not)."""
    header = {"a": {"dtype": "U8", "shape": [21], "data_offsets": [0, 21]},
              "b": {"dtype": "U8", "shape": [3], "data_offsets": [21, 24]},
              "c": {"dtype": "F32", "shape": [4], "data_offsets": [24, 40]}}
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    path = _write(tmp_path / "odd.safetensors", struct.pack("<Q", len(raw)) + raw + bytes(range(24))
                  + torch.arange(4, dtype=torch.float32).numpy().tobytes())
    monkeypatch.setattr(fst, "CHUNK", 20)  # "a" alone, then "b" and "c" from offset 21
    with fst.safe_open(path) as f:
        assert [(c.start - f._header.data_start, c.end - f._header.data_start) for c in fst._chunks_of(f._header)[0]] \
            == [(0, 21), (21, 40)]
        c = f.get_tensor("c")
        assert c.data_ptr() % 4 == 0 and torch.equal(c, torch.arange(4, dtype=torch.float32))
        assert torch.equal(f.get_tensor("b"), torch.tensor([21, 22, 23], dtype=torch.uint8))


def test_no_read_ahead_of_a_tensor_larger_than_the_budget_and_nothing_kept_after_close(tmp_path, monkeypatch):
    """A tensor larger than the read-ahead budget is not read ahead (maybe a
    slice of it is all that is wanted); a closed file keeps no chunk, and a
    slice read after closing reads its bytes only."""
    tensors = {"a": torch.randn(32 << 10), "b": torch.randn(256 << 10), "c": torch.randn(32 << 10),
               "d": torch.randn(256 << 10)}  # 128 KiB, 1 MiB, 128 KiB, 1 MiB
    path = tmp_path / "mixed-sizes.safetensors"
    fst.save_file(tensors, path)
    reads = reads_of(monkeypatch, 256 << 10, ahead=512 << 10)
    with fst.safe_open(path) as f:
        assert torch.equal(f.get_tensor("a"), tensors["a"])
        if f._reader is not None:
            f._reader.join()
        assert [n for _, _, n in reads] in ([128 << 10], [128 << 10, 128 << 10]), reads  # "a", and "c" ahead:
        # never "b" or "d" (1 MiB each), beyond the budget
        data = read_each(f, tensors, ["b", "c", "d"])
        late = f.get_slice("b")
    read_once_each(reads, f._header.data_start, data)
    assert f._chunks is None and f._reader is None
    reads.clear()
    assert torch.equal(late[:10], tensors["b"][:10])
    assert [n for _, _, n in reads] == [40], reads  # ten rows of four bytes


def test_a_slice_read_while_another_thread_closes_the_file_reads_it_again(tmp_path, monkeypatch):
    """A slice is readable after its file is closed; closed while the read is
    on its way (another thread), the read opens the file again too."""
    tensors = {"big": torch.randn(300, 64), "small": torch.randn(8)}
    path = tmp_path / "c.safetensors"
    fst.save_file(tensors, path)
    with fst.safe_open(path) as f:
        rows = f.get_slice("big")
        real = fst.safe_open._cpu_bytes

        def closed_meanwhile(self, *args):
            if self is f:
                self.close()  # as another thread would, before this read takes the lock
            return real(self, *args)

        monkeypatch.setattr(fst.safe_open, "_cpu_bytes", closed_meanwhile)
        assert torch.equal(rows[10:20], tensors["big"][10:20])
    assert f._fd < 0


def test_a_slice_read_after_close_refuses_a_file_replaced_meanwhile(tmp_path):
    """After close(), a slice opens the name again: where another file has been
    renamed over it, the slice refuses instead of reading that file's bytes."""
    path = tmp_path / "r.safetensors"
    fst.save_file({"t": torch.arange(100.0)}, path)
    with fst.safe_open(path) as f:
        rows = f.get_slice("t")
    assert torch.equal(rows[5:10], torch.arange(5.0, 10.0))  # the same file: read again by its name
    fst.save_file({"t": torch.zeros(100)}, tmp_path / "new.safetensors")
    os.replace(tmp_path / "new.safetensors", path)
    with pytest.raises(SafetensorsFileError, match="replaced after it was opened"):
        rows[5:10]


def test_a_device_read_keeps_its_own_descriptor_while_another_thread_closes_the_file(tmp_path):
    """A read onto a GPU runs outside the lock, on a descriptor of its own: a
    close() meanwhile cannot give the number to another file under the read."""
    path = tmp_path / "d.safetensors"
    fst.save_file({"t": torch.arange(1024, dtype=torch.int32)}, path)
    data = path.read_bytes()
    with fst.safe_open(path) as f:
        with f._descriptor() as fd:
            f.close()  # as another thread would
            other = os.open(tmp_path / "other", os.O_RDWR | os.O_CREAT)  # may take the closed number
            try:
                assert os.pread(fd, len(data), 0) == data
            finally:
                os.close(other)
        with pytest.raises(OSError):
            os.fstat(fd)  # the read's own descriptor is closed with it
        with pytest.raises(SafetensorsFileError, match="File is closed"):
            with f._descriptor():
                pass


def test_the_device_read_path_reads_through_its_own_descriptor(tmp_path, monkeypatch):
    """safe_open's read onto a device (stood in for by "meta", with the
    pipeline's device read replaced) gets a descriptor of its own: closing the
    file meanwhile leaves it reading the file."""
    from fastpersist import read_pipeline

    path = tmp_path / "d.safetensors"
    fst.save_file({"t": torch.arange(1024, dtype=torch.int32)}, path)
    data = path.read_bytes()
    seen = []

    def read_pieces(fd, name, size, options, pieces, *args, **kwargs):
        f.close()  # as another thread would, mid-read
        seen.append(os.pread(fd, len(data), 0))

    monkeypatch.setattr(read_pipeline, "read_pieces", read_pieces)
    f = fst.safe_open(path)
    f.device = torch.device("meta")  # the device branch of _read, no GPU needed
    f.get_tensor("t")
    assert seen == [data]


# ---------------------------------------------------------------------------
# refusals: the same as safetensors', nothing written


def _refusal(call):
    try:
        call()
    except Exception as exc:  # noqa: BLE001
        return type(exc), " ".join(str(exc).split())
    return None


@pytest.mark.parametrize("what", ["shared", "non-contiguous", "sparse", "not a tensor", "not a dict"])
def test_refusals_are_safetensors_own(tmp_path, what):
    base = torch.randn(4, 4)
    tensors = {"shared": {"a": base, "b": base[1]},
               "non-contiguous": {"t": base.t()},
               "sparse": {"s": base.to_sparse()},
               "not a tensor": {"x": 3},
               "not a dict": [base]}[what]
    ours = _refusal(lambda: fst.save_file(tensors, tmp_path / "x.safetensors"))
    theirs = _refusal(lambda: ORIGINAL_SAVE_FILE(tensors, str(tmp_path / "y.safetensors")))
    assert ours is not None and ours == theirs
    assert not (tmp_path / "x.safetensors").exists() and leftovers(tmp_path) == []


def test_what_safetensors_cannot_store_is_named(tmp_path):
    with pytest.raises(ValueError, match="'c' has dtype torch.complex128"):
        fst.save_file({"c": torch.zeros(2, dtype=torch.complex128)}, tmp_path / "c.safetensors")
    with pytest.raises(TypeError, match="metadata must be a dict of strings"):
        fst.save_file({"a": torch.zeros(2)}, tmp_path / "c.safetensors", metadata={"step": 3})
    with pytest.raises(ValueError, match="0-d torch.float4_e2m1fn_x2 tensor cannot be stored"):
        fst.save_file({"f": torch.tensor(3, dtype=torch.uint8).view(torch.float4_e2m1fn_x2)}, tmp_path / "f.safetensors")
    assert list(tmp_path.iterdir()) == []


def test_the_references_are_safetensors_own():
    """The originals these tests compare with are safetensors' functions,
    whatever the patch did (else fastpersist would be compared with itself)."""
    assert ORIGINAL_SAVE_FILE.__module__ == ORIGINAL_LOAD_FILE.__module__ == "safetensors.torch"
    assert ORIGINAL_SAFE_OPEN.__module__ in ("builtins", "safetensors._safetensors_rust")
    was = fastpersist.is_patched()
    fastpersist.patch()
    try:
        assert st._fastpersist_original_save_file is ORIGINAL_SAVE_FILE
        assert safetensors._fastpersist_original_safe_open is ORIGINAL_SAFE_OPEN
    finally:
        fastpersist.patch() if was else fastpersist.unpatch()


def test_loaded_tensors_have_storages_of_their_own(tmp_path):
    """Views of one image, each with its own storage: torch.save of one of
    them writes its bytes, not the file's, and no two share memory."""
    import io

    path = tmp_path / "m.safetensors"
    fst.save_file({"small": torch.arange(10.0), "big": torch.randn(300_000)}, path)
    loaded = fst.load_file(path)
    assert loaded["small"].untyped_storage().nbytes() == 40
    buffer = io.BytesIO()
    torch.save(loaded["small"], buffer)
    assert len(buffer.getvalue()) < 4096
    assert loaded["small"].untyped_storage().data_ptr() != loaded["big"].untyped_storage().data_ptr()


def test_other_frameworks_stay_safetensors(tmp_path):
    np_reader = pytest.importorskip("safetensors.numpy")
    import numpy

    was = fastpersist.is_patched()
    fastpersist.patch()
    try:
        np_reader.save_file({"a": numpy.arange(5, dtype=numpy.float32)}, str(tmp_path / "n.safetensors"))
        assert numpy.array_equal(np_reader.load_file(str(tmp_path / "n.safetensors"))["a"], numpy.arange(5))
        with safetensors.safe_open(str(tmp_path / "n.safetensors"), framework="np") as f:  # fastpersist's name
            assert numpy.array_equal(f.get_tensor("a"), numpy.arange(5))
    finally:
        fastpersist.patch() if was else fastpersist.unpatch()


def test_what_safetensors_callers_pass_is_taken(tmp_path):
    path = tmp_path / "c.safetensors"
    tensors = {"a": torch.arange(6.0).reshape(2, 3), "f4": torch.arange(4, dtype=torch.uint8).view(
        torch.float4_e2m1fn_x2).reshape(2, 2)}
    fst.save_file(tensors, path)
    assert_same(fst.load_file(path, backend="pread"), tensors)
    with fst.safe_open(path, framework="pt") as ours, ORIGINAL_SAFE_OPEN(str(path), framework="pt") as theirs:
        assert_same(ours.get_tensors(), tensors)
        assert ours.get_slice("f4").get_shape() == theirs.get_slice("f4").get_shape() == [2, 4]
        rows = ours.get_slice("a")
    assert torch.equal(rows[1:], tensors["a"][1:])  # a slice outlives its file's `with`, as safetensors' does
    with pytest.raises(SafetensorsFileError, match="File is closed"):
        ours.get_tensor("a")
    if not torch.cuda.is_available():
        for device in ("cuda", "cuda:0", 0):
            with pytest.raises(RuntimeError, match="no CUDA device is usable here"):
                fst.load_file(path, device=device)


def test_unpatch_restores_modules_imported_after_patch():
    pytest.importorskip("transformers")
    script = ("import fastpersist, transformers.modeling_utils as m; fastpersist.unpatch(); "
              "print(m.safe_open.__module__, m.safe_save_file.__module__)")
    out = subprocess.run([sys.executable, "-c", script], env=dict(os.environ, FASTPERSIST_AUTOPATCH="1"),
                         capture_output=True, text=True, check=True)
    assert out.stdout.split("\n")[-2] == "builtins safetensors.torch"


# ---------------------------------------------------------------------------
# broken files: a clean error naming the problem, from every entry point


def _sound():
    return st.save({"a": torch.arange(6, dtype=torch.float32), "b": torch.ones(3, dtype=torch.int64)},
                   {"format": "pt"})


def _with_header(header: dict, data: bytes) -> bytes:
    body = json.dumps(header).encode()
    body += b" " * (-len(body) % 8)
    return struct.pack("<Q", len(body)) + body + data


def _header_of(data: bytes) -> tuple:
    (n,) = struct.unpack("<Q", data[:8])
    return json.loads(data[8:8 + n]), data[8 + n:]


def _broken(kind: str) -> bytes:
    good = _sound()
    header, data = _header_of(good)
    if kind == "truncated":
        return good[:-5]
    if kind == "extended":
        return good + b"\0"
    if kind == "too short":
        return good[:5]
    if kind == "header beyond the file":
        return struct.pack("<Q", 10_000) + good[8:100]
    if kind == "huge header length":
        return struct.pack("<Q", 1 << 40) + good[8:]
    if kind == "not json":
        return struct.pack("<Q", 8) + b"{garbage" + data
    if kind == "not an object":
        return struct.pack("<Q", 8) + b"[1,2]   " + data
    if kind == "hole":
        header["b"]["data_offsets"] = [header["b"]["data_offsets"][0] + 8, header["b"]["data_offsets"][1] + 8]
        return _with_header(header, data + b"\0" * 8)
    if kind == "overlap":
        a, b = header["a"]["data_offsets"], header["b"]["data_offsets"]
        header["a"]["data_offsets"] = [b[0], b[0] + (a[1] - a[0])]
        return _with_header(header, data)
    if kind == "unknown dtype":
        header["a"]["dtype"] = "F7"
        return _with_header(header, data)
    if kind == "shape disagrees":
        header["a"]["shape"] = [7]
        return _with_header(header, data)
    if kind == "negative dimension":
        header["a"]["shape"] = [-6]
        return _with_header(header, data)
    if kind == "F4 odd last dimension":
        return _with_header({"f": {"dtype": "F4", "shape": [2, 3], "data_offsets": [0, 3]}}, b"\0" * 3)
    if kind == "F4 too few bytes":
        return _with_header({"f": {"dtype": "F4", "shape": [2, 1], "data_offsets": [0, 1]}}, b"\0")
    if kind == "shape overflows":
        header["a"]["shape"] = [2 ** 32, 2 ** 32, 0]
        return _with_header(header, data)
    if kind == "dimension past 64 bits":
        header["a"]["shape"] = [2 ** 64, 0]
        return _with_header(header, data)
    if kind == "metadata not strings":
        header["__metadata__"] = {"step": 3}
        return _with_header(header, data)
    raise AssertionError(kind)


BROKEN = ["truncated", "extended", "too short", "header beyond the file", "huge header length", "not json",
          "not an object", "hole", "overlap", "unknown dtype", "shape disagrees", "negative dimension",
          "metadata not strings", "F4 odd last dimension", "F4 too few bytes", "shape overflows",
          "dimension past 64 bits"]


@pytest.mark.parametrize("kind", BROKEN)
def test_broken_files_are_refused_cleanly(tmp_path, kind):
    data = _broken(kind)
    path = _write(tmp_path / "broken.safetensors", data)
    assert _refusal(lambda: ORIGINAL_LOAD_FILE(str(path))) is not None  # safetensors refuses it too
    for call in (lambda: fst.load_file(path), lambda: fst.load(data), lambda: fst.safe_open(path)):
        with pytest.raises(SafetensorsFileError, match="broken.safetensors|<bytes>"):
            call()


# ---------------------------------------------------------------------------
# saves are atomic and durable


def test_a_failed_save_leaves_the_previous_file(tmp_path, monkeypatch):
    from fastpersist import _engine

    path = tmp_path / "model.safetensors"
    first = {"w": torch.randn(300_000)}
    fst.save_file(first, path, buffer_size=64 << 10, num_buffers=2, request_size=16 << 10)
    before = path.read_bytes()
    monkeypatch.setenv("FASTPERSIST_FAULT_INJECT", "write:3:EIO")
    _engine.clear_pool()
    try:
        with pytest.raises(OSError):
            fst.save_file({"w": torch.randn(300_000)}, path, buffer_size=64 << 10, num_buffers=2,
                          request_size=16 << 10)
    finally:
        monkeypatch.delenv("FASTPERSIST_FAULT_INJECT")
        _engine.clear_pool()
    assert path.read_bytes() == before and leftovers(tmp_path) == []
    assert_same(fst.load_file(path), first)


def test_a_save_killed_midway_leaves_the_previous_file(tmp_path):
    path = tmp_path / "model.safetensors"
    fst.save_file({"w": torch.zeros(10)}, path)
    before = path.read_bytes()
    script = f"""
import os, signal, torch
from fastpersist import safetensors as fst, writer
real = writer.FastFileWriter.write_address
def die(self, *a, **k):
    os.kill(os.getpid(), signal.SIGKILL)
writer.FastFileWriter.write_address = die
fst.save_file({{"w": torch.ones(1_000_000)}}, {str(path)!r})
"""
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, timeout=120)
    assert out.returncode == -9
    assert path.read_bytes() == before


# ---------------------------------------------------------------------------
# the drop-in: safetensors' names routed, in modules imported before or after


def test_patch_routes_safetensors_and_unpatch_restores(monkeypatch):
    transformers_utils = pytest.importorskip("transformers.modeling_utils")
    was = fastpersist.is_patched()
    try:
        fastpersist.patch()
        assert st.save_file is fst.save_file and st.load_file is fst.load_file
        assert safetensors.safe_open is fst.safe_open and transformers_utils.safe_open is fst.safe_open
        assert transformers_utils.safe_save_file is fst.save_file
        fastpersist.unpatch()
        assert st.save_file is ORIGINAL_SAVE_FILE and safetensors.safe_open is ORIGINAL_SAFE_OPEN
        assert transformers_utils.safe_open is ORIGINAL_SAFE_OPEN
        fastpersist.patch(safetensors=False)
        assert st.save_file is ORIGINAL_SAVE_FILE and fastpersist.is_patched()
    finally:
        fastpersist.patch() if was else fastpersist.unpatch()


@pytest.mark.parametrize("order", ["transformers first", "fastpersist first", "opted out"])
def test_import_order_does_not_matter(order):
    pytest.importorskip("transformers")
    imports = {"transformers first": "import transformers.modeling_utils as m; import fastpersist",
               "fastpersist first": "import fastpersist; import transformers.modeling_utils as m",
               "opted out": "import transformers.modeling_utils as m; import fastpersist"}[order]
    script = imports + "\nprint(m.safe_open.__module__, m.safe_save_file.__module__)"
    env = dict(os.environ, FASTPERSIST_AUTOPATCH="1")
    if order == "opted out":
        env["FASTPERSIST_SAFETENSORS"] = "0"
    out = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, check=True)
    expected = "builtins safetensors.torch" if order == "opted out" else \
        "fastpersist.safetensors fastpersist.safetensors"
    assert out.stdout.split("\n")[-2] == expected


@pytest.fixture
def routed(monkeypatch):
    """The patch on, with fastpersist's safetensors functions counting their calls."""
    was = fastpersist.is_patched()
    fastpersist.patch()
    calls = {"save_file": 0, "opened": 0, "safe_open": 0}
    real_header_read = fst.Header.read.__func__

    def counted_header_read(cls, *a):
        calls["opened"] += 1
        return real_header_read(cls, *a)

    monkeypatch.setattr(fst.Header, "read", classmethod(counted_header_read))
    real_save, real_read = fst.save_file, fst.safe_open._read

    def counted_read(self, *a):
        calls["safe_open"] += 1
        return real_read(self, *a)

    monkeypatch.setattr(fst.safe_open, "_read", counted_read)
    real_write = fst.header_bytes

    def counted_header(*a, **k):
        calls["save_file"] += 1
        return real_write(*a, **k)

    monkeypatch.setattr(fst, "header_bytes", counted_header)
    yield calls
    assert fst.save_file is real_save
    if not was:
        fastpersist.unpatch()


def tiny_gpt2():
    transformers = pytest.importorskip("transformers")
    config = transformers.GPT2Config(vocab_size=64, n_positions=16, n_embd=32, n_layer=2, n_head=2)
    torch.manual_seed(0)
    return transformers.GPT2LMHeadModel(config)


def test_transformers_sharded_save_pretrained_and_from_pretrained(tmp_path, routed):
    transformers = pytest.importorskip("transformers")
    model = tiny_gpt2()
    model.save_pretrained(tmp_path / "ours", max_shard_size="20KB")
    shards = sorted(p.name for p in (tmp_path / "ours").glob("*.safetensors"))
    assert len(shards) > 2 and routed["save_file"] >= len(shards)
    loaded = transformers.GPT2LMHeadModel.from_pretrained(tmp_path / "ours")
    assert routed["safe_open"] > 0
    for k, v in model.state_dict().items():
        assert torch.equal(loaded.state_dict()[k], v), k
    fastpersist.unpatch()
    model.save_pretrained(tmp_path / "theirs", max_shard_size="20KB")
    for name in shards:  # the shards stock transformers writes, byte for byte
        assert (tmp_path / "ours" / name).read_bytes() == (tmp_path / "theirs" / name).read_bytes(), name


def test_accelerate_save_model_and_load_checkpoint_in_model(tmp_path, routed):
    accelerate = pytest.importorskip("accelerate")
    from accelerate.utils import load_checkpoint_in_model

    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    accelerate.Accelerator(cpu=True).save_model(model, tmp_path, safe_serialization=True)
    assert routed["save_file"] >= 1
    fresh = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    load_checkpoint_in_model(fresh, str(tmp_path / "model.safetensors"))
    assert routed["opened"] >= 1
    for a, b in zip(model.state_dict().values(), fresh.state_dict().values()):
        assert torch.equal(a, b)


def test_peft_adapter_saved_and_loaded(tmp_path, routed):
    peft = pytest.importorskip("peft")
    model = peft.get_peft_model(tiny_gpt2(), peft.LoraConfig(r=4, target_modules=["c_attn"], init_lora_weights=False))
    model.save_pretrained(tmp_path)
    assert routed["save_file"] >= 1
    opened = routed["opened"]
    again = peft.PeftModel.from_pretrained(tiny_gpt2(), tmp_path)
    assert routed["opened"] > opened
    ours = {k: v for k, v in again.state_dict().items() if "lora" in k}
    assert ours and all(torch.equal(v, model.state_dict()[k]) for k, v in ours.items())


# ---------------------------------------------------------------------------
# sharded sets, published index last


def _model_state():
    return {k: v.clone() for k, v in tiny_gpt2().state_dict().items() if k != "lm_head.weight"}  # tied: saved once


def test_save_sharded_writes_transformers_layout_and_it_loads(tmp_path):
    transformers = pytest.importorskip("transformers")
    model = tiny_gpt2()
    model.config.save_pretrained(tmp_path)
    state = _model_state()
    written = fst.save_sharded(state, tmp_path, max_shard_size="20KB")
    assert written[-1] == "model.safetensors.index.json" and len(written) > 3
    assert all(n.startswith("model-0") and n.endswith(f"-of-{len(written) - 1:05d}.safetensors") for n in written[:-1])
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"]) == set(state) and set(index["weight_map"].values()) == set(written[:-1])
    loaded = transformers.GPT2LMHeadModel.from_pretrained(tmp_path)
    for k, v in state.items():
        assert torch.equal(loaded.state_dict()[k], v), k
    assert leftovers(tmp_path) == []


def test_replacing_a_set_leaves_the_old_one_until_the_new_index_is_published(tmp_path, monkeypatch):
    first = _model_state()
    fst.save_sharded(first, tmp_path, max_shard_size="20KB")
    old_files = sorted(p.name for p in tmp_path.iterdir())
    second = {k: v + 1 for k, v in first.items()}
    import importlib

    save_module = importlib.import_module("fastpersist.atomic_write")  # where safetensors writes through
    real = save_module.write_to_path

    def index_fails(path, *args, **kwargs):
        if str(path).endswith(".index.json"):
            raise OSError(28, "No space left on device", str(path))
        return real(path, *args, **kwargs)

    monkeypatch.setattr(save_module, "write_to_path", index_fails)
    with pytest.raises(OSError, match="No space left"):
        fst.save_sharded(second, tmp_path, max_shard_size="20KB")
    monkeypatch.setattr(save_module, "write_to_path", real)
    assert sorted(p.name for p in tmp_path.iterdir()) == old_files  # the failed attempt's shards are gone
    # the old index and every shard it names are as they were: the new shards took other names
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    for name in set(index["weight_map"].values()):
        assert name in old_files
        for k, v in fst.load_file(tmp_path / name).items():
            assert torch.equal(v, first[k]), k
    written = fst.save_sharded(second, tmp_path, max_shard_size="20KB")
    assert sorted(p.name for p in tmp_path.iterdir() if "safetensors" in p.name) == sorted(written)
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    for name in set(index["weight_map"].values()):
        for k, v in fst.load_file(tmp_path / name).items():
            assert torch.equal(v, second[k]), k


def test_a_set_that_fits_one_file_replaces_the_shards(tmp_path):
    state = _model_state()
    fst.save_sharded(state, tmp_path, max_shard_size="20KB")
    assert fst.save_sharded(state, tmp_path) == ["model.safetensors"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model.safetensors"]
    assert_same(fst.load_file(tmp_path / "model.safetensors"), state)


def test_checksums_kept_in_the_metadata_find_a_flipped_byte(tmp_path):
    tensors = {"w": torch.randn(5000), "i": torch.arange(10), "e": torch.zeros(0)}
    path = tmp_path / "c.safetensors"
    fst.save_file(tensors, path, metadata={"format": "pt"}, checksums=True)
    assert_same(ORIGINAL_LOAD_FILE(str(path)), tensors)  # every reader still loads it
    with ORIGINAL_SAFE_OPEN(str(path), framework="pt") as f:
        assert f.metadata()["format"] == "pt" and fst.CHECKSUMS_KEY in f.metadata()
    assert_same(fst.load_file(path, verify=True), tensors)
    raw = bytearray(path.read_bytes())
    raw[len(raw) - 100] ^= 1  # inside the data of the last tensor in the file
    path.write_bytes(raw)
    with pytest.raises(SafetensorsFileError, match="fails its CRC-32 check"):
        fst.load_file(path, verify=True)
    fst.save_file(tensors, path)
    with pytest.raises(SafetensorsFileError, match="saved without checksums"):
        fst.load_file(path, verify=True)


@pytest.mark.parametrize("lost", ["the reader's pass", "another thread's read"])
def test_a_forked_child_reads_what_the_parents_threads_were_reading(tmp_path, monkeypatch, lost):
    """A process forked while a chunk is being read, by the safe_open's
    reader or by another thread reading it itself (after a failed pass):
    the child has no such thread; it reads the chunks itself instead of
    waiting for one that is not there (data-loader workers forked from a
    process that opened the file)."""
    import threading
    import time

    tensors = {f"t{i}": torch.full((8192,), float(i)) for i in range(8)}  # 32 KiB each, two a chunk
    path = tmp_path / "fork.safetensors"
    fst.save_file(tensors, path)
    reads_of(monkeypatch, 64 << 10)
    in_read = threading.Event()
    real_run, real_span, passes = fst._read_run, fst._read_span, []

    def run(fd, path, extents, progress, opts, *rest):
        passes.append(extents[0][1])
        if lost == "another thread's read":
            raise OSError(5, "Input/output error")  # the chunk is then read by the thread asking for it
        if len(passes) == 2:  # the read ahead after t0's chunk: long enough to fork in
            in_read.set()
            time.sleep(3)
        return real_run(fd, path, extents, progress, opts, *rest)

    def span(fd, path, offset, nbytes, opts):
        if threading.current_thread().name == "asking" and not in_read.is_set():
            in_read.set()
            time.sleep(3)
        return real_span(fd, path, offset, nbytes, opts)

    monkeypatch.setattr(fst, "_read_run", run)
    monkeypatch.setattr(fst, "_read_span", span)
    with fst.safe_open(path) as f:
        asking = threading.Thread(target=lambda: f.get_tensor("t0"), name="asking")
        asking.start()
        assert in_read.wait(10)
        child = os.fork()
        if child == 0:  # the child: no test machinery, an exit status
            status = 1
            try:
                torch.set_num_threads(1)  # torch's thread pool hangs in a forked child otherwise
                monkeypatch.setattr(fst, "_read_run", real_run)
                status = 0 if all(torch.equal(f.get_tensor(f"t{i}"), tensors[f"t{i}"]) for i in (1, 2, 3, 7)) else 2
            finally:
                os._exit(status)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            done, status = os.waitpid(child, os.WNOHANG)
            if done:
                break
            time.sleep(0.05)
        else:
            os.kill(child, 9)
            os.waitpid(child, 0)
            pytest.fail("the child waited for a thread of its parent's")
        asking.join()
        assert os.waitstatus_to_exitcode(status) == 0
