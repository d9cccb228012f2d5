"""fastpersist under concurrency: threads sharing the engine pool (bounded, no
deadlock), processes saving to one path, patch()/unpatch() racing with
saves and loads, and fork() after engines exist."""
import errno
import importlib
import json
import os
import threading
import time
import traceback

import pytest
import torch

import fastpersist
from fastpersist import FastFileWriter, _engine, read_pipeline
from fastpersist.options import from_environment

from conftest import ENGINES, fork_child, leftovers, vanilla_load

save_module = importlib.import_module("fastpersist.save")  # fastpersist.save is the function

# Modest buffers: many engines stay cheap; payloads still span several buffers.
CONFIG = dict(buffer_size="1M", num_buffers="2", request_size="256K", queue_depth="8")
JOIN_TIMEOUT = 60


@pytest.fixture
def configure(monkeypatch):
    """Sets FASTPERSIST_* variables, which both fastpersist.save and
    fastpersist.load read (load has no per-call options), and returns the
    resulting Options. The pool is emptied before and after."""
    def apply(**options):
        for name, value in {**CONFIG, **options}.items():
            monkeypatch.setenv("FASTPERSIST_" + name.upper(), str(value))
        return from_environment()

    _engine.clear_pool()
    yield apply
    _engine.clear_pool()


def _obj(i, j, n=None):
    n = n if n is not None else 20_000 + 37_000 * ((i * 3 + j) % 7)
    return {"t": torch.arange(n, dtype=torch.float32) + (1000 * i + j), "ids": torch.arange(i + j + 1) * 7,
            "i": i, "j": j}


def _assert_same(loaded, ref):
    assert isinstance(loaded, dict) and loaded.keys() == ref.keys()
    for key, value in ref.items():
        if isinstance(value, torch.Tensor):
            got = loaded[key]
            assert got.dtype == value.dtype and got.shape == value.shape, key
            assert torch.equal(got, value), key
        else:
            assert loaded[key] == value, key


def _run_threads(n, target, timeout=JOIN_TIMEOUT):
    """Runs target(i) on n threads started together; fails on any exception
    or on a thread still running after timeout (a deadlock)."""
    errors = []
    barrier = threading.Barrier(n)

    def run(i):
        try:
            barrier.wait(timeout)
            target(i)
        except BaseException:  # noqa: BLE001
            errors.append(f"thread {i}:\n{traceback.format_exc()}")

    threads = [threading.Thread(target=run, args=(i,), daemon=True) for i in range(n)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout)
    stuck = [thread.name for thread in threads if thread.is_alive()]
    assert not stuck, f"{len(stuck)} threads still running after {timeout} s (deadlock?)"
    assert not errors, "\n".join(errors)


# ---- threads and the engine pool -------------------------------------------


@pytest.mark.parametrize("kind", ["auto"] + ENGINES)
def test_threads_save_and_load_with_a_bounded_pool(folder, configure, kind):
    opts = configure(engine=kind)
    assert opts.max_engines == 4
    others = _engine.pool_size()  # engines of other configurations still in use (none expected)
    if kind == "auto":  # resolve the choice first; the first use is test_first_auto_use_...
        fastpersist.save(_obj(0, 0), folder / "warm.pt")

    def work(i):
        path = folder / f"t{i}.pt"
        for j in range(5):
            obj = _obj(i, j)
            fastpersist.save(obj, path)
            _assert_same(fastpersist.load(path), obj)

    _run_threads(8, work)
    assert 1 <= _engine.pool_size() - others <= opts.max_engines
    for i in range(8):
        _assert_same(vanilla_load(folder / f"t{i}.pt"), _obj(i, 4))
    assert leftovers(folder) == []


def _idle_engines() -> list:
    return [e for idle in _engine._idle.values() for e in idle]


def _capacity(engine) -> int:
    return engine.options.buffer_size * engine.options.num_buffers


@pytest.mark.parametrize("kind", ["auto"] + ENGINES)
def test_a_small_file_gets_an_engine_sized_to_it_within_the_pools_bound(folder, configure, kind):
    """A new engine for a small file has buffers sized to the file (its
    creation is what a first small save in a process paid); it is pooled
    and reused, and counts against max_engines: a larger file finding only
    it idle at the bound drops it for an engine of the configured size,
    which small files then take too."""
    opts = configure(engine=kind, buffer_size="4M", num_buffers="4", request_size="1M", max_engines="1")
    full = opts.buffer_size * opts.num_buffers
    small = {"t": torch.arange(50_000, dtype=torch.float32)}  # 200 KB
    fastpersist.save(small, folder / "s1.pt")
    (first,) = _idle_engines()
    assert first.options.buffer_size == 1 << 20 and _capacity(first) == 2 << 20 < full
    fastpersist.save(small, folder / "s2.pt")
    assert _idle_engines() == [first]  # reused, not made again
    large = {"t": torch.arange(5_000_000, dtype=torch.float32)}  # 20 MB: fills the configured buffers
    fastpersist.save(large, folder / "l.pt")
    (second,) = _idle_engines()
    assert _capacity(second) == full and _engine.pool_size() == 1  # the small one made room
    fastpersist.save(small, folder / "s3.pt")
    assert _idle_engines() == [second]  # an idle engine that holds the file: no new one
    for name, obj in (("s1", small), ("s2", small), ("l", large), ("s3", small)):
        _assert_same(vanilla_load(folder / f"{name}.pt"), obj)


def test_first_auto_use_by_many_threads_stays_bounded(folder, monkeypatch):
    for name in list(os.environ):
        if name.startswith("FASTPERSIST_") and name != "FASTPERSIST_AUTOPATCH":
            monkeypatch.delenv(name)
    opts = from_environment()  # defaults: 16 MiB x 4 buffers per engine, max_engines 4
    _engine.clear_pool()  # forgets the auto choice too
    others = _engine.pool_size()
    try:
        def work(i):
            obj = _obj(i, 0, n=1000)
            fastpersist.save(obj, folder / f"t{i}.pt", engine="auto")
            _assert_same(vanilla_load(folder / f"t{i}.pt"), obj)

        _run_threads(8, work)
        assert _engine.pool_size() - others <= opts.max_engines
    finally:
        _engine.clear_pool()


def test_one_engine_for_four_threads_all_complete(folder, configure, engine):
    opts = configure(engine=engine, max_engines=1)
    others = _engine.pool_size()
    counts = [0] * 4

    def work(i):
        path = folder / f"t{i}.pt"
        for j in range(6):
            obj = _obj(i, j)
            fastpersist.save(obj, path)
            _assert_same(fastpersist.load(path), obj)
            counts[i] += 1

    _run_threads(4, work)
    assert counts == [6] * 4
    assert _engine.pool_size() - others == opts.max_engines == 1


class _LoadsWhilePickled:
    """Pickles as what fastpersist.load reads from path, loaded during the save."""

    def __init__(self, path):
        self.path = path

    def __reduce__(self):
        return (dict, (fastpersist.load(self.path),))


def _save_with_nested_load(folder):
    inner = _obj(9, 9)
    fastpersist.save(inner, folder / "inner.pt")
    outer = {"nested": _LoadsWhilePickled(folder / "inner.pt"), "t": torch.ones(300_000)}
    return inner, outer


def test_load_inside_a_save_with_one_engine_does_not_deadlock(folder, configure, engine):
    configure(engine=engine, max_engines=1)
    inner, outer = _save_with_nested_load(folder)

    def work(i):
        if i == 0:
            fastpersist.save(outer, folder / "outer.pt")
        else:  # competes for the single engine meanwhile
            for j in range(4):
                obj = _obj(i, j)
                fastpersist.save(obj, folder / "other.pt")
                _assert_same(fastpersist.load(folder / "other.pt"), obj)

    _run_threads(2, work)
    loaded = vanilla_load(folder / "outer.pt")
    _assert_same(loaded["nested"], inner)
    assert torch.equal(loaded["t"], outer["t"])
    assert leftovers(folder) == []


def test_load_inside_a_save_leaves_the_pool_within_its_bound(folder, configure, engine):
    opts = configure(engine=engine, max_engines=1)
    others = _engine.pool_size()
    inner, outer = _save_with_nested_load(folder)
    fastpersist.save(outer, folder / "outer.pt")
    _assert_same(vanilla_load(folder / "outer.pt")["nested"], inner)
    assert _engine.pool_size() - others <= opts.max_engines


# ---- processes --------------------------------------------------------------


def _exit_code(pid) -> int:
    _, status = os.waitpid(pid, 0)
    return os.waitstatus_to_exitcode(status)


def test_two_processes_saving_to_one_path(folder, engine):
    n = 3_000_000  # 12 MB each, so that the two saves overlap
    objs = [{"t": torch.arange(n, dtype=torch.float32) * (k + 1), "who": k} for k in range(2)]
    dest = folder / "shared.pt"
    seen = []
    for _ in range(3):
        go_r, go_w = os.pipe()

        def save(k):
            assert os.read(go_r, 1) == b"g"
            fastpersist.save(objs[k], dest, engine=engine)

        pids = [fork_child(lambda k=k: save(k)) for k in range(2)]
        os.close(go_r)
        os.write(go_w, b"gg")  # both start at once
        os.close(go_w)
        assert [_exit_code(pid) for pid in pids] == [0, 0]
        loaded = vanilla_load(dest)
        matches = [k for k in range(2) if loaded.keys() == objs[k].keys() and loaded["who"] == k
                   and torch.equal(loaded["t"], objs[k]["t"])]
        assert len(matches) == 1, f"the result is neither object: who={loaded.get('who')}"
        seen.append(matches[0])
        assert leftovers(folder) == []
    print(f"{engine}: winners {seen}")


# ---- patch() and unpatch() racing -------------------------------------------


def test_patch_and_unpatch_racing_with_saves_and_loads(folder, monkeypatch):
    monkeypatch.setenv("FASTPERSIST_FSYNC", "0")  # many small saves
    iterations = 4001  # odd: the last call is patch()
    fast_saves = []
    real_save_to_path = save_module.save_to_path

    def counting_save_to_path(*args, **kwargs):
        fast_saves.append(1)
        return real_save_to_path(*args, **kwargs)

    monkeypatch.setattr(save_module, "save_to_path", counting_save_to_path)
    done = threading.Event()
    errors = []
    saves = [0] * 3

    started = threading.Barrier(4)

    def toggler():
        try:
            started.wait(JOIN_TIMEOUT)
            for k in range(iterations):
                if k % 2 == 0:
                    fastpersist.patch()
                else:
                    fastpersist.unpatch()
                time.sleep(0)  # hands the GIL over: saves and loads run between calls
        except BaseException:  # noqa: BLE001
            errors.append(traceback.format_exc())
        finally:
            done.set()

    def worker(i):
        try:
            path = folder / f"w{i}.pt"
            j = 0
            started.wait(JOIN_TIMEOUT)
            while not done.is_set() or j < 10:
                obj = _obj(i, j, n=2000 + 100 * j)
                torch.save(obj, path)
                _assert_same(torch.load(path), obj)
                saves[i] += 1
                j += 1
        except BaseException:  # noqa: BLE001
            errors.append(f"worker {i}:\n{traceback.format_exc()}")

    threads = [threading.Thread(target=toggler, daemon=True)]
    threads += [threading.Thread(target=worker, args=(i,), daemon=True) for i in range(3)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(JOIN_TIMEOUT)
    assert not any(thread.is_alive() for thread in threads), "a thread did not finish"
    assert not errors, "\n".join(errors)
    assert fastpersist.is_patched()  # the last call was patch()
    assert torch.save is fastpersist.patching._fast_save and torch.load is fastpersist.patching._fast_load
    fastpersist.unpatch()
    assert not fastpersist.is_patched()
    for i in range(3):
        _assert_same(vanilla_load(folder / f"w{i}.pt"), _obj(i, saves[i] - 1, n=2000 + 100 * (saves[i] - 1)))
    print(f"saves per worker {saves}, through fastpersist {len(fast_saves)}")
    assert 0 < len(fast_saves) < sum(saves), "the race never mixed patched and unpatched saves"
    assert leftovers(folder) == []


# ---- fork --------------------------------------------------------------------


def test_save_and_load_in_forked_child_after_parent_used_the_engine(folder, configure, engine):
    configure(engine=engine)
    n = 700_000  # several 1 MiB buffers
    parent_obj = {"t": torch.full((n,), 7.0), "who": "parent"}
    child_obj = {"t": torch.arange(n, dtype=torch.float32), "who": "child"}
    later_obj = {"t": torch.full((n,), -2.0), "who": "parent later"}
    fastpersist.save(parent_obj, folder / "parent.pt")
    _assert_same(fastpersist.load(folder / "parent.pt"), parent_obj)
    assert _engine.pool_size() >= 1

    def child():
        fastpersist.save(child_obj, folder / "child.pt")
        _assert_same(fastpersist.load(folder / "child.pt"), child_obj)

    assert _exit_code(fork_child(child)) == 0, "the save or load in the forked child failed (see stderr)"
    _assert_same(vanilla_load(folder / "child.pt"), child_obj)  # not the parent's buffer contents
    # The parent's engines still work.
    fastpersist.save(later_obj, folder / "parent.pt")
    _assert_same(fastpersist.load(folder / "parent.pt"), later_obj)
    _assert_same(vanilla_load(folder / "parent.pt"), later_obj)
    _assert_same(vanilla_load(folder / "child.pt"), child_obj)
    assert leftovers(folder) == []


def test_writer_opened_in_parent_refuses_to_write_in_child(folder, configure, engine):
    opts = configure(engine=engine)
    path = folder / "w.bin"
    first, child_bytes, last = b"P" * 100_000, b"C" * 3_000_000, b"Q" * 50_000
    writer = FastFileWriter(path, truncate=True, options=opts)
    writer.write(first)
    report_r, report_w = os.pipe()

    def child():
        report = []
        for op in ("write", "close"):
            try:
                if op == "write":
                    writer.write(child_bytes)
                else:
                    writer.close()
                report.append([op, None, "no error"])
            except OSError as exc:
                report.append([op, exc.errno, str(exc)])
        os.write(report_w, json.dumps(report).encode())

    pid = fork_child(child)
    os.close(report_w)
    with os.fdopen(report_r, "rb") as pipe:
        report = json.loads(pipe.read() or b"[]")
    assert _exit_code(pid) == 0
    assert [op for op, _, _ in report] == ["write", "close"], report
    for op, code, message in report:
        assert code == errno.ECHILD, f"{op} in the child: {message}"
        assert "fork" in message, message
    assert b"C" not in path.read_bytes(), "the child wrote through the parent's engine"
    # The parent's writer is unharmed.
    writer.write(last)
    writer.close()
    assert path.read_bytes() == first + last


# ---------------------------------------------------------------------------
# a checkpoint replaced (a concurrent atomic save renames a new one over it) while it is read


@pytest.fixture
def replaced_at_the_direct_open(folder, monkeypatch):
    """latest.pt holds ones; the moment a load opens its O_DIRECT descriptor,
    a checkpoint of sevens of the same layout is renamed over the name, as a
    concurrent save lands. The engine reads (SMALL_LOAD_BYTES 0: as for a
    large file)."""
    from fastpersist import fileio
    from fastpersist.patching import original_save

    load_module = importlib.import_module("fastpersist.load")
    monkeypatch.setattr(read_pipeline, "SMALL_FILE_BYTES", 0)
    latest, incoming = folder / "latest.pt", folder / "incoming.pt"
    original_save()({"w": torch.ones(300_000)}, latest)
    original_save()({"w": torch.full((300_000,), 7.0)}, incoming)
    real = fileio.open_direct

    def landing_meanwhile(path, flags, same_as=-1):
        if incoming.exists():
            os.rename(incoming, latest)
        return real(path, flags, same_as)

    monkeypatch.setattr(fileio, "open_direct", landing_meanwhile)
    return latest


def test_a_load_reads_the_file_it_opened_though_a_save_replaces_it_meanwhile(replaced_at_the_direct_open):
    got = fastpersist.load(replaced_at_the_direct_open)["w"]
    assert not (replaced_at_the_direct_open.parent / "incoming.pt").exists()  # the rename happened mid-load
    assert torch.equal(got, torch.ones(300_000))  # the opened file's tensor, not the new file's bytes


def test_load_into_reads_the_file_it_opened_though_a_save_replaces_it_meanwhile(replaced_at_the_direct_open):
    target = {"w": torch.zeros(300_000)}
    fastpersist.load_into(target, replaced_at_the_direct_open)
    assert not (replaced_at_the_direct_open.parent / "incoming.pt").exists()
    assert torch.equal(target["w"], torch.ones(300_000))


def test_a_direct_descriptor_reaches_the_open_file_or_none(folder, monkeypatch):
    """open_direct_of: through /proc/self/fd, the file the descriptor is open
    on; without /proc, by path where the name still names it, else -1."""
    from fastpersist import fileio

    path = folder / "a.bin"
    path.write_bytes(b"A" * 8192)
    fd = os.open(path, os.O_RDONLY)
    try:
        os.rename(path, folder / "a-old.bin")
        path.write_bytes(b"B" * 8192)  # another file at the name
        direct = fileio.open_direct_of(fd, str(path), os.O_RDONLY)
        if direct < 0:
            pytest.skip("this filesystem refuses O_DIRECT")
        try:
            assert fileio.same_file(os.fstat(direct), os.fstat(fd))
        finally:
            os.close(direct)
        real = fileio.open_direct

        def no_proc(p, flags, same_as=-1):
            if p.startswith("/proc/"):
                raise FileNotFoundError(p)
            return real(p, flags, same_as)

        monkeypatch.setattr(fileio, "open_direct", no_proc)
        assert fileio.open_direct_of(fd, str(path), os.O_RDONLY) == -1  # the name names another file now
        fd2 = os.open(path, os.O_RDONLY)
        try:
            direct = fileio.open_direct_of(fd2, str(path), os.O_RDONLY)
            assert direct >= 0 and fileio.same_file(os.fstat(direct), os.fstat(fd2))
            os.close(direct)
        finally:
            os.close(fd2)
    finally:
        os.close(fd)
