"""Where torch.save succeeds, fastpersist.save succeeds too: folders this
process may not write in, file names up to the longest allowed, files owned
by someone else, and NFS's rules for locks."""
import fcntl
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import textwrap

import pytest
import torch

import fastpersist
from fastpersist.patching import original_save

from conftest import leftovers, vanilla_load

from fastpersist import atomic_write
OBJ = {"w": torch.arange(300_000, dtype=torch.float32), "step": 7}


def as_root_without(caps: str, script: str, folder: str) -> subprocess.CompletedProcess:
    """Runs script as root less the named capabilities (as an ordinary user
    is without them); skips where that cannot be done."""
    if os.geteuid() != 0 or not shutil.which("capsh"):
        pytest.skip("needs root and capsh to drop capabilities")
    out = subprocess.run(["capsh", f"--drop={caps}", "--", "-c", f"{sys.executable} -c \"$0\"",
                          textwrap.dedent(script)], capture_output=True, text=True, timeout=300, cwd=folder,
                         env={**os.environ, "FASTPERSIST_AUTOPATCH": "0"})
    if "Operation not permitted" in out.stderr and "capsh" in out.stderr:
        pytest.skip(f"capsh cannot drop {caps} here: {out.stderr.strip()[:200]}")
    return out


@pytest.fixture
def open_folder():
    """A folder outside pytest's 0700 tree (a process without
    CAP_DAC_OVERRIDE must reach it); removed afterwards."""
    base = tempfile.mkdtemp(prefix="fastpersist-perm-", dir="/var/tmp")
    os.chmod(base, 0o755)
    yield base
    for root, dirs, _ in os.walk(base):
        for d in dirs:
            os.chmod(os.path.join(root, d), 0o755)
    shutil.rmtree(base, ignore_errors=True)


SAVE_TWICE_AND_COMPARE = """
    import logging, sys, torch, fastpersist
    from fastpersist.patching import original_save
    logging.basicConfig(level=logging.DEBUG, stream=sys.stdout, format="%(levelname)s %(message)s")
    obj = {"w": torch.arange(300_000, dtype=torch.float32), "step": 7}
    original_save()(obj, "locked/torch.pt")          # torch.save itself succeeds here
    fastpersist.save(obj, "locked/ckpt.pt")
    obj["step"] = 8
    fastpersist.save(obj, "locked/ckpt.pt")
    print("saved", torch.load("locked/ckpt.pt", weights_only=True)["step"])
"""


def test_a_writable_file_in_a_folder_that_is_not_writable_is_saved_in_place(open_folder):
    locked = os.path.join(open_folder, "locked")
    os.mkdir(locked)
    for name in ("ckpt.pt", "torch.pt"):
        original_save()({"old": True}, os.path.join(locked, name))
        os.chmod(os.path.join(locked, name), 0o644)
    os.chmod(locked, 0o555)  # root without CAP_DAC_OVERRIDE may write the files, not create any
    out = as_root_without("cap_dac_override,cap_dac_read_search,cap_fowner", SAVE_TWICE_AND_COMPARE, open_folder)
    assert out.returncode == 0, out.stderr + out.stdout
    assert "saved 8" in out.stdout
    warnings = [line for line in out.stdout.splitlines() if line.startswith("WARNING")]
    assert len(warnings) == 1 and "in place" in warnings[0] and locked in warnings[0], out.stdout
    assert sorted(os.listdir(locked)) == ["ckpt.pt", "torch.pt"]
    assert torch.equal(vanilla_load(os.path.join(locked, "ckpt.pt"))["w"], OBJ["w"])


def test_a_file_that_cannot_be_created_still_fails_as_torch_save_does(open_folder):
    locked = os.path.join(open_folder, "locked")
    os.mkdir(locked, 0o555)
    out = as_root_without("cap_dac_override,cap_dac_read_search,cap_fowner", """
        import torch, fastpersist
        from fastpersist.patching import original_save
        for save in (original_save(), fastpersist.save):
            try:
                save({"w": torch.ones(3)}, "locked/new.pt")
            except (OSError, RuntimeError) as exc:  # torch words it as a RuntimeError
                print(type(exc).__name__, getattr(exc, "filename", None))
    """, open_folder)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert len(lines) == 2 and lines[0].startswith("RuntimeError"), out.stdout
    assert lines[1] == "PermissionError locked/new.pt"
    assert os.listdir(locked) == []


def test_a_replaced_file_keeps_its_owner_and_group(folder):
    if os.geteuid() != 0:
        pytest.skip("needs root to give a file another owner")
    dest = folder / "ckpt.pt"
    original_save()({"old": True}, dest)
    os.chown(dest, 1234, 5678)
    os.chmod(dest, 0o640)
    fastpersist.save(OBJ, dest)
    st = os.stat(dest)
    assert (st.st_uid, st.st_gid, st.st_mode & 0o7777) == (1234, 5678, 0o640)
    assert vanilla_load(dest)["step"] == 7
    assert leftovers(folder) == []


def test_a_file_whose_owner_cannot_be_given_is_saved_in_place_keeping_it(open_folder):
    """Without CAP_CHOWN (an ordinary user writing a group-writable file of
    another user's): the temporary could not get the owner, so the file is
    written in place, as torch.save does, and keeps its owner."""
    locked = os.path.join(open_folder, "locked")
    os.mkdir(locked)
    for name in ("ckpt.pt", "torch.pt"):
        original_save()({"old": True}, os.path.join(locked, name))
        os.chown(os.path.join(locked, name), 1234, 5678)
        os.chmod(os.path.join(locked, name), 0o666)
    out = as_root_without("cap_chown", SAVE_TWICE_AND_COMPARE, open_folder)
    assert out.returncode == 0, out.stderr + out.stdout
    assert "saved 8" in out.stdout
    warnings = [line for line in out.stdout.splitlines() if line.startswith("WARNING")]
    assert len(warnings) == 1 and "owner and group" in warnings[0], out.stdout
    for name in ("ckpt.pt", "torch.pt"):
        st = os.stat(os.path.join(locked, name))
        assert (st.st_uid, st.st_gid) == (1234, 5678), name
    assert sorted(os.listdir(locked)) == ["ckpt.pt", "torch.pt"]


@pytest.mark.parametrize("name", ["n" * 222 + ".pt", "n" * 252 + ".pt", "é" * 126 + ".pt"],
                         ids=["225 bytes", "255 bytes", "255 bytes of two-byte characters"])
def test_file_names_up_to_the_longest_allowed_are_saved_and_replaced(folder, name):
    assert len(os.fsencode(name)) in (225, 255)
    dest = folder / name
    fastpersist.save({"old": True}, dest)  # new file: the temporary's name is cut to fit
    fastpersist.save(OBJ, dest)            # a replace: the trash name too
    assert vanilla_load(dest)["step"] == 7
    assert leftovers(folder) == []
    assert os.listdir(folder) == [name]


def test_a_save_killed_with_a_long_name_leaves_a_temporary_the_next_save_removes(folder):
    name = "n" * 252 + ".pt"
    stale = os.path.join(folder, atomic_write.release.hidden_name(str(folder), name, "0123456789abcdef", "tmp"))
    assert len(os.fsencode(os.path.basename(stale))) == 255 and atomic_write.TEMPORARY_NAME.match(
        os.path.basename(stale))
    with open(stale, "wb") as f:
        f.write(b"x" * 1000)
    fastpersist.save(OBJ, folder / name)
    assert not os.path.exists(stale)
    assert leftovers(folder) == []


# -- NFS: flock is a POSIX lock there ------------------------------------------------


@pytest.fixture
def nfs_locks(monkeypatch):
    """flock as Linux does it on NFS: a POSIX lock of the whole file. Its
    rules are the kernel's own, on this filesystem: an exclusive lock on a
    descriptor not open for writing fails with EBADF."""
    real_lockf = fcntl.lockf

    def flock_over_nfs(fd, operation):
        real_lockf(fd, operation)

    monkeypatch.setattr(fcntl, "flock", flock_over_nfs)


def test_saves_and_replaces_work_with_nfs_locks(folder, nfs_locks):
    dest = folder / "ckpt.pt"
    fastpersist.save({"old": True}, dest)
    fastpersist.save(OBJ, dest)
    assert vanilla_load(dest)["step"] == 7
    assert leftovers(folder) == []


def test_a_dead_saves_temporary_is_removed_with_nfs_locks(folder, nfs_locks, caplog):
    caplog.set_level(logging.INFO, logger="fastpersist")
    stale = folder / ".ckpt.pt.fastpersist-00000000deadbeef.tmp"
    stale.write_bytes(b"x" * 4096)
    fastpersist.save(OBJ, folder / "ckpt.pt")
    assert not stale.exists()
    assert any("did not finish" in r.getMessage() for r in caplog.records)


def test_a_live_writers_temporary_is_kept_with_nfs_locks(folder, nfs_locks):
    """Another process holds a POSIX lock on its temporary: left alone."""
    alive = folder / ".ckpt.pt.fastpersist-00000000cafef00d.tmp"
    alive.write_bytes(b"x" * 4096)
    holder = subprocess.Popen([sys.executable, "-c", (
        "import fcntl, os, sys\n"
        f"fd = os.open({str(alive)!r}, os.O_WRONLY)\n"
        "fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)\n"
        "print('locked', flush=True)\n"
        "sys.stdin.read()\n")], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "locked"
        fastpersist.save(OBJ, folder / "ckpt.pt")
        assert alive.exists()
    finally:
        holder.stdin.close()
        holder.wait(30)
    fastpersist.save(OBJ, folder / "ckpt.pt")
    assert not alive.exists()
