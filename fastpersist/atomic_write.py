"""A file written whole, atomically and durably, by the engine: into a
locked temporary beside it that is renamed over it and fsynced with its
folder, or in place where no temporary can stand in for it (torch.save's
own behaviour). Format-neutral: torch checkpoints (save.py), safetensors
files and DCP's metadata are written through it. Temporaries a killed
process left behind are found by name and removed."""
from __future__ import annotations

import errno
import fcntl
import logging
import os
import re
import secrets
import stat
from typing import Optional

from . import release
from .fileio import same_file
from .options import Options
from .writer import FastFileWriter

log = logging.getLogger("fastpersist")


def write_to_path(path: str, opts: Options, fill, target: Optional[str] = None, expected_size: int = 0) -> int:
    """Writes the file at path with fill(writer), which returns the bytes it
    wrote: into a locked temporary that is renamed over path (opts.atomic),
    fsynced with its folder (opts.fsync). Where no such temporary can stand
    in for the file (a folder this process may not write in, an owner it
    may not give the temporary), it writes in place, as torch.save does.
    expected_size: the file's size where known (0: unknown)."""
    target = target or os.path.realpath(path)  # torch.save writes through symlinks
    folder = os.path.dirname(target)
    remove_stale_temporaries(folder)
    temporary = None
    try:
        if opts.atomic:
            temporary = _temporary_standing_in_for(target, opts, expected_size)
        # in place: truncates; freeing the old blocks stays on this save's path
        writer = temporary.writer if temporary else \
            FastFileWriter(target, truncate=True, sole_writer=True, options=opts, expected_size=expected_size)
    except OSError as exc:
        raise OSError(exc.errno, f"{exc.strerror} (fastpersist: creating a file in {folder})", path) from exc
    write_path = temporary.path if temporary else target
    try:
        size = fill(writer)
        writer.close()  # waits for every write; fsyncs the file with opts.fsync
        if temporary:
            # The replaced file's space is freed in the background, after the
            # block: with online discard a plain rename over it costs ~1 s per GB.
            with release.replacing(temporary.path, target):
                temporary.renamed()
                if opts.fsync:
                    _fsync_folder(folder)
    except BaseException as exc:
        writer.abort()
        if temporary:
            temporary.discard()
        if isinstance(exc, OSError) and exc.filename == write_path != path:
            # name the file the user asked for; the temporary one is gone
            raise OSError(exc.errno, f"{exc.strerror} (fastpersist: writing {write_path})", path) from exc
        raise
    finally:
        if temporary:
            temporary.unlock()
    return size


def _temporary_standing_in_for(target: str, opts: Options, expected_size: int = 0) -> Optional["_Temporary"]:
    """A locked temporary beside target, with target's owner, group and mode
    (torch.save truncates the file, keeping all three); None where this
    process cannot make one (said once per folder in the log): the save
    then writes in place, as torch.save would."""
    folder, name = os.path.split(target)
    try:
        temporary = _Temporary.create(folder, name, opts, expected_size=expected_size)
    except PermissionError as exc:  # EACCES, EPERM: a folder we may not write in; the file may still be writable
        _say_in_place(folder, f"no file can be created in the folder ({exc.strerror})")
        return None
    try:
        kept = _take_owner_and_mode(target, temporary.lock_fd)
    except BaseException:
        temporary.writer.abort()
        temporary.discard()
        temporary.unlock()
        raise
    if kept:
        return temporary
    temporary.writer.abort()
    temporary.discard()
    temporary.unlock()
    _say_in_place(folder, "this process may not give a new file the owner and group of the one it replaces")
    return None


_said_in_place: set = set()


def _say_in_place(folder: str, why: str) -> None:
    level = logging.DEBUG if (folder, why) in _said_in_place else logging.WARNING
    _said_in_place.add((folder, why))
    log.log(level, "fastpersist: saves in %s write the checkpoint in place, not through a temporary file "
            "renamed over it, because %s: a save that fails midway leaves a torn file there, as torch.save "
            "would", folder or ".", why)


# ---------------------------------------------------------------------------
# temporary files
#
# A save writes ".<name>.fastpersist-<random>.tmp" beside the destination and
# renames it into place. While it exists, its writer holds an exclusive
# flock() on it, from before anything is written until after the rename. A
# save that was killed (SIGKILL, preemption, power loss) leaves its temporary
# unlocked, and the next save into the folder removes it; a temporary whose
# writer is alive (in this process, another one, or on another host sharing
# the folder over NFS, where flock becomes a POSIX lock) is left alone.
#
# The next save also collects trash names (".<name>.fastpersist-<random>.old",
# see fastpersist.release) that a process died before unlinking: they only
# ever name a replaced checkpoint's data. Both kinds go to the background
# releaser, because freeing their blocks may cost seconds.

TEMPORARY_NAME = re.compile(r"^\..+\.fastpersist-[0-9a-f]{8,}\.tmp$")
_writing: set = set()  # this process's temporaries: NFS locks do not exclude the process itself


class LockHeld(OSError):
    """Another open file (another save, or its clean-up) holds the lock."""


def lock_exclusive(fd: int) -> None:
    """Locks fd exclusively without waiting; LockHeld if another holder has
    it. fd must be open for writing: on NFS Linux turns flock into a POSIX
    lock, whose exclusive kind needs that (EBADF otherwise)."""
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as exc:
        if exc.errno in (errno.EAGAIN, errno.EACCES):  # POSIX locks say EACCES on some systems
            raise LockHeld(exc.errno, "locked by another writer") from None
        raise


class _Temporary:
    def __init__(self, path: str, lock_fd: int, writer: FastFileWriter):
        self.path, self.lock_fd, self.writer = path, lock_fd, writer
        self.in_place = False  # renamed over the destination

    @classmethod
    def create(cls, folder: str, name: str, opts: Options, sole_writer: bool = True,
               expected_size: int = 0) -> "_Temporary":
        """A new, locked temporary beside the destination and a writer of it
        from offset 0 (the file's only writer unless sole_writer=False)."""
        for _ in range(16):
            path = os.path.join(folder, release.hidden_name(folder, name, secrets.token_hex(8), "tmp"))
            _writing.add(path)
            try:
                # O_EXCL: never an existing file, never through a symlink planted at the name
                writer = FastFileWriter(path, exclusive=True, sole_writer=sole_writer, options=opts,
                                        expected_size=expected_size)
            except FileExistsError:
                _writing.discard(path)
                continue
            except FileNotFoundError:
                _writing.discard(path)
                if not os.path.isdir(folder):
                    raise
                continue  # another save's clean-up removed it before the writer reopened it (O_DIRECT)
            except BaseException:
                _writing.discard(path)
                raise
            lock_fd = -1
            try:
                lock_fd = os.open(path, os.O_WRONLY | os.O_CLOEXEC | os.O_NOFOLLOW)
                lock_exclusive(lock_fd)
                # Another save's clean-up may have locked and removed the file
                # between its creation and our lock: then the name is not ours.
                if same_file(os.stat(path, follow_symlinks=False), os.fstat(writer.fd)):
                    return cls(path, lock_fd, writer)
            except (LockHeld, FileNotFoundError):
                pass  # a clean-up holds it or removed it; it removes the file too
            except BaseException:
                writer.abort()
                _close(lock_fd)
                _remove_quietly(path)
                _writing.discard(path)
                raise
            writer.abort()
            _close(lock_fd)
            _writing.discard(path)
        raise OSError(errno.EAGAIN, "could not create a locked temporary file", folder)

    def renamed(self) -> None:
        self.in_place = True

    def discard(self) -> None:
        if not self.in_place:
            _remove_quietly(self.path)

    def unlock(self) -> None:
        _close(self.lock_fd)
        self.lock_fd = -1
        _writing.discard(self.path)


def remove_stale_temporaries(folder: str) -> list:
    """Removes the temporaries of saves that died in this folder, and the
    trash names of processes that died before freeing them; their space is
    freed in the background. Returns their paths."""
    try:
        names = os.listdir(folder or ".")
    except OSError:
        return []
    removed = []
    for name in names:
        if name[:1] != "." or ".fastpersist-" not in name:  # most names: a step-numbered folder holds many
            continue
        path = os.path.join(folder, name)
        if release.TRASH_NAME.match(name):
            if _release_stale_trash(path):
                removed.append(path)
            continue
        if not TEMPORARY_NAME.match(name):
            continue
        if path in _writing:
            continue
        try:
            # for writing: on NFS an exclusive lock needs it (see lock_exclusive)
            fd = os.open(path, os.O_WRONLY | os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NONBLOCK)
        except OSError:
            continue  # gone already, a symlink (not ours to follow), or not ours to write
        trash = None
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                continue
            try:
                lock_exclusive(fd)
            except LockHeld:
                continue  # its writer is alive
            if not same_file(os.stat(path, follow_symlinks=False), st):
                continue  # renamed into place or replaced meanwhile
            # Still under the lock: a trash name takes the data, so unlinking
            # the temporary is cheap. Without hard links: unlinked here, as before.
            trash = release.link_to_trash(path, name[1:name.rindex(".fastpersist-")])
            os.unlink(path)
            removed.append(path)
            log.info("fastpersist: removed %s (%d bytes), left by a save that did not finish%s", path, st.st_size,
                     "; its space is freed in the background" if trash else "")
        except OSError:
            continue
        finally:
            os.close(fd)
            if trash:
                release.release_later(trash)  # after the close, or the close would free the data here
    return removed


def _release_stale_trash(path: str) -> bool:
    """Hands a trash name left by a process that died to the releaser,
    unless this process is releasing it already; never a symlink or other
    non-file planted at the name."""
    if release.releasing(path):
        return False
    try:
        st = os.lstat(path)
    except OSError:
        return False
    if not stat.S_ISREG(st.st_mode):
        return False
    release.release_later(path)
    log.info("fastpersist: freeing %s (%d bytes), a replaced checkpoint's data left by a process that ended "
             "before freeing it", path, st.st_size)
    return True


def _close(fd: int) -> None:
    if fd >= 0:
        os.close(fd)


def _take_owner_and_mode(target: str, fd: int) -> bool:
    """Gives the file open at fd target's owner, group and mode (torch.save
    truncates an existing file and so keeps them); a new file keeps what it
    was created with (0666 less the umask, this process's owner). False
    where this process may not give it target's owner and group."""
    try:
        st = os.stat(target)
    except FileNotFoundError:
        return True
    mine = os.fstat(fd)
    if (mine.st_uid, mine.st_gid) != (st.st_uid, st.st_gid):
        try:
            os.fchown(fd, st.st_uid, st.st_gid)  # before the mode: chown clears setuid and setgid bits
        except PermissionError:
            return False
    os.fchmod(fd, stat.S_IMODE(st.st_mode))
    return True


def _keep_mode_of(target: str, new_file: str) -> None:
    """For a file written under another name (a partitioned save's
    temporary): target's owner, group and mode, or a warning where the
    owner and group cannot be kept."""
    fd = os.open(new_file, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW)
    try:
        if not _take_owner_and_mode(target, fd):
            log.warning("fastpersist: %s replaces a file owned by uid %d, gid %d; this process may not give the new "
                        "file that owner and group", target, os.stat(target).st_uid, os.stat(target).st_gid)
            os.fchmod(fd, stat.S_IMODE(os.stat(target).st_mode))
    finally:
        os.close(fd)


def _fsync_folder(folder: str) -> None:
    fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    except OSError as exc:  # some filesystems cannot fsync a folder
        if exc.errno not in (errno.EINVAL, errno.ENOTSUP):
            raise
    finally:
        os.close(fd)


def _remove_quietly(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
