"""Storages captured during torch's pickling (the first step of saving GPU
state without a host copy of all of it): the same file, byte for byte, as
torch's own path, for every object, and torch's own path wherever capture
does not apply."""
import io
import pickle
import threading
import types
import warnings

import pytest
import torch
import torch.serialization as ts

import fastpersist
from fastpersist import plain_pickle, _torch_api, torch_format
from corpus import corpus
from test_format import OBJECTS, both, normalized, same_serialization_id  # noqa: F401 - fixture

PROTOCOL = _torch_api.DEFAULT_PROTOCOL


def captured(obj, pickle_module=pickle):
    recorder = torch_format.RecordingZipWriter()
    storages = _torch_api.pickle_into(obj, recorder, pickle_module, PROTOCOL, False)
    return recorder, storages


def saved_bytes(obj, path, **kwargs):
    fastpersist.save(obj, path, **kwargs)
    return normalized(path)


@pytest.fixture(autouse=True)
def capture_always(monkeypatch):
    """Capture runs for CPU state too (where it gains nothing, so "auto" skips it),
    and for plain data too (which plain_pickle writes without torch's pickling)."""
    monkeypatch.setattr(_torch_api, "CAPTURE", "always")
    monkeypatch.setattr(plain_pickle, "ENABLED", False)


@pytest.fixture
def torch_copies(monkeypatch):
    """fastpersist.save as before capture: torch hands over its storages."""
    def use(on: bool):
        monkeypatch.setattr(_torch_api, "CAPTURE", "never" if on else "always")
    return use


def test_capture_records_the_tensors_own_storages():
    a, b = torch.randn(100), torch.arange(10)
    recorder, storages = captured({"a": a, "view": a[10:20], "b": b})
    assert storages is not None and set(storages) == {"0", "1"}
    assert storages["0"].data_ptr() == a.untyped_storage().data_ptr()
    assert storages["1"].data_ptr() == b.untyped_storage().data_ptr()
    assert recorder.attach(storages)
    data = {r.name: r for r in recorder.records if r.name.startswith("data/")}
    assert data["data/0"].storage is storages["0"] and data["data/0"].nbytes == a.nbytes
    assert not ts._serialization_tls.skip_data  # set only while pickling


@pytest.mark.parametrize("key", list(OBJECTS) + ["corpus"])
def test_captured_file_is_torchs_byte_for_byte(folder, key, torch_copies):
    obj = corpus() if key == "corpus" else OBJECTS[key]
    ref, ours = both(obj, folder)
    assert normalized(ref) == normalized(ours)
    # and the same as fastpersist's save from torch's own copies
    (folder / "copies").mkdir()
    torch.save(obj, folder / "copies" / "again.pt")  # its id is the one the next save takes
    torch_copies(True)
    assert saved_bytes(obj, folder / "copies" / "ckpt.pt") == normalized(ours)


def test_capture_with_a_python_pickler(folder):
    """A pickle_module whose Pickler is pickle's pure-Python one."""
    module = types.SimpleNamespace(Pickler=pickle._Pickler, Unpickler=pickle._Unpickler, __name__="pypickle")
    obj = {"w": torch.randn(30, 3), "n": 4}
    _, storages = captured(obj, module)
    assert storages is not None and set(storages) == {"0"}
    ref, ours = both(obj, folder, pickle_module=module)
    assert normalized(ref) == normalized(ours)


class Tensorish(torch.Tensor):
    """A tensor subclass: not among the types the quick ids skip."""


@pytest.mark.filterwarnings("ignore:TypedStorage is deprecated:UserWarning")
@pytest.mark.parametrize("capture", ["always", "never"])
def test_quick_persistent_ids_give_torchs_answers(capture, monkeypatch):
    """The pickle fastpersist plans with equals torch's own _save with the
    stdlib pickle, for storages of every kind (legacy typed, typed, untyped,
    behind a tensor subclass), while torch's persistent_id is asked about
    fewer objects: the skipped ones are answered without it."""
    monkeypatch.setattr(_torch_api, "CAPTURE", capture)
    data = torch.arange(12, dtype=torch.float32)
    obj = {"corpus": corpus(), "legacy": torch.FloatStorage(4),
           "typed": torch.storage.TypedStorage(wrap_storage=data.untyped_storage(), dtype=torch.float32, _internal=True),
           "untyped": torch.ones(3).untyped_storage(), "subclass": data.as_subclass(Tensorish),
           "types": [torch.float16, torch.device("cpu"), torch.strided, torch.Size([2]), 2j,
                     b"b", 1.5, True, None, corpus, Tensorish]}
    asked = []

    def counting(pickler_class):
        class Counting(pickler_class):
            def __init_subclass__(cls, **kwargs):
                theirs = cls.persistent_id

                def persistent_id(self, o):
                    asked.append(o)
                    return theirs(self, o)
                cls.persistent_id = persistent_id  # torch's, counted, before the quick wrapper sees it
                super().__init_subclass__(**kwargs)
        return Counting

    reference = torch_format.RecordingZipWriter()
    ts._save(obj, reference, types.SimpleNamespace(Pickler=counting(pickle.Pickler)), PROTOCOL, False)
    torchs = len(asked)
    asked.clear()
    if capture == "always":  # the capturing Pickler wraps the caller's
        recorder, _ = captured(obj, types.SimpleNamespace(Pickler=counting(pickle.Pickler)))
    else:  # the stdlib's pickle is swapped for the quick one
        quick = _torch_api._quick_persistent_ids(counting(pickle.Pickler))
        monkeypatch.setattr(_torch_api, "_QUICK_PICKLE", types.SimpleNamespace(Pickler=quick))
        recorder, _ = captured(obj)
    assert recorder.records[0].name == "data.pkl" and recorder.records[0].data == reference.records[0].data
    assert [(r.name, r.nbytes) for r in recorder.records] == [(r.name, r.nbytes) for r in reference.records]
    assert 0 < len(asked) < torchs / 3
    assert not any(type(o) in _torch_api._NEVER_STORAGES for o in asked)


def quantized():
    return {"q": torch.quantize_per_tensor(torch.randn(20), 0.1, 3, torch.qint8), "w": torch.ones(4)}


def nested():
    return {"n": torch.nested.nested_tensor([torch.randn(2, 3), torch.randn(4, 3)]), "w": torch.ones(4)}


def meta():
    return {"m": torch.empty(5, 5, device="meta"), "w": torch.ones(4)}


@pytest.mark.filterwarnings("ignore:.*(deprecated|prototype stage).*:UserWarning")  # creating them
@pytest.mark.parametrize("make", [quantized, nested, meta], ids=lambda f: f.__name__)
def test_tensors_that_skip_data_changes_take_torchs_path(folder, make):
    """torch refuses quantized and nested tensors under skip_data and warns
    on meta ones: these objects are pickled by torch's own path, with no
    warning torch.save would not give, and the file is torch's."""
    obj = make()
    recorder, storages = captured(obj)
    assert storages is None
    assert any(r.storage is not None for r in recorder.records)  # torch handed over its storages
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        ref, ours = both(obj, folder)
    assert [str(w.message) for w in caught] == []
    assert normalized(ref) == normalized(ours)


def test_skip_data_set_by_the_caller_is_theirs(folder):
    obj = {"a": torch.randn(500)}
    with ts.skip_data():
        recorder, storages = captured(obj)
        assert ts._serialization_tls.skip_data  # left as the caller set it
        ref, ours = both(obj, folder)
    assert storages is None
    assert not ts._serialization_tls.skip_data
    assert normalized(ref) == normalized(ours)


def test_a_record_without_its_storage_falls_back(folder, monkeypatch):
    """Should capture miss a storage, the object is pickled again by torch's path."""
    real = _torch_api.pickle_into
    calls = []

    def losing_one(obj, writer, module, protocol, disable, capture=True):
        calls.append(capture)
        result = real(obj, writer, module, protocol, disable, capture)
        if result:
            result.pop("0")
        return result

    monkeypatch.setattr(_torch_api, "pickle_into", losing_one)
    ref, ours = both({"a": torch.randn(100), "b": torch.ones(3)}, folder)
    assert calls == [True, False]
    assert normalized(ref) == normalized(ours)


def test_pickling_error_restores_skip_data(folder):
    with pytest.raises(Exception):
        fastpersist.save({"a": torch.ones(3), "f": threading.Lock()}, folder / "x.pt")
    assert not ts._serialization_tls.skip_data
    fastpersist.save({"a": torch.ones(3)}, folder / "y.pt")
    assert torch.equal(torch.load(folder / "y.pt")["a"], torch.ones(3))


def test_skip_data_is_this_threads_only():
    """Capturing sets torch's flag for the pickling thread alone."""
    seen = []
    inside = threading.Event()
    release = threading.Event()

    class Slow:
        def __reduce__(self):
            inside.set()
            release.wait(10)
            return (int, (1,))

    worker = threading.Thread(target=captured, args=({"a": torch.ones(3), "slow": Slow()},))
    worker.start()
    assert inside.wait(10)
    seen.append(ts._serialization_tls.skip_data)
    buf = io.BytesIO()
    _torch_api.original_save()({"b": torch.arange(5)}, buf)  # torch's own save here, meanwhile, writes data
    release.set()
    worker.join()
    assert seen == [False]
    assert torch.equal(torch.load(io.BytesIO(buf.getvalue()))["b"], torch.arange(5))


def test_auto_captures_only_plain_data_with_a_tensor_off_the_cpu(monkeypatch):
    """Capture sets torch's skip_data for the pickling thread: code that
    pickling runs (a class's __reduce__) would see it, so only plain data
    is captured, and only where a tensor is off the CPU (on the CPU torch
    copies nothing anyway)."""
    monkeypatch.setattr(_torch_api, "CAPTURE", "auto")
    monkeypatch.setattr(_torch_api, "_accelerator_initialized", lambda: True)  # as after CUDA started
    cpu_state = {"model": {"w": torch.ones(3), "b": torch.zeros(2)}, "step": 7, "lr": [0.1, (1, "x")],
                 "dtype": torch.float16, "shape": torch.Size([2])}
    assert captured(cpu_state)[1] is None
    assert not _torch_api._worth_capturing(cpu_state)
    meta_state = {"w": torch.nn.Parameter(torch.empty(2, device="meta")), "b": torch.ones(2)}
    assert _torch_api._worth_capturing(meta_state)
    assert captured(meta_state)[1] is None  # and then refused: meta pickles differently under skip_data
    for not_plain in ({"m": torch.nn.Linear(2, 2, device="meta")}, [_Reducing(), torch.empty(1, device="meta")]):
        assert not _torch_api._worth_capturing(not_plain)
    many = [[torch.empty(1, device="meta")] for _ in range(20)]
    assert _torch_api._worth_capturing(many) and not _torch_api._worth_capturing(many, budget=30)


class _Reducing:
    def __reduce__(self):
        return (int, (1,))


def test_code_run_by_pickling_never_sees_skip_data(folder, monkeypatch):
    """A load inside a __reduce__ while fastpersist saves reads real data."""
    monkeypatch.setattr(_torch_api, "CAPTURE", "auto")
    monkeypatch.setattr(_torch_api, "_accelerator_initialized", lambda: True)
    fastpersist.save({"x": torch.arange(5.0)}, folder / "inner.pt")
    seen = []

    class LoadsWhilePickled:
        def __reduce__(self):
            seen.append((ts._serialization_tls.skip_data, fastpersist.load(folder / "inner.pt")["x"].clone()))
            return (int, (1,))

    fastpersist.save({"o": LoadsWhilePickled(), "t": torch.ones(3)}, folder / "outer.pt")
    assert seen[0][0] is False and torch.equal(seen[0][1], torch.arange(5.0))


def test_a_process_without_cuda_does_not_walk_its_state(folder, monkeypatch):
    """No accelerator started: no device tensor can exist, so no walk either."""
    monkeypatch.setattr(_torch_api, "CAPTURE", "auto")
    assert not _torch_api._accelerator_initialized()  # the CPU build here

    def walk(*_):
        raise AssertionError("walked")

    monkeypatch.setattr(_torch_api, "_worth_capturing", walk)
    fastpersist.save({"w": torch.ones(3)}, folder / "x.pt")
    assert torch.equal(torch.load(folder / "x.pt")["w"], torch.ones(3))


def test_the_cuda_error_is_cleared_in_the_runtime_torch_calls(tmp_path):
    """Two CUDA runtimes in one process (cupy's and torch's): the last error
    torch would raise is the one in the runtime torch's CUDA library is
    linked with, whichever other runtime was loaded first. Built here as
    three small libraries: two runtimes whose cudaGetLastError says which
    they are, and a 'torch' linked with the second."""
    import ctypes
    import shutil
    import subprocess

    from fastpersist import device_io

    if shutil.which("cc") is None:
        pytest.skip("no C compiler here")
    for name, value in (("other", 1), ("torchs", 2)):
        (tmp_path / name).mkdir()
        (tmp_path / f"{name}.c").write_text(f"int cudaGetLastError(void) {{ return {value}; }}\n")
        subprocess.run(["cc", "-shared", "-fPIC", "-o", str(tmp_path / name / "libcudart.so.13"),
                        str(tmp_path / f"{name}.c")], check=True)
    (tmp_path / "torch.c").write_text("int cudaGetLastError(void); int torch_kernel(void) { return cudaGetLastError(); }\n")
    subprocess.run(["cc", "-shared", "-fPIC", "-o", str(tmp_path / "libtorch_cuda.so"), str(tmp_path / "torch.c"),
                    str(tmp_path / "torchs" / "libcudart.so.13"), f"-Wl,-rpath,{tmp_path / 'torchs'}"], check=True)
    ctypes.CDLL(str(tmp_path / "other" / "libcudart.so.13"), mode=ctypes.RTLD_GLOBAL)  # loaded first, globally
    runtime = device_io._cuda_runtime(str(tmp_path / "libtorch_cuda.so"))
    assert runtime is not None and runtime.cudaGetLastError() == 2
    assert device_io._cuda_runtime(str(tmp_path / "other.c")) is None  # not a library: none, no error
