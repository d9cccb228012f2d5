"""Releasing a replaced checkpoint's space off the save's path: the old file
gets a trash name, the new one is renamed over the destination, and a
background thread unlinks the trash name. The destination always names a
complete checkpoint; trash left by a dead process is freed by the next save
in its folder; exit waits for pending releases; a forked child inherits none."""
import errno
import multiprocessing
import os
import signal
import subprocess
import sys
import threading

import pytest
import torch

import fastpersist
from fastpersist import release

from conftest import fork_child, leftovers, vanilla_load

from fastpersist import atomic_write

OLD = {"t": torch.arange(100_000, dtype=torch.float32), "which": "old"}
NEW = {"t": torch.arange(100_000, dtype=torch.float32) * -2, "which": "new"}


def trashes(folder):
    return sorted(name for name in os.listdir(folder) if release.TRASH_NAME.match(name))


def trash(folder, name="ckpt.pt", nbytes=300_000, token="0123456789abcdef"):
    """A trash name as a process that died before freeing it leaves it."""
    path = folder / f".{name}.fastpersist-{token}.old"
    path.write_bytes(b"\1" * nbytes)
    return path


@pytest.fixture
def held(monkeypatch):
    """Holds the releaser's unlinks until gate.set(); calls: the paths it was given."""
    gate, calls = threading.Event(), []
    real = release._unlink

    def unlink(path):
        calls.append(path)
        assert gate.wait(60), "the test never let the release go"
        real(path)

    monkeypatch.setattr(release, "_unlink", unlink)
    yield gate, calls
    gate.set()
    assert fastpersist.wait_for_releases(timeout=60)


def test_the_destination_names_old_until_the_rename_and_new_after(folder, monkeypatch):
    dest = folder / "ckpt.pt"
    fastpersist.save(OLD, dest)
    old_inode = os.stat(dest).st_ino
    seen = []
    real_replace = os.replace

    def replace(src, dst):
        assert vanilla_load(dest)["which"] == "old"
        names = trashes(folder)
        assert len(names) == 1 and names[0].startswith(".ckpt.pt.fastpersist-")
        st = os.stat(folder / names[0], follow_symlinks=False)
        assert st.st_ino == old_inode and st.st_nlink == 2  # a second name of the old file
        seen.append(names[0])
        real_replace(src, dst)
        assert vanilla_load(dest)["which"] == "new"

    monkeypatch.setattr(os, "replace", replace)
    fastpersist.save(NEW, dest)
    monkeypatch.undo()
    assert len(seen) == 1
    assert vanilla_load(dest)["which"] == "new"
    assert leftovers(folder) == []


def test_the_old_file_is_freed_in_the_background(folder, held):
    gate, calls = held
    dest = folder / "ckpt.pt"
    fastpersist.save(OLD, dest)
    fd = os.open(dest, os.O_RDONLY)  # the old file, seen through an open descriptor
    try:
        fastpersist.save(NEW, dest)  # returns while the release is held
        assert vanilla_load(dest)["which"] == "new"
        names = trashes(folder)
        assert len(names) == 1 and os.fstat(fd).st_nlink == 1
        assert release.releasing(folder / names[0]) and release.pending() == {str(folder / names[0])}
        assert not fastpersist.wait_for_releases(timeout=0.05)
        gate.set()
        assert fastpersist.wait_for_releases(timeout=60)
        assert os.fstat(fd).st_nlink == 0  # no name left: its space goes once this descriptor closes
        assert trashes(folder) == [] and calls == [str(folder / names[0])]
    finally:
        os.close(fd)
    assert leftovers(folder) == []


def test_a_new_path_needs_no_release(folder, held):
    _, calls = held
    fastpersist.save(OLD, folder / "ckpt.pt")
    assert calls == [] and trashes(folder) == []
    assert fastpersist.wait_for_releases(timeout=0)


@pytest.mark.parametrize("code", [errno.EPERM, errno.EXDEV, errno.EMLINK, errno.ENOTSUP, errno.ENOSYS])
def test_a_refused_hard_link_falls_back_to_a_plain_replace(folder, monkeypatch, held, code):
    _, calls = held
    dest = folder / "ckpt.pt"
    fastpersist.save(OLD, dest)
    fd = os.open(dest, os.O_RDONLY)
    try:
        def refuse(*args, **kwargs):
            raise OSError(code, os.strerror(code))

        monkeypatch.setattr(os, "link", refuse)
        fastpersist.save(NEW, dest)
        assert os.fstat(fd).st_nlink == 0  # replaced the plain way: nothing left to release
    finally:
        os.close(fd)
    assert vanilla_load(dest)["which"] == "new"
    assert calls == [] and leftovers(folder) == []


def test_a_trash_left_behind_is_freed_by_the_next_save_in_the_folder(folder, held, log_records):
    gate, calls = held
    left = trash(folder)
    other = trash(folder, "other.pt", token="fedcba9876543210")
    fastpersist.save(OLD, folder / "third.pt")  # any save into the folder
    # handed to the releaser, not unlinked on the save's path
    assert left.exists() and other.exists()
    assert release.releasing(left) and release.releasing(other)
    gate.set()
    assert fastpersist.wait_for_releases(timeout=60)
    assert sorted(calls) == sorted([str(left), str(other)])
    assert leftovers(folder) == []
    messages = [r.getMessage() for r in log_records.records]
    assert any(str(left) in m and "300000 bytes" in m for m in messages)


@pytest.mark.parametrize("moment", ["between link and rename", "after the rename"])
def test_a_process_killed_mid_replace_leaves_a_checkpoint_and_garbage_the_next_save_frees(folder, moment):
    dest = folder / "ckpt.pt"
    fastpersist.save(OLD, dest)

    def child():
        def die(*args, **kwargs):
            os.kill(os.getpid(), signal.SIGKILL)

        if moment == "between link and rename":
            os.replace = die
        else:
            release.release_later = die

        fastpersist.save(NEW, dest)

    pid = fork_child(child)
    _, status = os.waitpid(pid, 0)
    assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL
    names = trashes(folder)
    assert len(names) == 1
    if moment == "between link and rename":
        assert vanilla_load(dest)["which"] == "old"
        assert os.stat(folder / names[0]).st_ino == os.stat(dest).st_ino  # a second name of the checkpoint
    else:
        assert vanilla_load(dest)["which"] == "new"
        assert vanilla_load(folder / names[0])["which"] == "old"  # the old one's last name
    fastpersist.save(OLD, folder / "other.pt")
    assert leftovers(folder) == []  # the trash and the killed save's temporary
    assert vanilla_load(dest)["which"] == ("old" if moment == "between link and rename" else "new")


def test_a_stale_temporary_is_moved_to_a_trash_name_under_its_lock_and_freed_later(folder, held):
    gate, calls = held
    stale = folder / ".ckpt.pt.fastpersist-0123456789abcdef.tmp"
    stale.write_bytes(b"\0" * 300_000)
    inode = os.stat(stale).st_ino
    assert atomic_write.remove_stale_temporaries(str(folder)) == [str(stale)]
    assert not stale.exists()
    names = trashes(folder)
    assert len(names) == 1 and names[0].startswith(".ckpt.pt.fastpersist-")
    assert os.stat(folder / names[0]).st_ino == inode and release.releasing(folder / names[0])
    gate.set()
    assert fastpersist.wait_for_releases(timeout=60)
    assert calls == [str(folder / names[0])] and leftovers(folder) == []


def test_a_trash_being_released_is_not_handed_over_twice(folder, held):
    gate, calls = held
    dest = folder / "ckpt.pt"
    fastpersist.save(OLD, dest)
    fastpersist.save(NEW, dest)
    pending = trashes(folder)
    assert len(pending) == 1
    assert atomic_write.remove_stale_temporaries(str(folder)) == []
    fastpersist.save(OLD, folder / "other.pt")  # another save's clean-up in the folder
    release.release_later(folder / pending[0])  # and a direct request: still one unlink
    gate.set()
    assert fastpersist.wait_for_releases(timeout=60)
    assert calls == [str(folder / pending[0])]
    assert leftovers(folder) == []


def test_a_forked_child_does_not_inherit_pending_releases(folder, held):
    gate, calls = held
    dest = folder / "ckpt.pt"
    fastpersist.save(OLD, dest)
    fastpersist.save(NEW, dest)
    (pending,) = trashes(folder)
    assert release.releasing(folder / pending)

    def child():
        before = len(calls)  # the parent's thread may have taken its trash already
        assert release._releaser.thread is None and not release._releaser.pending
        assert fastpersist.wait_for_releases(timeout=0)  # nothing of the parent's to wait for
        assert release.releasing(folder / pending)  # but the parent's: left to the parent
        fastpersist.save(OLD, folder / "child.pt")
        fastpersist.save(NEW, folder / "child.pt")  # the child's own releaser works (its unlinks are held too)
        gate.set()  # the child's copy of the gate
        assert fastpersist.wait_for_releases(timeout=60)
        mine = calls[before:]
        assert len(mine) == 1 and mine[0].startswith(str(folder / ".child.pt.fastpersist-"))
        assert trashes(folder) == [pending]  # the parent's, left alone

    pid = fork_child(child)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    assert (folder / pending).exists()
    gate.set()
    assert fastpersist.wait_for_releases(timeout=60)
    assert calls == [str(folder / pending)]
    assert leftovers(folder) == []
    assert vanilla_load(folder / "child.pt")["which"] == "new"


_EXIT_SCRIPT = r"""
import sys, time, torch, fastpersist
from fastpersist import release
real = release._unlink
release._unlink = lambda path: (time.sleep(1.0), real(path))  # still pending when the script ends
folder = sys.argv[1]
for name in ("sync.pt", "async.pt"):
    fastpersist.save({"v": torch.zeros(1000)}, f"{folder}/{name}")
fastpersist.save({"v": torch.ones(1000)}, f"{folder}/sync.pt")
fastpersist.save_async({"v": torch.ones(1000)}, f"{folder}/async.pt")  # its release comes after its write
print("pending", len(release._releaser.pending), flush=True)
"""


def test_exit_waits_for_pending_releases(folder):
    out = subprocess.run([sys.executable, "-c", _EXIT_SCRIPT, str(folder)], capture_output=True, text=True,
                         timeout=300, env={**os.environ, "FASTPERSIST_AUTOPATCH": "0"})
    assert out.returncode == 0, out.stderr
    assert "pending 0" not in out.stdout
    assert leftovers(folder) == []
    assert torch.equal(vanilla_load(folder / "async.pt")["v"], torch.ones(1000))


def _replace_in_child(folder):
    torch.set_num_threads(1)  # torch 2.13 hangs in a forked child's parallel ops otherwise
    real = release._unlink
    release._unlink = lambda path: (threading.Event().wait(1.0), real(path))
    fastpersist.save({"v": torch.zeros(1000)}, os.path.join(folder, "mp.pt"))
    fastpersist.save_async({"v": torch.ones(1000)}, os.path.join(folder, "mp.pt"))  # returns at once


def test_a_multiprocessing_fork_child_waits_for_its_releases(folder):
    """Such children end with os._exit, which skips atexit: multiprocessing's own exit hooks wait."""
    child = multiprocessing.get_context("fork").Process(target=_replace_in_child, args=(str(folder),))
    child.start()
    child.join(120)
    assert child.exitcode == 0
    assert torch.equal(vanilla_load(folder / "mp.pt")["v"], torch.ones(1000))
    assert leftovers(folder) == []


def test_a_symlink_at_a_trash_name_is_never_followed(folder, monkeypatch):
    victim = folder / "victim.bin"
    victim.write_bytes(b"precious")
    planted = folder / ".ckpt.pt.fastpersist-aaaaaaaaaaaaaaaa.old"
    planted.symlink_to(victim)
    dest = folder / "ckpt.pt"
    fastpersist.save(OLD, dest)  # the clean-up skips the symlink
    tokens = iter(["aaaaaaaaaaaaaaaa", "bbbbbbbbbbbbbbbb"])
    monkeypatch.setattr(release, "_token", lambda: next(tokens))
    fastpersist.save(NEW, dest)  # link refuses the planted name; the next one is used
    assert fastpersist.wait_for_releases(timeout=60)
    assert planted.is_symlink() and victim.read_bytes() == b"precious"
    assert vanilla_load(dest)["which"] == "new"
    assert leftovers(folder) == [planted.name]


def test_a_destination_that_became_a_symlink_is_linked_not_followed(folder):
    """link_to_trash names the link itself, never what it points to."""
    victim = folder / "victim.bin"
    victim.write_bytes(b"precious")
    link = folder / "ckpt.pt"
    link.symlink_to(victim)
    name = release.link_to_trash(str(link))
    try:
        assert os.path.islink(name) and os.readlink(name) == str(victim)
    finally:
        release.release_later(name)
    assert fastpersist.wait_for_releases(timeout=60)
    assert not os.path.lexists(name) and victim.read_bytes() == b"precious"


def test_release_later_takes_relative_paths_and_logs_failures(folder, monkeypatch, held, log_records):
    gate, calls = held  # no unlink before the chdir below: a relative path would then miss its file
    data = folder / "shard.distcp"
    data.write_bytes(b"x" * 1000)
    (folder / "a folder").mkdir()
    monkeypatch.chdir(folder)
    release.release_later("shard.distcp")
    release.release_later("a folder")  # unlink fails: logged, never raised
    assert {str(data), str(folder / "a folder")} <= release.pending()  # made absolute when handed over
    monkeypatch.chdir("/")
    gate.set()
    assert fastpersist.wait_for_releases(timeout=60)
    assert calls == [str(data), str(folder / "a folder")]
    assert not data.exists() and (folder / "a folder").is_dir()
    assert any("a folder" in r.getMessage() and r.levelname == "WARNING" for r in log_records.records)
    fastpersist.save(OLD, folder / "ckpt.pt")  # a later save is unaffected
    assert vanilla_load(folder / "ckpt.pt")["which"] == "old"


def test_an_interrupt_right_after_the_trash_link_still_releases_it(folder, monkeypatch):
    """KeyboardInterrupt as link_to_trash returns (a signal handled at that
    call): the trash name it made is still handed to the releaser, so it is
    freed and neither wait_for_releases nor interpreter exit waits forever."""
    dest = folder / "ckpt.pt"
    fastpersist.save(OLD, dest)
    real = release.link_to_trash

    def interrupted(*args, **kwargs):
        real(*args, **kwargs)
        raise KeyboardInterrupt

    monkeypatch.setattr(release, "link_to_trash", interrupted)
    with pytest.raises(KeyboardInterrupt):
        fastpersist.save(NEW, dest)
    monkeypatch.undo()
    assert fastpersist.wait_for_releases(timeout=30), "a claimed trash name was never handed over"
    assert vanilla_load(dest)["which"] == "old"
    assert leftovers(folder) == []


def test_exit_does_not_wait_for_a_claim_that_is_never_handed_over(folder):
    """A name claimed by a thread that never hands it over (interrupted, or
    a daemon thread stopped with the interpreter) must not hold exit up."""
    script = ("import fastpersist\n"
              "from fastpersist import release\n"
              f"release._releaser.claim({str(folder / '.x.fastpersist-0123456789abcdef.old')!r})\n"
              "release.release_later(__file__ if '__file__' in globals() else '/nonexistent/x')\n"
              "print('exiting')\n")
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60,
                         env={**os.environ, "FASTPERSIST_AUTOPATCH": "0"})
    assert out.returncode == 0 and out.stdout.strip() == "exiting", out.stderr
