"""The source patch in patches/: it applies to the installed torch, is current,
and the patched torch.serialization.save routes through fastpersist."""
import copyreg
import dataclasses
import importlib
import importlib.util
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.serialization

import fastpersist
import fastpersist._torch_api
import fastpersist.patching

ROOT = Path(__file__).resolve().parent.parent
PATCHES = ROOT / "patches"
MAKE_PATCH = PATCHES / "make_patch.py"
RELEASE = torch.__version__.split("+", 1)[0]
PATCH_FILE = PATCHES / f"torch-{RELEASE}-serialization.patch"
INSTALLED = Path(torch.serialization.__file__)
if hasattr(torch.serialization, "_fastpersist_vanilla_save"):
    pytest.skip("the installed torch already carries the source patch", allow_module_level=True)

needs_patch_file = pytest.mark.skipif(
    not PATCH_FILE.exists(),
    reason=f"no committed patch for torch {RELEASE} (have: "
           f"{', '.join(p.name for p in sorted(PATCHES.glob('torch-*.patch'))) or 'none'}); "
           "run patches/make_patch.py",
)
needs_patch_tool = pytest.mark.skipif(shutil.which("patch") is None, reason="the patch program is not installed")

fp_save_module = importlib.import_module("fastpersist.save_api")  # `fastpersist.save` is the function


def _apply(workdir: Path) -> Path:
    """Copies the installed serialization.py under workdir and patches it."""
    target = workdir / "torch" / "serialization.py"
    target.parent.mkdir(parents=True)
    shutil.copyfile(INSTALLED, target)
    for extra in (["--dry-run"], []):
        run = subprocess.run(["patch", "-p1", "--batch", *extra, "-i", str(PATCH_FILE)],
                             cwd=workdir, capture_output=True, text=True)
        assert run.returncode == 0, f"patch {' '.join(extra)} failed:\n{run.stdout}\n{run.stderr}"
    assert not list(workdir.rglob("*.rej"))
    return target


@pytest.fixture
def unpatched():
    """fastpersist's runtime patch off for the test, restored afterwards."""
    was_patched = fastpersist.is_patched()
    options = fastpersist.patching.current_options()
    fastpersist.unpatch()
    yield
    if was_patched:
        fastpersist.patch(**dataclasses.asdict(options))
    else:
        fastpersist.unpatch()


@pytest.fixture(scope="module")
def patched_module(tmp_path_factory):
    """The patched copy of torch/serialization.py, loaded as its own module."""
    if not PATCH_FILE.exists():
        pytest.skip(f"no committed patch for torch {RELEASE}")
    if shutil.which("patch") is None:
        pytest.skip("the patch program is not installed")
    path = _apply(tmp_path_factory.mktemp("patched"))
    name = "fastpersist_patched_serialization"
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    # the copy registers its own pickling of torch.layout (copyreg), naming itself: once it is gone,
    # every later pickle of a layout would fail, so the registration torch made is put back
    layout_reducer = copyreg.dispatch_table.get(torch.layout)
    try:
        spec.loader.exec_module(module)
        yield module
    finally:
        sys.modules.pop(name, None)
        if layout_reducer is not None:
            copyreg.pickle(torch.layout, layout_reducer)


@pytest.fixture
def calls(monkeypatch, patched_module):
    """Spies on fastpersist.save_api.save, fastpersist's original save and the vanilla save."""
    record = {"fastpersist": [], "original": [], "vanilla": []}

    def spy(key, func):
        def wrapper(*args, **kwargs):
            record[key].append(args[1] if len(args) > 1 else kwargs.get("f"))
            return func(*args, **kwargs)
        return wrapper

    monkeypatch.setattr(fp_save_module, "save", spy("fastpersist", fp_save_module.save))
    monkeypatch.setattr(fastpersist._torch_api, "_original_save",
                        spy("original", fastpersist._torch_api._original_save))
    monkeypatch.setattr(patched_module, "_fastpersist_vanilla_save",
                        spy("vanilla", patched_module._fastpersist_vanilla_save))
    return record


def _tensors():
    gen = torch.Generator().manual_seed(7)
    return {"w": torch.randn(64, 33, generator=gen), "b": torch.arange(1000, dtype=torch.int64),
            "h": torch.randn(5, generator=gen).half()}


def _assert_loads(path, expected):
    loaded = torch.load(path, weights_only=True)
    assert loaded.keys() == expected.keys()
    for key, value in expected.items():
        assert loaded[key].dtype == value.dtype
        assert torch.equal(loaded[key], value)


@needs_patch_file
@needs_patch_tool
def test_patch_applies_to_installed_torch(tmp_path):
    target = _apply(tmp_path)
    text = target.read_text()
    assert text.count("\ndef save(") == 1
    assert text.count("\ndef _fastpersist_vanilla_save(") == 1
    assert text.index("\ndef save(") < text.index("\ndef _fastpersist_vanilla_save(")


def test_committed_patch_is_current(tmp_path):
    committed = sorted(PATCHES.glob("torch-*-serialization.patch"))
    if not PATCH_FILE.exists():
        pytest.skip(f"installed torch is {torch.__version__} but the committed patch(es) are for "
                    f"{', '.join(p.name for p in committed) or 'nothing'}; run patches/make_patch.py")
    run = subprocess.run([sys.executable, str(MAKE_PATCH), "--output-dir", str(tmp_path)],
                         capture_output=True, text=True)
    assert run.returncode == 0, run.stderr
    generated = tmp_path / PATCH_FILE.name
    assert generated.read_text() == PATCH_FILE.read_text(), \
        "patches/ is stale for the installed torch: rerun patches/make_patch.py"


def test_make_patch_refuses_unknown_source(tmp_path):
    for count in (0, 2):
        source = tmp_path / f"serialization_{count}.py"
        source.write_text("import pickle\n" + "def save(obj, f):\n    '''doc'''\n" * count)
        run = subprocess.run([sys.executable, str(MAKE_PATCH), "--source", str(source),
                              "--torch-version", "0.0.0", "--output-dir", str(tmp_path)],
                             capture_output=True, text=True)
        assert run.returncode != 0
        assert f"found {count}" in run.stderr
        assert not (tmp_path / "torch-0.0.0-serialization.patch").exists()


def test_patched_save_goes_through_fastpersist(unpatched, patched_module, calls, tmp_path):
    assert patched_module.save.__doc__ == torch.serialization.save.__doc__
    obj = _tensors()
    path = tmp_path / "x.pt"
    patched_module.save(obj, path)
    assert calls["fastpersist"] == [path]
    assert calls["original"] == []
    assert calls["vanilla"] == []
    assert not fastpersist.is_patched()
    _assert_loads(path, obj)


def test_patched_save_to_buffer_is_written_by_fastpersist(unpatched, patched_module, calls):
    import io

    buffer = io.BytesIO()
    obj = _tensors()
    patched_module.save(obj, buffer)
    assert len(calls["fastpersist"]) == 1
    assert calls["original"] == []  # fastpersist writes buffers itself, through their write()
    buffer.seek(0)
    _assert_loads(buffer, obj)


def test_env_switch_disables_fastpersist(unpatched, patched_module, calls, monkeypatch, tmp_path):
    monkeypatch.setenv("FASTPERSIST_SOURCE_PATCH", "0")
    obj = _tensors()
    path = tmp_path / "y.pt"
    patched_module.save(obj, path)
    assert calls["fastpersist"] == []
    assert calls["vanilla"] == [path]
    _assert_loads(path, obj)


def test_missing_fastpersist_falls_back(unpatched, patched_module, calls, monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "fastpersist.save_api", None)  # makes the import raise ImportError
    obj = _tensors()
    path = tmp_path / "z.pt"
    patched_module.save(obj, path)
    assert calls["fastpersist"] == []
    assert calls["vanilla"] == [path]
    _assert_loads(path, obj)
