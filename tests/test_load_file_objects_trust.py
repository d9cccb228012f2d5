"""fastpersist.load of an open file object does what torch.load does with
it: reads the file it was given where the process may no longer open it
again (its mode changed, or the process dropped privileges after opening
it), and leaves the object where torch's reader leaves it."""
import importlib
import os
import random
import shutil
import subprocess
import sys
import tempfile
import textwrap
import zipfile
from collections import OrderedDict

import pytest
import torch

import fastpersist
from fastpersist.patching import original_load, original_save

from corpus import corpus, rewrite_big_endian

load_module = importlib.import_module("fastpersist.load")  # the module; the package's "load" is the function

# -- a file the process may no longer open again ------------------------------

# Run as root (the checkpoint is root's, mode 0600): the file is opened, then
# its mode set to 0000 or the process turns into nobody; the load must read
# the open file, through fastpersist (the original torch.load refuses to run
# here), with the engine (one is made idle first, and cached files are not
# read through the page cache), and leave it where torch.load did.
NO_LONGER_OPENABLE = textwrap.dedent("""
    import os, sys
    import torch, fastpersist
    from fastpersist import _engine, _torch_api, read_pipeline
    from fastpersist.options import current_options

    path, how, want_position = sys.argv[1], sys.argv[2], int(sys.argv[3])
    read_pipeline.CACHED_ENOUGH = 2.0
    _engine.release(_engine.acquire(current_options(), os.path.getsize(path)))  # idle: the engine reads it
    fastpersist.load(path)  # while root: what the load imports (root's site-packages are closed to nobody)
    def refused(*args, **kwargs):
        raise AssertionError("read by the original torch.load, not through fastpersist")
    _torch_api._original_load = refused
    f = open(path, "rb")
    if how == "chmod":
        os.chmod(path, 0)
    os.setgroups([]); os.setgid(65534); os.setuid(65534)
    try:
        open(path, "rb")
    except PermissionError:
        pass
    else:
        raise SystemExit("the file can still be opened: nothing is tested")
    got = fastpersist.load(f)
    assert torch.equal(got["w"], torch.arange(1 << 20, dtype=torch.float32)), "wrong bytes"
    assert torch.equal(got["b"], torch.ones(3)), "wrong bytes"
    assert f.tell() == want_position, (f.tell(), want_position)
    print("LOADED")
""")


@pytest.fixture
def openable_by_name():
    """A folder that every user may look into (pytest's tmp_path is root's
    alone, and a name that cannot be looked up is left to torch.load)."""
    folder = tempfile.mkdtemp(prefix="fastpersist-trust-")
    os.chmod(folder, 0o755)
    yield folder
    shutil.rmtree(folder, ignore_errors=True)


@pytest.mark.parametrize("how", ["chmod", "setuid"])
def test_a_file_the_process_may_no_longer_open_is_read_through_the_given_object(openable_by_name, how):
    if os.geteuid() != 0:
        pytest.skip("needs root to give the file away and drop privileges")
    path = os.path.join(openable_by_name, "c.pt")
    original_save()({"w": torch.arange(1 << 20, dtype=torch.float32), "b": torch.ones(3)}, path)
    os.chmod(path, 0o600)
    with open(path, "rb") as f:
        original_load()(f)
        want = f.tell()
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
    out = subprocess.run([sys.executable, "-c", NO_LONGER_OPENABLE, path, how, str(want)],
                         capture_output=True, text=True, timeout=300, env=env, cwd=openable_by_name)
    assert out.returncode == 0 and "LOADED" in out.stdout, out.stderr[-3000:]


# -- where the object is left ---------------------------------------------------


def _rewritten(src, dst, order) -> None:
    """src as Python's zipfile writes it (no padding), its records in order(records)."""
    with zipfile.ZipFile(src) as a, zipfile.ZipFile(dst, "w") as b:
        for info in order(a.infolist()):
            b.writestr(info.filename, a.read(info))


def _with_a_hole(src, dst, hole: int) -> None:
    """src with a hole of hole bytes (sparse) before its central directory:
    load then reads it record by record (_CheckpointImage.mostly_outside_records)."""
    with zipfile.ZipFile(src) as a, zipfile.ZipFile(dst, "w") as b:
        for info in a.infolist():
            b.writestr(info.filename, a.read(info))
        b.fp.seek(b.start_dir + hole)
        b.start_dir = b.fp.tell()


@pytest.fixture(scope="module")
def varied(tmp_path_factory):
    """{name: path} of checkpoints that end their loads differently: no
    storage, only empty storages, an empty storage referenced last, a
    storage referenced again last, records in another order than their
    keys, big-endian (torch's unpickling), a module (not a state dict),
    fastpersist's own writer, many records, a hole."""
    folder = tmp_path_factory.mktemp("positions")
    files = {}

    def add(name, obj, saver=original_save):
        files[name] = str(folder / f"{name}.pt")
        saver()(obj, files[name]) if saver is original_save else saver(obj, files[name])

    base = torch.randn(10, 12)
    add("corpus", corpus())
    add("no_storage", {"epoch": 3, "note": "x" * 5000})
    add("empty_dict", {})
    add("only_empty", {"a": torch.zeros(0)})
    add("empty_last", {"a": torch.ones(3), "z": torch.zeros(0)})
    add("empty_first_and_last", {"z": torch.zeros(0), "a": torch.ones(3), "y": torch.zeros(0, 2)})
    add("shared_again_last", {"a": base, "b": torch.ones(2), "c": base[1]})
    add("large_then_small", {"w": torch.arange(3 << 20, dtype=torch.float32), "b": torch.ones(3)})
    add("small_large_small", {"b": torch.ones(3), "w": torch.arange(3 << 20, dtype=torch.float32),
                              "c": torch.ones(5)})
    add("many", {f"w{i}": torch.randn(i % 7 + 1) for i in range(600)})
    add("ordered_with_size", OrderedDict(a=torch.ones(3), s=torch.Size([2, 3])))
    add("module", torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4)))
    add("fastpersist_saved", corpus(), saver=fastpersist.save)
    files["many_reversed"] = str(folder / "many_reversed.pt")
    _rewritten(files["many"], files["many_reversed"], lambda infos: infos[::-1])
    files["corpus_shuffled"] = str(folder / "corpus_shuffled.pt")
    _rewritten(files["corpus"], files["corpus_shuffled"], lambda infos: random.Random(1).sample(infos, len(infos)))
    files["big_endian"] = str(folder / "big_endian.pt")
    rewrite_big_endian(files["shared_again_last"], files["big_endian"], lambda data: 4)
    files["hole"] = str(folder / "hole.pt")
    _with_a_hole(files["small_large_small"], files["hole"], 80 << 20)
    return files


def _position_after(load, path, buffering: int, **kwargs):
    with open(path, "rb", buffering=buffering) as f:
        try:
            load(f, **kwargs)
        except Exception as exc:  # the same refusal, then
            return type(exc).__name__
        return f.tell()


@pytest.mark.parametrize("buffering", [-1, 0])
def test_an_open_file_is_left_where_torch_load_leaves_it(varied, routes_seen, buffering):
    for name, path in varied.items():
        for weights_only in (True, False):
            want = _position_after(original_load(), path, buffering, weights_only=weights_only)
            got = _position_after(fastpersist.load, path, buffering, weights_only=weights_only)
            assert got == want, (name, weights_only)
            if isinstance(want, int):
                assert 0 < want < os.path.getsize(path)
    assert all(p in routes_seen for p in varied.values())  # each read by fastpersist itself


def test_an_open_file_is_left_where_torch_load_leaves_it_by_every_path(varied, routes_seen, monkeypatch):
    """verify=True, map_location, the GPU path's restore (STREAM_LOADS, on the CPU), fsspec's local file."""
    for name, path in varied.items():
        want = _position_after(original_load(), path, -1, weights_only=False)
        assert _position_after(fastpersist.load, path, -1, weights_only=False, map_location="cpu") == want, name
        assert _position_after(fastpersist.load, path, -1, weights_only=False, verify=True) == want, name
    monkeypatch.setattr(load_module, "STREAM_LOADS", True)
    for name, path in varied.items():
        want = _position_after(original_load(), path, -1, weights_only=False)
        assert _position_after(fastpersist.load, path, -1, weights_only=False) == want, name
    monkeypatch.setattr(load_module, "STREAM_LOADS", False)
    fsspec = pytest.importorskip("fsspec")
    for name, path in varied.items():
        want = _position_after(original_load(), path, -1, weights_only=False)
        with fsspec.filesystem("file").open(path, "rb") as f:
            fastpersist.load(f, weights_only=False)
            assert f.tell() == want, name


def test_a_failed_load_of_an_open_file_still_reads_it_again(varied):
    """After a refusal the object may be anywhere, as after torch's; it still loads once rewound."""
    with open(varied["module"], "rb") as f:
        with pytest.raises(Exception):
            fastpersist.load(f, weights_only=True)
        f.seek(0)
        fastpersist.load(f, weights_only=False)
        with open(varied["module"], "rb") as g:
            original_load()(g, weights_only=False)
            assert f.tell() == g.tell()


@pytest.fixture
def routes_seen(monkeypatch):
    """The paths fastpersist read itself."""
    seen = []
    real_open = load_module._CheckpointImage.open.__func__
    monkeypatch.setattr(load_module._CheckpointImage, "open",
                        classmethod(lambda cls, path, options, fd=None: seen.append(path)
                                    or real_open(cls, path, options, fd)))
    return seen
