"""Temporary files of atomic saves: unpredictable names, created with O_EXCL,
locked while written, removed by a later save only when their writer is
dead; file permissions as torch.save gives them; awkward path names."""
import fcntl
import importlib
import os
import re
import stat

import pytest
import torch

import fastpersist

from fastpersist import atomic_write

from conftest import is_locked, leftovers, vanilla_load

OBJ = {"t": torch.arange(10_000, dtype=torch.float32)}


def stale(folder, name="ckpt.pt", nbytes=300_000, token="0123456789abcdef"):
    """A temporary as a killed save leaves it: written, unlocked."""
    path = folder / f".{name}.fastpersist-{token}.tmp"
    path.write_bytes(b"\0" * nbytes)
    return path


def test_dead_writers_temporaries_are_removed_by_the_next_save(folder, log_records):
    old_style = stale(folder, "other.pt", token="deadbeef")  # 32-bit names of earlier versions
    mine = stale(folder, "ckpt.pt")
    unrelated = folder / ".ckpt.pt.fastpersist-notours.tmp"
    unrelated.write_bytes(b"keep")
    (folder / "notes.txt").write_text("keep")
    fastpersist.save(OBJ, folder / "ckpt.pt")
    assert not mine.exists() and not old_style.exists()
    assert unrelated.exists() and (folder / "notes.txt").exists()
    assert leftovers(folder) == [unrelated.name]
    messages = [r.getMessage() for r in log_records.records]
    assert any(str(mine) in m and "300000 bytes" in m and "did not finish" in m for m in messages)


def test_a_locked_temporary_is_left_alone(folder):
    """A temporary whose writer holds its lock (here: another open file
    description in this process, as a concurrent save would) survives."""
    alive = stale(folder)
    fd = os.open(alive, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        fastpersist.save(OBJ, folder / "ckpt.pt")
        assert alive.exists()
    finally:
        os.close(fd)
    fastpersist.save(OBJ, folder / "ckpt.pt")
    assert not alive.exists()


def test_a_temporary_is_locked_while_its_save_runs(folder, monkeypatch):
    """Seen from outside during the save: the temporary exists and its lock is held."""
    seen = []
    real = atomic_write.release.replacing

    def look(temporary, target):  # written, about to be renamed over the destination
        assert is_locked(temporary)
        assert atomic_write.remove_stale_temporaries(str(folder)) == []
        seen.append(temporary)
        return real(temporary, target)

    monkeypatch.setattr(atomic_write.release, "replacing", look)
    fastpersist.save(OBJ, folder / "ckpt.pt")
    assert len(seen) == 1 and not os.path.exists(seen[0])
    assert torch.equal(vanilla_load(folder / "ckpt.pt")["t"], OBJ["t"])


def test_symlinks_named_like_temporaries_are_neither_followed_nor_removed(folder):
    victim = folder / "victim.bin"
    victim.write_bytes(b"precious")
    link = folder / ".ckpt.pt.fastpersist-0123456789abcdef.tmp"
    link.symlink_to(victim)
    fastpersist.save(OBJ, folder / "ckpt.pt")
    assert link.is_symlink() and victim.read_bytes() == b"precious"


def test_a_symlink_planted_at_the_temporary_name_is_not_written_through(folder, monkeypatch):
    """O_EXCL refuses the planted name; the save takes another one."""
    victim = folder / "victim.bin"
    victim.write_bytes(b"precious")
    planted = folder / ".ckpt.pt.fastpersist-aaaaaaaaaaaaaaaa.tmp"
    planted.symlink_to(victim)
    tokens = iter(["aaaaaaaaaaaaaaaa", "bbbbbbbbbbbbbbbb"])
    monkeypatch.setattr(atomic_write.secrets, "token_hex", lambda n: next(tokens))
    fastpersist.save(OBJ, folder / "ckpt.pt")
    assert victim.read_bytes() == b"precious"
    assert planted.is_symlink()
    assert torch.equal(vanilla_load(folder / "ckpt.pt")["t"], OBJ["t"])


def test_a_temporary_removed_by_another_saves_clean_up_before_it_is_locked_is_given_up(folder, monkeypatch):
    """Between creating its temporary and locking it, a save reopens it for
    O_DIRECT; another save's clean-up may remove it in between (the file is
    not locked yet). The save takes another name instead of failing."""
    writer_module = importlib.import_module("fastpersist.writer")
    real = writer_module.open_direct
    removed = []

    def cleaned_up_first(path, flags, same_as=-1):
        if not removed:  # what another process's clean-up does to the unlocked file
            os.unlink(path)
            removed.append(path)
        return real(path, flags, same_as)

    monkeypatch.setattr(writer_module, "open_direct", cleaned_up_first)
    fastpersist.save(OBJ, folder / "ckpt.pt")
    assert len(removed) == 1
    assert torch.equal(vanilla_load(folder / "ckpt.pt")["t"], OBJ["t"])
    assert leftovers(folder) == []


def test_temporary_names_are_unpredictable(folder, monkeypatch):
    names = []
    real = atomic_write.release.replacing
    monkeypatch.setattr(atomic_write.release, "replacing", lambda tmp, t: (names.append(os.path.basename(tmp)),
                                                                          real(tmp, t))[1])
    for _ in range(3):
        fastpersist.save(OBJ, folder / "ckpt.pt")
    assert len(set(names)) == 3
    assert all(re.fullmatch(r"\.ckpt\.pt\.fastpersist-[0-9a-f]{16}\.tmp", n) for n in names)


@pytest.mark.parametrize("umask", [0o022, 0o077, 0o002])
def test_new_files_get_torch_saves_permissions(folder, umask):
    old = os.umask(umask)
    try:
        torch.save(OBJ, folder / "torch.pt")
        fastpersist.save(OBJ, folder / "fast.pt")
    finally:
        os.umask(old)
    mode = stat.S_IMODE(os.stat(folder / "fast.pt").st_mode)
    assert mode == stat.S_IMODE(os.stat(folder / "torch.pt").st_mode) == 0o666 & ~umask


@pytest.mark.parametrize("name", ["my checkpoint.pt", "chéckpoint ünïcode.pt", "日本語.pt", "a b/c d.pt"])
def test_awkward_path_names(folder, name):
    path = folder / name
    path.parent.mkdir(exist_ok=True)
    fastpersist.save(OBJ, path)
    torch.save(OBJ, folder / "reference.pt")
    assert torch.equal(vanilla_load(path)["t"], OBJ["t"])
    assert torch.equal(fastpersist.load(path)["t"], OBJ["t"])
    # the archive prefix follows torch's rule for the name (non-ASCII: "archive")
    import zipfile
    ours = zipfile.ZipFile(path).namelist()
    torch.save(OBJ, folder / ("ref-" + os.path.basename(name)))
    theirs = zipfile.ZipFile(folder / ("ref-" + os.path.basename(name))).namelist()
    prefix = lambda names: {n.split("/")[0] for n in names}
    expected = {os.path.splitext(os.path.basename(name))[0]} if name.isascii() else {"archive"}
    assert prefix(ours) == expected
    assert prefix(theirs) == ({"ref-" + next(iter(expected))} if name.isascii() else {"archive"})
    assert leftovers(path.parent) == []


def test_durability_order_file_fsync_rename_folder_fsync(folder, monkeypatch):
    """The file's bytes are durable before the rename makes them the
    checkpoint, and the rename is durable before save returns."""
    calls = []
    real_fsync, real_replace = os.fsync, os.replace

    def fsync(fd):
        calls.append("fsync folder" if stat.S_ISDIR(os.fstat(fd).st_mode) else "fsync file")
        return real_fsync(fd)

    def replace(src, dst):
        calls.append("rename")
        return real_replace(src, dst)

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "replace", replace)
    fastpersist.save(OBJ, folder / "ckpt.pt")
    assert calls == ["fsync file", "rename", "fsync folder"]
    calls.clear()
    fastpersist.save(OBJ, folder / "ckpt.pt", fsync=False)
    assert calls == ["rename"]
