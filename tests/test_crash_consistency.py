"""Crash consistency of fastpersist.save: a save SIGKILLed at any moment
leaves the destination exactly as it was or exactly the new checkpoint,
never anything else; the temporary of a killed save is removed by a later
save in the folder, and the temporary of a live save (another process or
another thread) is left alone."""
import importlib
import os
import signal
import subprocess
import sys
import threading
import time

import pytest
import torch

import fastpersist

from conftest import fork_child, is_locked, leftovers, vanilla_load

from fastpersist import atomic_write
from fastpersist import release  # noqa: E402

MiB = 1 << 20
KILL_POINTS = 22  # per engine, spread over 0 .. 1.2x an uninterrupted save
MIN_MID_SAVE = 5  # of them must land while the temporary exists


def _tensor(nbytes, start, step):
    n = nbytes // 4
    return torch.arange(n, dtype=torch.float32) * step + start


@pytest.fixture(scope="module")
def checkpoints():
    """A: a small checkpoint; B: ~200 MB of the same keys with other values.
    Values vary along each tensor, so misplaced blocks are caught too."""
    sizes = [64 * MiB, 48 * MiB, 32 * MiB, 24 * MiB, 16 * MiB, 8 * MiB, 3 * MiB + 12_340, 1 * MiB, 4096, 4]
    b = {f"t{i}": _tensor(size, start=i + 1, step=1.0) for i, size in enumerate(sizes)}
    a = {f"t{i}": _tensor(max(4, size // 16), start=-(i + 1), step=-0.5) for i, size in enumerate(sizes)}
    b["ids"] = torch.arange(1000, dtype=torch.int64) * 3
    a["ids"] = torch.arange(1000, dtype=torch.int64) * -7
    a["meta"] = {"name": "A", "step": 1}
    b["meta"] = {"name": "B", "step": 2}
    assert sum(t.nbytes for t in b.values() if isinstance(t, torch.Tensor)) > 190 * MiB
    return a, b


def _same(loaded, ref) -> bool:
    if not isinstance(loaded, dict) or loaded.keys() != ref.keys():
        return False
    for key, value in ref.items():
        got = loaded[key]
        if isinstance(value, torch.Tensor):
            if not (isinstance(got, torch.Tensor) and got.dtype == value.dtype and got.shape == value.shape
                    and torch.equal(got, value)):
                return False
        elif got != value:
            return False
    return True


def _which(path, a, b) -> str:
    """'A' or 'B': what vanilla torch.load reads at path; fails on anything else."""
    try:
        loaded = vanilla_load(path)
    except Exception as exc:  # noqa: BLE001 - any failure to load is the finding
        pytest.fail(f"{path} does not load with vanilla torch.load: {exc!r}")
    if _same(loaded, a):
        return "A"
    if _same(loaded, b):
        return "B"
    pytest.fail(f"{path} loads but is neither checkpoint A nor checkpoint B "
                f"(meta={loaded.get('meta') if isinstance(loaded, dict) else type(loaded)})")


def _temporaries(folder):
    """The temporaries in folder. The only other fastpersist files allowed are
    trash names: a replaced checkpoint's data that a killed child did not get
    to free (the next save frees them)."""
    names = leftovers(folder)
    assert all(atomic_write.TEMPORARY_NAME.match(n) or release.TRASH_NAME.match(n) for n in names), names
    return [name for name in names if atomic_write.TEMPORARY_NAME.match(name)]


def _fork_save(obj, dest, engine) -> int:
    """A child process that saves obj to dest and exits 0 (1 on an exception)."""
    return fork_child(lambda: fastpersist.save(obj, dest, engine=engine))


def _wait(pid) -> int:
    _, status = os.waitpid(pid, 0)
    return status


def _pause_with_locked_temporary(folder, pid, timeout=30.0) -> str:
    """Stops child pid once its temporary exists and it holds the flock on it;
    returns the temporary's path."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        names = _temporaries(folder)
        if not names:
            done, status = os.waitpid(pid, os.WNOHANG)
            assert done == 0, f"the save finished (status {status}) before its temporary was seen"
            time.sleep(0.0005)
            continue
        assert len(names) == 1, names
        os.kill(pid, signal.SIGSTOP)
        _, status = os.waitpid(pid, os.WUNTRACED)
        assert os.WIFSTOPPED(status), status
        path = os.path.join(folder, names[0])
        if is_locked(path):
            return path  # the stopped writer holds its lock
        os.kill(pid, signal.SIGCONT)  # created but not locked yet: let it go on a little
        time.sleep(0.001)
    pytest.fail("no locked temporary appeared")


def test_sigkill_at_any_point_leaves_old_or_new_checkpoint(folder, engine, checkpoints):
    a, b = checkpoints
    dest = str(folder / "ckpt.pt")
    fastpersist.save(a, dest, engine=engine)
    assert _which(dest, a, b) == "A"

    # Calibrate: uninterrupted saves in a child, timed as the killed ones are;
    # the fastest of three (one slow first save on this noisy VM once spread
    # the kills so wide that only 4 landed mid-save)
    durations = []
    for _ in range(3):
        fastpersist.save(a, dest, engine=engine)
        start = time.monotonic()
        status = _wait(_fork_save(b, dest, engine))
        durations.append(time.monotonic() - start)
        assert os.waitstatus_to_exitcode(status) == 0, "the uninterrupted save failed in the child"
        assert _which(dest, a, b) == "B"
        assert _temporaries(folder) == []
    full = min(durations)

    outcomes = []
    for k in range(KILL_POINTS):
        delay = 1.2 * full * k / (KILL_POINTS - 1)
        # Back to A before every kill, through a normal save: it replaces B
        # and removes the temporary the previous kill left.
        fastpersist.save(a, dest, engine=engine)
        assert leftovers(folder) == [], f"a save left a file of a killed save ({outcomes[-1:]})"
        assert _which(dest, a, b) == "A"

        pid = _fork_save(b, dest, engine)
        time.sleep(delay)
        os.kill(pid, signal.SIGKILL)  # a child that already exited is a zombie until waitpid: no error
        status = _wait(pid)
        temps = _temporaries(folder)
        state = _which(dest, a, b)
        finished = os.WIFEXITED(status)
        outcomes.append((round(delay, 3), state, len(temps), "exited" if finished else "killed"))
        if finished:
            assert os.waitstatus_to_exitcode(status) == 0, f"the save in the child failed: {outcomes[-1]}"
            assert state == "B" and not temps, outcomes[-1]
        else:
            assert os.WTERMSIG(status) == signal.SIGKILL
        assert len(temps) <= 1, temps
        if temps:
            assert state == "A", f"the destination changed while the temporary still existed: {outcomes[-1]}"

    mid_save = sum(1 for _, _, temps, _ in outcomes if temps)
    print(f"{engine}: uninterrupted save {full:.3f} s; kills (delay, dest, temporaries, how): {outcomes}")
    assert mid_save >= MIN_MID_SAVE, f"only {mid_save} kills landed mid-save: {outcomes}"

    # One more kill, certainly mid-save, then a normal save in this process
    # removes what it left.
    fastpersist.save(a, dest, engine=engine)
    pid = _fork_save(b, dest, engine)
    try:
        temp = _pause_with_locked_temporary(str(folder), pid)
    finally:
        os.kill(pid, signal.SIGKILL)
        status = _wait(pid)
    assert os.WIFSIGNALED(status)
    assert os.path.exists(temp) and _temporaries(folder) == [os.path.basename(temp)]
    assert _which(dest, a, b) == "A"
    fastpersist.save(b, dest, engine=engine)
    assert leftovers(folder) == []
    assert _which(dest, a, b) == "B"


def test_temporary_of_a_paused_writer_process_is_kept(folder, engine, checkpoints):
    a, b = checkpoints
    dest = str(folder / "ckpt.pt")
    fastpersist.save(a, dest, engine=engine)
    pid = _fork_save(b, dest, engine)
    try:
        temp = _pause_with_locked_temporary(str(folder), pid)
        inode = os.stat(temp).st_ino
        fastpersist.save({"other": torch.ones(1000)}, folder / "other.pt", engine=engine)
        assert atomic_write.remove_stale_temporaries(str(folder)) == []
        assert os.stat(temp).st_ino == inode, "the live writer's temporary was replaced"
        assert _temporaries(folder) == [os.path.basename(temp)]
        assert _which(dest, a, b) == "A"
    finally:
        os.kill(pid, signal.SIGCONT)
        status = _wait(pid)
    assert os.waitstatus_to_exitcode(status) == 0, "the paused save failed once resumed"
    assert _which(dest, a, b) == "B"
    assert torch.equal(vanilla_load(folder / "other.pt")["other"], torch.ones(1000))
    assert _temporaries(folder) == []


_HOLDER = r"""
import fcntl, os, sys
fd = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o644)
os.write(fd, b"partial checkpoint")
fcntl.flock(fd, fcntl.LOCK_EX)
print("locked", flush=True)
sys.stdin.read()
"""


def test_temporary_locked_by_another_process_is_kept_then_removed(folder):
    name = ".ckpt.pt.fastpersist-0123456789abcdef.tmp"
    assert atomic_write.TEMPORARY_NAME.match(name)
    path = folder / name
    holder = subprocess.Popen([sys.executable, "-c", _HOLDER, str(path)], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "locked"
        for i in range(2):
            fastpersist.save({"i": i}, folder / "ckpt.pt")
            assert path.exists(), "a save removed a temporary whose writer holds its lock"
            assert path.read_bytes() == b"partial checkpoint"
    finally:
        holder.stdin.close()
        assert holder.wait(timeout=30) == 0
    assert leftovers(folder) == [name]
    fastpersist.save({"i": 2}, folder / "ckpt.pt")  # the writer is gone: the temporary is stale
    assert leftovers(folder) == []
    assert vanilla_load(folder / "ckpt.pt") == {"i": 2}


class _Gate:
    """Holds the saving thread's write of the planned checkpoint (its
    temporary exists and is locked by then) until the test lets it go."""

    def __init__(self):
        self.entered = threading.Event()
        self.release = threading.Event()
        self.thread = None

    def install(self, monkeypatch):
        torch_format = importlib.import_module("fastpersist.torch_format")
        real = torch_format.write_plan

        def gated(plan, sink):
            if threading.current_thread() is self.thread:
                self.entered.set()
                if not self.release.wait(60):
                    raise TimeoutError("the test never released the gate")
            return real(plan, sink)

        monkeypatch.setattr(torch_format, "write_plan", gated)


def test_temporary_of_another_threads_open_save_is_kept(folder, engine, monkeypatch):
    dest = folder / "ckpt.pt"
    gate = _Gate()
    gate.install(monkeypatch)
    tensor = torch.arange(300_000, dtype=torch.float32)
    errors = []

    def saver():
        try:
            fastpersist.save({"gate": 7, "t": tensor}, dest, engine=engine)
        except BaseException as exc:  # noqa: BLE001
            errors.append(exc)

    thread = gate.thread = threading.Thread(target=saver, daemon=True)
    thread.start()
    try:
        assert gate.entered.wait(30), f"the save never reached writing: {errors}"
        temps = _temporaries(folder)
        assert len(temps) == 1, temps
        temp = folder / temps[0]
        assert is_locked(temp)
        inode = os.stat(temp).st_ino
        fastpersist.save({"other": 1}, folder / "other.pt", engine=engine)
        assert atomic_write.remove_stale_temporaries(str(folder)) == []
        assert os.stat(temp).st_ino == inode
        assert not dest.exists()
    finally:
        gate.release.set()
        thread.join(60)
    assert not thread.is_alive(), "the gated save did not finish"
    assert not errors, errors
    loaded = vanilla_load(dest)
    assert loaded["gate"] == 7 and torch.equal(loaded["t"], tensor)
    assert vanilla_load(folder / "other.pt") == {"other": 1}
    assert _temporaries(folder) == []
