"""fastpersist.load and the patched torch.load, checked against torch.load of
the same file: values, layout, sharing, map_location, weights_only, and what
is delegated to torch."""
import gc
import inspect
import io
import os
import pickle
import sys
import warnings

import pytest
import torch

import fastpersist
from fastpersist import read_pipeline
from fastpersist.patching import original_load, original_save

from conftest import SMALL, mounted, torch_save_setting
from corpus import assert_same, corpus, rewrite_big_endian


def torch_load(path, **kwargs):
    return original_load()(path, **kwargs)


def sharing(obj):
    """Which tensors of obj share a storage: [(index of first tensor with the same storage)]."""
    tensors = []

    def walk(x):
        if isinstance(x, torch.Tensor):
            tensors.append(x)
        elif isinstance(x, dict):
            for v in x.values():
                walk(v)
        elif isinstance(x, (list, tuple)):
            for v in x:
                walk(v)

    walk(obj)
    ptrs = [t.untyped_storage().data_ptr() if t.untyped_storage().nbytes() else None for t in tensors]
    return [ptrs.index(p) if p is not None else None for p in ptrs]


def same_as_torch(path, **kwargs):
    expected = torch_load(path, **kwargs)
    got = fastpersist.load(path, **kwargs)
    assert_same(expected, got)
    assert sharing(expected) == sharing(got)
    return got


@pytest.fixture
def engine_options(engine):
    fastpersist.patch(engine=engine, **SMALL)
    # an engine idle, so these small loads read through it (with none idle,
    # a load under load.SMALL_LOAD_BYTES reads without one: tested below)
    from fastpersist import _engine
    from fastpersist.options import current_options

    _engine.release(_engine.acquire(current_options()))
    yield
    fastpersist.unpatch()


def test_small_loads_read_without_an_engine_unless_one_is_idle(folder, monkeypatch):
    """load and load_into (with and without verify) of a file under
    SMALL_LOAD_BYTES with no engine idle: plain reads, no engine made; with
    one idle, or above the size, through an engine."""
    from fastpersist import _engine, device_io
    from fastpersist.options import current_options

    load_module = sys.modules["fastpersist.load"]
    state = {"w": torch.randn(300, 300), "b": torch.arange(7), "step": 3}
    original_save()(state, folder / "s.pt")
    ways = []
    for module, name in ((read_pipeline, "pread_extents"), (read_pipeline, "engine_read_extents"),
                         (device_io.PullRead, "deliver")):
        real = getattr(module, name)
        monkeypatch.setattr(module, name, lambda *a, _real=real, _name=name, **k: (ways.append(_name),
                                                                                   _real(*a, **k))[1])

    def each_way():
        same_as_torch(folder / "s.pt")
        for verify in (False, True):
            target = {"w": torch.zeros(300, 300), "b": torch.zeros(7, dtype=torch.long), "step": 0}
            fastpersist.load_into(target, folder / "s.pt", verify=verify)
            assert torch.equal(target["w"], state["w"]) and torch.equal(target["b"], state["b"])
            assert target["step"] == 3

    _engine.clear_pool()
    each_way()
    assert ways == ["pread_extents"] * 3 and _engine.pool_size() == 0
    _engine.release(_engine.acquire(current_options()))
    ways.clear()
    each_way()
    # the idle engine read it (load_into's read begins before the layout: the engine's pull read)
    assert ways == ["engine_read_extents"] + ["deliver"] * 2 and _engine.pool_size() == 1
    monkeypatch.setattr(read_pipeline, "SMALL_FILE_BYTES", 0)
    _engine.clear_pool()
    ways.clear()
    each_way()
    # at any size above it, an engine is made
    assert ways == ["engine_read_extents"] + ["deliver"] * 2 and _engine.pool_size() == 1


def test_a_small_load_into_with_no_engine_verifies_and_refuses_a_corrupt_file(folder):
    from fastpersist import _engine

    path = folder / "s.pt"
    original_save()({"w": torch.arange(1000, dtype=torch.float32)}, path)
    data = bytearray(path.read_bytes())
    at = data.index(torch.arange(1000, dtype=torch.float32).numpy().tobytes()[400:408])
    data[at] ^= 0x10
    path.write_bytes(bytes(data))
    _engine.clear_pool()
    target = {"w": torch.zeros(1000)}
    with pytest.raises(fastpersist.CheckpointError, match="fails its CRC-32 check"):
        fastpersist.load_into(target, path, verify=True)
    assert _engine.pool_size() == 0


def test_torch_save_to_fastpersist_load(folder, engine_options):
    original_save()(corpus(), folder / "c.pt")
    same_as_torch(folder / "c.pt", weights_only=False)
    same_as_torch(folder / "c.pt", weights_only=True)


def test_fastpersist_save_to_fastpersist_load(folder, engine_options):
    obj = corpus()
    fastpersist.save(obj, folder / "c.pt")
    got = same_as_torch(folder / "c.pt", weights_only=False)
    assert_same(obj, got)


@pytest.mark.parametrize("alignment", [64, 4096])
def test_storage_alignment_and_sizes(folder, alignment):
    from torch.utils.serialization import config

    old = config.save.storage_alignment
    config.save.storage_alignment = alignment
    try:
        obj = {f"t{n}": torch.arange(n, dtype=torch.uint8) for n in (0, 1, 4095, 4096, 4097, 3 << 20)}
        original_save()(obj, folder / "a.pt")
    finally:
        config.save.storage_alignment = old
    same_as_torch(folder / "a.pt")


MAP_LOCATIONS = {
    "none": None,
    "str": "cpu",
    "device": torch.device("cpu"),
    "dict": {"cpu": "cpu"},
    "callable_storage": lambda storage, location: storage,
    "callable_none": lambda storage, location: None,
}


@pytest.mark.parametrize("form", list(MAP_LOCATIONS))
def test_map_location_forms(folder, form):
    original_save()(corpus(), folder / "c.pt")
    same_as_torch(folder / "c.pt", map_location=MAP_LOCATIONS[form], weights_only=False)


def test_meta_and_mmap_loads_are_torchs(folder):
    original_save()(corpus(), folder / "c.pt")
    meta = fastpersist.load(folder / "c.pt", map_location="meta", weights_only=False)
    assert meta["zero_dim"].device.type == "meta"
    same_as_torch(folder / "c.pt", mmap=True, weights_only=False)


def test_tensors_outlive_the_rest_of_the_checkpoint(folder):
    original_save()({"keep": torch.arange(1 << 20), "drop": torch.ones(1 << 20)}, folder / "c.pt")
    kept = fastpersist.load(folder / "c.pt")["keep"]
    gc.collect()
    assert torch.equal(kept, torch.arange(1 << 20))


def test_writable_and_independent_of_the_file(folder):
    original_save()(torch.zeros(1000), folder / "c.pt")
    t = fastpersist.load(folder / "c.pt")
    t += 1
    os.unlink(folder / "c.pt")  # the loaded tensor is memory, not a mapping of the file
    assert torch.equal(t, torch.ones(1000))


def test_buffered_filesystem_refusing_o_direct():
    with mounted("ramfs") as base:
        path = os.path.join(base, "c.pt")
        original_save()(corpus(), path)
        same_as_torch(path, weights_only=False)


# ---- weights_only -------------------------------------------------------------


class Payload:
    """Unpickling this runs os.mkdir(path): a stand-in for arbitrary code."""

    def __init__(self, path):
        self.path = path

    def __reduce__(self):
        return os.mkdir, (self.path,)


class Allowed:
    def __init__(self, x=0):
        self.x = x

    def __eq__(self, other):
        return type(other) is Allowed and other.x == self.x


def same_error(call_a, call_b):
    with pytest.raises(Exception) as a:
        call_a()
    with pytest.raises(Exception) as b:
        call_b()
    assert type(a.value) is type(b.value)
    assert str(a.value) == str(b.value)
    return a.value


def test_malicious_reduce_is_refused_like_torch(folder):
    marker = folder / "pwned"
    original_save()({"w": torch.ones(3), "evil": Payload(str(marker))}, folder / "evil.pt")
    err = same_error(lambda: torch_load(folder / "evil.pt"), lambda: fastpersist.load(folder / "evil.pt"))
    assert isinstance(err, pickle.UnpicklingError)
    same_error(lambda: torch_load(folder / "evil.pt", weights_only=True),
               lambda: fastpersist.load(folder / "evil.pt", weights_only=True))
    assert not marker.exists()


def test_safe_globals_behave_the_same(folder):
    original_save()({"obj": Allowed(5), "t": torch.ones(2)}, folder / "a.pt")
    same_error(lambda: torch_load(folder / "a.pt"), lambda: fastpersist.load(folder / "a.pt"))
    with torch.serialization.safe_globals([Allowed]):
        got = same_as_torch(folder / "a.pt")
    assert got["obj"] == Allowed(5)
    same_as_torch(folder / "a.pt", weights_only=False)


class _CountingUnpickler:
    """Counts the pickles torch's weights-only unpickler interprets."""

    def __init__(self, monkeypatch):
        self.loads = 0
        real = torch._weights_only_unpickler.Unpickler.load

        def load(unpickler):
            self.loads += 1
            return real(unpickler)
        monkeypatch.setattr(torch._weights_only_unpickler.Unpickler, "load", load)


def test_plain_state_dicts_are_unpickled_without_torchs_python_unpickler(folder, monkeypatch):
    # the fast path (_torch_api.unpickle_weights_only): same objects as torch.load, torch's unpickler not run
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.LayerNorm(3))
    state = {"model": model.state_dict(), "params": list(model.parameters()), "step": 7,
             "groups": [{"lr": 0.1, "betas": (0.9, 0.99), "nesterov": False, "name": "all", "none": None}]}
    original_save()(state, folder / "p.pt")
    expected = torch_load(folder / "p.pt")
    counting = _CountingUnpickler(monkeypatch)
    got = same_as_torch(folder / "p.pt")
    assert counting.loads == 1  # torch_load's own, inside same_as_torch
    assert type(got["params"][0]) is torch.nn.Parameter
    assert got["model"]._metadata == expected["model"]._metadata
    target = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.LayerNorm(3))
    fastpersist.load_into({"model": target.state_dict()}, folder / "p.pt", strict=False)
    assert counting.loads == 1
    assert all(torch.equal(target.state_dict()[k], v) for k, v in model.state_dict().items())


def test_other_pickles_go_to_torchs_unpickler(folder, monkeypatch):
    # a global outside the fast path's few (a dtype, a Size): torch's unpickler decides, with the same result
    original_save()({"t": torch.ones(2), "dtype": torch.float16, "shape": torch.Size([2, 3])}, folder / "g.pt")
    counting = _CountingUnpickler(monkeypatch)
    same_as_torch(folder / "g.pt")
    assert counting.loads == 2  # torch.load's and fastpersist.load's
    # pickle protocol 4: torch's unpickler warns and refuses it; so does fastpersist.load
    original_save()({"t": torch.ones(2)}, folder / "p4.pt", pickle_protocol=4)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        same_error(lambda: torch_load(folder / "p4.pt"), lambda: fastpersist.load(folder / "p4.pt"))
    assert sum("pickle protocol 4" in str(w.message) for w in caught) == 2


class _PlainStateSpy:
    """Counts the loads _torch_api.unpickle_plain_state built (results) and
    those it handed back to torch's path (refusals)."""

    def __init__(self, monkeypatch):
        from fastpersist import _torch_api

        self.results = self.refusals = 0
        real = _torch_api.unpickle_plain_state

        def spy(*args, **kwargs):
            try:
                got = real(*args, **kwargs)
            except _torch_api.NotPlainState:
                self.refusals += 1
                raise
            self.results += 1
            return got
        monkeypatch.setattr(_torch_api, "unpickle_plain_state", spy)


@pytest.mark.parametrize("alignment", [64, 4096])
def test_plain_state_dicts_are_built_while_the_file_is_read(folder, monkeypatch, alignment):
    # The tensors are built over the file's memory while it is read: the read
    # below cannot start until unpickling has begun, so a load that unpickled
    # only after its read would time out here (and fail the assertion).
    import importlib
    import threading

    load_module = importlib.import_module("fastpersist.load")
    with torch_save_setting("storage_alignment", alignment):
        model = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.LayerNorm(5))
        state = {"model": model.state_dict(), "params": list(model.parameters()), "view": torch.arange(20.)[3:9:2],
                 "tied": model[0].weight, "empty": torch.empty(0), "empty2": torch.empty(0, 3), "step": 3,
                 "half": torch.ones(4, dtype=torch.float16), "flag": torch.tensor([True, False])}
        original_save()(state, folder / "torch.pt")
        fastpersist.save(state, folder / "fp.pt")
        spy = _PlainStateSpy(monkeypatch)
        unpickling = threading.Event()
        real_unpickle, real_read = load_module._torch_api.unpickle_plain_state, load_module._CheckpointImage.read_extents

        def unpickle(*args, **kwargs):
            unpickling.set()
            return real_unpickle(*args, **kwargs)

        waited = []

        def read_extents(image, extents, checksums, started=None, fresh=False, stop=None):
            if started is not None:
                started.set()
            waited.append(unpickling.wait(10))
            return real_read(image, extents, checksums, fresh=fresh, stop=stop)

        monkeypatch.setattr(load_module._torch_api, "unpickle_plain_state", unpickle)
        monkeypatch.setattr(load_module._CheckpointImage, "read_extents", read_extents)
        for name in ("torch.pt", "fp.pt"):
            for kwargs in ({}, {"weights_only": False}, {"map_location": "cpu"}, {"map_location": torch.device("cpu")}):
                unpickling.clear()
                got = same_as_torch(folder / name, **kwargs)
                assert waited.pop() is True
                assert got["tied"].data_ptr() == got["model"]["0.weight"].data_ptr()
        assert spy.results == 8 and spy.refusals == 0


def test_what_the_plain_state_path_hands_to_torch(folder, monkeypatch):
    # each load below is torch's to make, and gives torch's result
    import zipfile

    # records large beside their headers: load_into reads the data ahead (small ones: the whole file, once)
    state = {"w": torch.arange(3 * 65536.).reshape(3, 65536), "b": torch.ones(65536, dtype=torch.float64)}
    original_save()(state, folder / "s.pt")
    with zipfile.ZipFile(folder / "s.pt") as src, zipfile.ZipFile(folder / "foreign.pt", "w") as dst:
        for info in src.infolist():  # Python's zipfile: no padding, the data elsewhere than torch puts it
            dst.writestr(info.filename, src.read(info))
    spy = _PlainStateSpy(monkeypatch)
    same_as_torch(folder / "foreign.pt")  # guessed offsets found wrong after the read: torch's path
    assert spy.results == 1
    same_as_torch(folder / "s.pt", map_location=lambda storage, location: storage)
    same_as_torch(folder / "s.pt", map_location={"cpu": "cpu"})
    assert spy.refusals == 2
    original_save()({"t": torch.ones(2), "dtype": torch.float16}, folder / "g.pt")
    same_as_torch(folder / "g.pt")
    assert spy.refusals == 3
    fastpersist.load(folder / "s.pt", verify=True)  # verified before anything is unpickled
    assert (spy.results, spy.refusals) == (1, 3)
    # load_into's layout pass: the same guesses, checked after the read that began before it (an
    # engine idle for files this small: else they go through the page cache); found wrong
    # (foreign.pt), the tensors are read again, laid out from the headers: a second plain result
    from fastpersist import _engine
    from fastpersist.options import current_options

    _engine.release(_engine.acquire(current_options(), os.path.getsize(folder / "s.pt")))
    for name, built in (("s.pt", 2), ("foreign.pt", 4)):
        target = {"w": torch.zeros(3, 65536), "b": torch.zeros(65536, dtype=torch.float64)}
        fastpersist.load_into(target, folder / name)
        assert torch.equal(target["w"], state["w"]) and torch.equal(target["b"], state["b"])
        assert spy.results == built


def test_the_fast_paths_globals_are_allowed_by_torch_too():
    # should a torch release drop one from its allowlist, the fast path must drop it as well
    from fastpersist import _torch_api

    allowed = list(torch._weights_only_unpickler._get_allowed_globals().values())
    for (module, name), value in _torch_api.PLAIN_STATE_GLOBALS.items():
        assert any(value is a for a in allowed), f"{module}.{name}"
        assert getattr(__import__(module, fromlist=[name]), name) is value


def test_argument_errors_and_environment_like_torch(folder, monkeypatch):
    original_save()({"t": torch.ones(2)}, folder / "a.pt")
    same_error(lambda: torch_load(folder / "a.pt", pickle_module=pickle, weights_only=True),
               lambda: fastpersist.load(folder / "a.pt", pickle_module=pickle, weights_only=True))
    original_save()({"obj": Allowed(1)}, folder / "b.pt")
    monkeypatch.setenv("TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD", "1")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert fastpersist.load(folder / "b.pt")["obj"] == Allowed(1)
    assert any("TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD" in str(w.message) for w in caught)
    monkeypatch.setenv("TORCH_FORCE_WEIGHTS_ONLY_LOAD", "1")
    same_error(lambda: torch_load(folder / "b.pt"), lambda: fastpersist.load(folder / "b.pt"))
    monkeypatch.delenv("TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD")
    same_error(lambda: torch_load(folder / "b.pt", weights_only=False),
               lambda: fastpersist.load(folder / "b.pt", weights_only=False))


def test_pickle_load_args_reach_the_unpickler(folder):
    original_save()({"s": "text", "t": torch.ones(2)}, folder / "a.pt")
    same_as_torch(folder / "a.pt", weights_only=False, encoding="latin1")


# ---- what goes to torch.load ----------------------------------------------------


def test_file_objects_load_what_torch_loads(folder):  # which are read by path: test_load_file_objects.py
    original_save()(corpus(), folder / "c.pt")
    expected = torch_load(folder / "c.pt", weights_only=False)
    with open(folder / "c.pt", "rb") as f:
        assert_same(expected, fastpersist.load(f, weights_only=False))
    assert_same(expected, fastpersist.load(io.BytesIO((folder / "c.pt").read_bytes()), weights_only=False))


def test_legacy_files_go_to_torch(folder):
    # torch's own legacy loader fails on dtypes without a typed storage (uint16..64)
    base = torch.randn(6, 5)
    obj = {"t": base, "view": base[2:, 1:], "half": base.half(), "epoch": 3}
    original_save()(obj, folder / "legacy.pt", _use_new_zipfile_serialization=False)
    same_as_torch(folder / "legacy.pt", weights_only=False)


def test_torchscript_archives_go_to_torch(folder):
    scripted = torch.jit.script(torch.nn.Linear(3, 2))
    scripted.save(str(folder / "s.pt"))
    with pytest.warns(UserWarning, match="TorchScript"):
        loaded = fastpersist.load(folder / "s.pt", weights_only=False)
    assert isinstance(loaded, torch.jit.ScriptModule)
    assert torch.equal(loaded.weight, scripted.weight)


def test_foreign_zip_layout_and_big_endian_record(folder):
    """A checkpoint rewritten by Python's zipfile (sizes in local headers, no
    padding) and marked big-endian: torch swaps bytes on load; so must we."""
    values = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    original_save()({"x": values, "h": values.to(torch.float16)}, folder / "little.pt")
    rewrite_big_endian(folder / "little.pt", folder / "big.pt", lambda data: 4 if len(data) == 48 else 2)
    got = same_as_torch(folder / "big.pt")
    assert torch.equal(got["x"], values)
    assert torch.equal(got["h"], values.to(torch.float16))


# ---- patching -----------------------------------------------------------------


def test_patch_routes_torch_load_and_keeps_signature(folder, monkeypatch):
    original_save()({"t": torch.ones(3)}, folder / "a.pt")
    calls = []
    load_module = sys.modules["fastpersist.load"]  # the package's `load` attribute is the function
    monkeypatch.setattr(load_module, "load", lambda *a, **k: calls.append(a) or "fast")
    fastpersist.patch()
    assert torch.load(folder / "a.pt") == "fast"
    assert torch.serialization.load(folder / "a.pt") == "fast"
    assert inspect.signature(torch.load) == inspect.signature(original_load())
    assert torch.load.__doc__ == original_load().__doc__
    fastpersist.unpatch()
    assert torch.load is original_load() and torch.serialization.load is original_load()
    assert len(calls) == 2


def test_patched_load_round_trip(folder):
    fastpersist.patch()
    torch.save(corpus(), folder / "c.pt")
    got = torch.load(folder / "c.pt", weights_only=False)
    fastpersist.unpatch()
    assert_same(torch.load(folder / "c.pt", weights_only=False), got)


def test_missing_file_and_warnings_like_torch(folder):
    same_error(lambda: torch_load(folder / "nope.pt"), lambda: fastpersist.load(folder / "nope.pt"))
    original_save()({"t": torch.ones(2)}, folder / "legacy.pt", _use_new_zipfile_serialization=False)
    original_save()({"t": torch.ones(2)}, folder / "zip.pt")
    for name in ("legacy.pt", "zip.pt"):
        caught = []
        for loader in (torch_load, fastpersist.load):
            with warnings.catch_warnings(record=True) as w:
                warnings.simplefilter("always")
                loader(folder / name, weights_only=True, encoding="latin1")
            caught.append(sorted(str(x.message) for x in w))
        assert caught[0] == caught[1], name
