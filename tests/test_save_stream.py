"""fastpersist.save (and the patched torch.save) to a file object: the bytes
torch.save writes there, planned by fastpersist (its pickle writer for plain
data) and written through the object's write(), from where it stands."""
import collections
import importlib
import io
import os
import re
import struct
import sys
import zipfile

import pytest
import torch

import fastpersist
from fastpersist import _torch_api, torch_format
from fastpersist.patching import original_save

from conftest import torch_save_setting
from corpus import corpus
from test_format import OBJECTS

save_module = importlib.import_module("fastpersist.save")  # the module; the package's "save" is the function


def _serialization_id(data: bytes) -> str:
    """Read without zipfile's CRC check (saves with compute_crc32 off have CRC 0)."""
    with zipfile.ZipFile(io.BytesIO(data)) as z:
        info = next(i for i in z.infolist() if i.filename.endswith(".data/serialization_id"))
    name_len, extra_len = struct.unpack_from("<HH", data, info.header_offset + 26)
    start = info.header_offset + 30 + name_len + extra_len
    return data[start:start + info.file_size].decode()


def torch_and_ours(obj, monkeypatch, **save_arguments):
    """torch.save's bytes into one BytesIO and fastpersist.save's into another, with torch's serialization id."""
    ref = io.BytesIO()
    original_save()(obj, ref, **save_arguments)
    monkeypatch.setattr(torch_format, "new_serialization_id", lambda: _serialization_id(ref.getvalue()))
    ours = io.BytesIO()
    fastpersist.save(obj, ours, **save_arguments)
    return ref.getvalue(), ours.getvalue()


CASES = {**{f"corpus:{k}": v for k, v in corpus().items()}, **{f"format:{k}": v for k, v in OBJECTS.items()}}


@pytest.mark.parametrize("key", CASES)
def test_a_buffer_gets_torch_saves_bytes(key, monkeypatch):
    ref, ours = torch_and_ours(CASES[key], monkeypatch)
    assert ours == ref


@pytest.mark.parametrize("engine_loaded", [False, True])
def test_checksums_by_zlib_and_by_the_engine_are_torchs(monkeypatch, engine_loaded):
    """Small records' CRC-32s by zlib, large ones' by the engine (loaded for
    them where it is not yet): the descriptors and directory are torch's."""
    from fastpersist import _engine

    monkeypatch.setattr(_engine, "loaded", lambda: engine_loaded)
    state = {"tiny": torch.arange(10), "small": torch.randn(2048), "large": torch.randn(512, 1024)}
    ref, ours = torch_and_ours(state, monkeypatch)
    assert ours == ref


def test_plain_data_goes_through_the_pickle_writer_not_torchs_save(monkeypatch):
    monkeypatch.setattr(_torch_api, "original_save", lambda: pytest.fail("the original torch.save ran"))
    monkeypatch.setattr(_torch_api, "pickle_into", lambda *a, **k: pytest.fail("torch's pickling ran"))
    state = {"w": torch.randn(30, 7), "step": 3}
    buffer = io.BytesIO()
    fastpersist.save(state, buffer)
    buffer.seek(0)
    assert torch.equal(torch.load(buffer, weights_only=True)["w"], state["w"])


def test_a_real_file_object_is_written_from_its_position_and_flushed(tmp_path, monkeypatch):
    state = {"w": torch.randn(100, 100), "b": torch.arange(5)}
    ref, _ = torch_and_ours(state, monkeypatch)
    path = tmp_path / "f.bin"
    with open(path, "wb") as f:
        f.write(b"header!")
        fastpersist.save(state, f)
        assert os.path.getsize(path) == 7 + len(ref)  # flushed, as torch.save flushes
        f.write(b"trailer")
    assert path.read_bytes() == b"header!" + ref + b"trailer"


class _Trickle(io.RawIOBase):
    """A raw stream that takes at most 1,000 bytes a call, as a raw file may."""

    def __init__(self):
        self.data = bytearray()

    def writable(self):
        return True

    def write(self, b):
        n = min(len(b), 1000)
        self.data += bytes(memoryview(b)[:n])
        return n


class _WriteOnly:
    """Only write(), returning None: a stream that cannot seek or tell."""

    def __init__(self):
        self.parts = []

    def write(self, b):
        self.parts.append(bytes(b))


def test_short_writes_and_streams_that_cannot_seek(monkeypatch):
    state = {"w": torch.randn(300, 50), "small": [torch.ones(i) for i in range(20)]}
    ref, _ = torch_and_ours(state, monkeypatch)
    trickle, write_only = _Trickle(), _WriteOnly()
    fastpersist.save(state, trickle)
    fastpersist.save(state, write_only)
    assert bytes(trickle.data) == ref
    assert b"".join(write_only.parts) == ref


def test_the_patched_torch_save_routes_buffers(monkeypatch):
    calls = []
    real = save_module.save_to_stream
    monkeypatch.setattr(save_module, "save_to_stream", lambda *a, **k: calls.append(1) or real(*a, **k))
    was = fastpersist.is_patched()
    fastpersist.patch()
    try:
        buffer = io.BytesIO()
        torch.save({"a": torch.ones(3)}, buffer)
    finally:
        if not was:
            fastpersist.unpatch()
    assert calls == [1]
    buffer.seek(0)
    assert torch.equal(torch.load(buffer, weights_only=True)["a"], torch.ones(3))


def test_what_torch_writes_itself_still_goes_to_torch(monkeypatch):
    """skip_data, the legacy format and pickle modules without a Pickler go
    to the original torch.save, as for paths."""
    monkeypatch.setattr(save_module, "save_to_stream", lambda *a, **k: pytest.fail("fastpersist wrote the stream"))
    state = {"w": torch.randn(10)}
    with torch.serialization.skip_data():
        fastpersist.save(state, io.BytesIO())
    legacy = io.BytesIO()
    fastpersist.save(state, legacy, _use_new_zipfile_serialization=False)
    legacy.seek(0)
    assert torch.equal(torch.load(legacy, weights_only=True)["w"], state["w"])


def test_settings_and_protocols_are_torchs(monkeypatch):
    state = {"w": torch.randn(33, 3), "i": torch.arange(9)}
    with torch_save_setting("compute_crc32", False):
        ref, ours = torch_and_ours(state, monkeypatch)
        assert ours == ref
    with torch_save_setting("storage_alignment", 4096):
        ref, ours = torch_and_ours(state, monkeypatch)
        assert ours == ref
    ref, ours = torch_and_ours(state, monkeypatch, pickle_protocol=4, _disable_byteorder_record=True)
    assert ours == ref


def test_a_failed_pickling_writes_nothing_and_raises_torchs_error():
    obj = {"w": torch.ones(2), "f": lambda: None}
    with pytest.raises(Exception) as theirs:
        original_save()(obj, io.BytesIO())
    buffer = io.BytesIO()
    with pytest.raises(type(theirs.value)):
        fastpersist.save(obj, buffer)
    assert buffer.getvalue() == b""  # planned before the first write (torch leaves a partial archive)


def test_no_write_method_is_torchs_error():
    with pytest.raises(AttributeError) as theirs:
        original_save()({"a": 1}, object())
    with pytest.raises(AttributeError, match=re.escape(str(theirs.value))):
        fastpersist.save({"a": 1}, object())


class _Compressing:
    """A stream whose write() returns what it emitted, not what it took (a
    compressor's count), and one that returns True: torch ignores both."""

    def __init__(self, returns_true=False):
        self.data = bytearray()
        self.returns_true = returns_true

    def write(self, b):
        self.data += bytes(b)
        return True if self.returns_true else len(b) // 3


def test_what_a_non_raw_streams_write_returns_is_ignored_as_torch_ignores_it(monkeypatch):
    state = {"w": torch.randn(1000), "s": [torch.ones(i) for i in range(5)]}
    ref, _ = torch_and_ours(state, monkeypatch)
    for stream in (_Compressing(), _Compressing(returns_true=True)):
        fastpersist.save(state, stream)
        assert bytes(stream.data) == ref


def test_a_non_blocking_raw_stream_that_takes_nothing_is_an_error():
    class WouldBlock(io.RawIOBase):
        def writable(self):
            return True

        def write(self, b):
            return None

    with pytest.raises(BlockingIOError):
        fastpersist.save({"w": torch.ones(3)}, WouldBlock())


def test_storages_off_the_cpu_are_written_from_a_host_copy_held_through_the_write():
    """A device storage reaches a stream as a host copy (storage.cpu()), which
    must live until its bytes are written and checksummed. Stood in for by a
    storage whose device says "cuda" and whose cpu() returns a new copy."""
    import zlib

    class Device:
        type = "cuda"

    class DeviceStorage:
        def __init__(self, real):
            self.real, self.device = real, Device()

        def nbytes(self):
            return self.real.nbytes()

        def cpu(self):
            return torch.UntypedStorage(self.real.nbytes()).copy_(self.real)

    for n in (100, 4096, 8 << 20):
        values = (torch.arange(n) % 251).to(torch.uint8)
        expected = values.numpy().tobytes()
        plan = torch_format.CheckpointPlan(
            "archive", [torch_format.RecordSource("data/0", n, storage=DeviceStorage(values.untyped_storage()))], 64, True)
        buffer = io.BytesIO()
        torch_format.write_plan(plan, torch_format.StreamSink(buffer))
        start = len(plan.records[0].header)
        assert buffer.getvalue()[start:start + n] == expected, n
        assert plan.records[0].layout.crc == zlib.crc32(expected), n


# -- objects deep enough to exhaust the recursion limit --------------------------------
# CPython's pickler enters a recursion level for each container (two for an
# exact dict or list), and torch.save raises RecursionError where they run
# out. fastpersist's writer counts its own; where torch.save would raise, so
# does fastpersist.save, and where it saves, the bytes are torch's.

def _mix(inner):
    return [{"a": (collections.OrderedDict(x=inner),)}]


DEEP = {"dict": lambda inner: {"a": inner}, "list": lambda inner: [inner], "tuple": lambda inner: (inner,),
        "OrderedDict": lambda inner: collections.OrderedDict(a=inner), "list of two": lambda inner: [1, inner],
        "a mix": _mix}
LEAF = {"w": torch.ones(2), "p": torch.nn.Parameter(torch.zeros(1)), "n": 3}


def _nested(kind: str, depth: int):
    obj = LEAF
    for _ in range(depth):
        obj = DEEP[kind](obj)
    return obj


def _save_or_error(save, obj, target):
    """Whatever save raises, or None; called from one place for every save,
    so that each runs as deep in the stack as the others."""
    try:
        save(obj, target)
    except RecursionError as exc:
        return exc
    return None


def _in_frames(extra: int, call):
    return call() if extra <= 0 else _in_frames(extra - 1, call)


def _torch_saves(obj, extra_frames: int = 0) -> bool:
    """Whether torch.save(obj) returns, called as deep as _same_outcome_as_torch_save calls it."""
    try:
        return _in_frames(extra_frames, lambda: _save_or_error(original_save(), obj, io.BytesIO())) is None
    except RecursionError:  # the frames alone ran out
        return False


def _first_failing(fails, low: int, high: int) -> int:
    """The least n in [low, high] for which fails(n)."""
    while low < high:
        middle = (low + high) // 2
        if fails(middle):
            high = middle
        else:
            low = middle + 1
    return low


def _same_outcome_as_torch_save(obj, folder, monkeypatch, extra_frames: int = 0, same_words: bool = True,
                                paths: bool = True) -> bool:
    """fastpersist.save (and the patched torch.save) into a buffer and (paths)
    to a path against torch.save: the same RecursionError (same_words: torch's
    pickler's own), or the same bytes. Returns whether torch.save saved."""
    from fastpersist.patching import _fast_save

    outcomes = {}
    targets = [("buffer", lambda: io.BytesIO()), ("path", lambda: folder / name / "c.pt")]
    for name, target in targets if paths else targets[:1]:
        (folder / name).mkdir(exist_ok=True)
        (folder / "ours").mkdir(exist_ok=True)
        theirs = target()
        their_error = _in_frames(extra_frames, lambda: _save_or_error(original_save(), obj, theirs))
        their_bytes = theirs.getvalue() if name == "buffer" else theirs.read_bytes() if their_error is None else None
        if their_bytes is not None:
            monkeypatch.setattr(torch_format, "new_serialization_id", lambda: _serialization_id(their_bytes))
        for save in (fastpersist.save, _fast_save):
            ours = io.BytesIO() if name == "buffer" else folder / "ours" / "c.pt"  # the archive is named after it
            our_error = _in_frames(extra_frames, lambda: _save_or_error(save, obj, ours))
            assert (our_error is None) == (their_error is None), (name, save, our_error, their_error)
            if name == "buffer":
                assert ours.getvalue() == (their_bytes if our_error is None else b"")
            else:
                assert (ours.read_bytes() if ours.exists() else None) == their_bytes
                if ours.exists():
                    ours.unlink()
            if our_error is not None:
                assert type(our_error) is type(their_error)
                assert str(our_error) == str(their_error) or not same_words
        if theirs is not None and name == "path" and theirs.exists():
            theirs.unlink()
        outcomes[name] = their_error is None
    assert outcomes["buffer"] == outcomes.get("path", outcomes["buffer"])
    return outcomes["buffer"]


@pytest.fixture(params=["c", "python"])
def writer(request, monkeypatch):
    from fastpersist import plain_pickle

    monkeypatch.setattr(plain_pickle, "IMPLEMENTATION", request.param)
    return request.param


@pytest.fixture(params=["the current limit", "a lower limit", "a higher limit"])
def recursion_limit(request):
    before = sys.getrecursionlimit()
    limit = {"the current limit": before, "a lower limit": 700, "a higher limit": 2500}[request.param]
    sys.setrecursionlimit(limit)
    try:
        yield limit
    finally:
        sys.setrecursionlimit(before)


@pytest.mark.parametrize("kind", DEEP)
def test_deep_objects_raise_exactly_where_torch_save_raises(kind, writer, recursion_limit, tmp_path, monkeypatch):
    threshold = _first_failing(lambda depth: not _torch_saves(_nested(kind, depth)), 1, 2 * recursion_limit)
    assert 1 < threshold < 2 * recursion_limit
    # the threshold here is a level or so off (the search runs a few frames deeper): both sides of it
    saved = [_same_outcome_as_torch_save(_nested(kind, depth), tmp_path, monkeypatch)
             for depth in range(threshold - 3, threshold + 3)]
    assert saved == sorted(saved, reverse=True) and True in saved and False in saved, saved


def test_a_shallow_state_saved_with_few_levels_left_raises_where_torch_save_raises(writer, tmp_path, monkeypatch):
    """The caller's own depth counts too: a state dict saved into a stream
    from deep in a recursion. (Where fastpersist's own frames run out first,
    before its pickling, its RecursionError is raised elsewhere than
    torch's. A save to a path takes more frames of its own than torch.save
    (the temporary, the engine), how many depending on what the process
    has done before: within a few frames of the limit it may raise where
    torch.save would not; docs/limitations.md.)"""
    state = {"model": torch.nn.Linear(2, 2).state_dict(), "opt": {"step": 1, "lr": [0.1, (0.9, 0.99)]}}
    fewest = _first_failing(lambda extra: not _torch_saves(state, extra), 1, sys.getrecursionlimit())
    saved = [_same_outcome_as_torch_save(state, tmp_path, monkeypatch, extra, same_words=False, paths=False)
             for extra in range(fewest - 4, fewest + 4)]
    assert saved == sorted(saved, reverse=True) and True in saved and False in saved, saved
