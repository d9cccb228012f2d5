"""fastpersist.release: freeing a replaced checkpoint's space off the save's
critical path.

Where the filesystem frees blocks synchronously (ext4 mounted with online
``discard``: about 0.4 to 1 s per GB), renaming a new checkpoint over an old
one, or unlinking the old one, costs as much as writing a good part of the
new one. So a save first gives the old file a second, "trash" name beside it
(``.<name>.fastpersist-<16 hex>.old``), then renames the new file over the
destination (cheap: the old data still has a name), then hands the trash
name to one background thread that unlinks it. The destination names the
old or the new complete file at every instant.

A trash name only ever names garbage: a second name of the checkpoint about
to be replaced, or the last name of one replaced. One left behind by a
process that died is collected by the next save in its folder
(``save.remove_stale_temporaries``), through this module too. At interpreter
exit, pending releases are waited for, so the space is freed when the
process ends normally; a forked child starts with none of its parent's.
"""
from __future__ import annotations

import atexit
import collections
import contextlib
import errno
import logging
import multiprocessing.util
import os
import re
import threading
import time
from typing import Optional

log = logging.getLogger("fastpersist")

TRASH_NAME = re.compile(r"^\..+\.fastpersist-[0-9a-f]{16}\.old$")


class _Releaser:
    """One daemon thread unlinking queued paths, started on first use."""

    def __init__(self, parents: frozenset = frozenset()):
        self.parents = parents  # a forked child's: what the parent was releasing; the parent's to finish
        self.lock = threading.Condition()
        self.queue: collections.deque = collections.deque()
        self.queued: set = set()  # submitted, not yet unlinked
        self.pending: set = set()  # queued, or claimed by a replace in progress
        self.thread: Optional[threading.Thread] = None

    def claim(self, path: str) -> None:
        with self.lock:
            self.pending.add(path)

    def drop(self, path: str) -> None:
        with self.lock:
            if path not in self.queued:
                self.pending.discard(path)
                self.lock.notify_all()

    def submit(self, path: str) -> None:
        with self.lock:
            if path in self.queued:
                return  # already on its way: one unlink per path
            if self.thread is None:
                thread = threading.Thread(target=self._run, name="fastpersist-release", daemon=True)
                thread.start()
                self.thread = thread
                # A multiprocessing child started by fork ends with os._exit, which skips
                # atexit; below the save_async writer's priority (100): its saves add releases.
                multiprocessing.util.Finalize(None, _at_exit, exitpriority=50)
            self.pending.add(path)
            self.queued.add(path)
            self.queue.append(path)
            self.lock.notify_all()

    def _run(self) -> None:
        while True:
            with self.lock:
                while not self.queue:
                    self.lock.wait()
                path = self.queue.popleft()
            start = time.monotonic()
            try:
                _unlink(path)
                log.debug("fastpersist: freed %s in %.3f s", path, time.monotonic() - start)
            except FileNotFoundError:
                pass  # another process's clean-up got there first
            except BaseException as exc:  # noqa: BLE001 - logged; never raised into a later save
                log.warning("fastpersist: could not remove %s, which holds a replaced checkpoint's data: %s",
                            path, exc)
            finally:
                with self.lock:
                    self.queued.discard(path)
                    self.pending.discard(path)
                    self.lock.notify_all()

    def wait(self, timeout: Optional[float], queued_only: bool = False) -> bool:
        with self.lock:
            return self.lock.wait_for(lambda: not (self.queued if queued_only else self.pending), timeout)


_releaser = _Releaser()


def _unlink(path: str) -> None:
    os.unlink(path)  # a function of its own: tests hold it to see a release in progress


def _token() -> str:
    return os.urandom(8).hex()  # unpredictable, like the temporaries' names; its own function for tests


def hidden_name(folder: str, name: str, token: str, kind: str) -> str:
    """``.<name>.fastpersist-<token>.<kind>``, the name's part shortened
    (by bytes) where the whole would pass the folder's longest file name: a
    checkpoint whose own name is 226-255 bytes long still gets its
    temporary and trash names."""
    suffix = os.fsencode(f".fastpersist-{token}.{kind}")
    try:
        longest = os.pathconf(folder or ".", "PC_NAME_MAX")
    except (OSError, ValueError):
        longest = 255
    room = max(1, longest - 1 - len(suffix))
    return os.fsdecode(b"." + os.fsencode(name)[:room] + suffix)


def link_to_trash(path: str, name: Optional[str] = None, claimed: Optional[list] = None) -> Optional[str]:
    """Gives the file at path a second, fresh trash name beside it and
    returns that name, claimed by this process (hand it to release_later);
    None where no link can be made: nothing at path, or a filesystem without
    hard links. The name is the link itself (linkat without
    AT_SYMLINK_FOLLOW): never a symlink's target, never through a symlink
    planted at the trash name (link refuses an existing name). name: the
    destination's name, for the trash name (default: path's). claimed: a
    list the name is appended to the moment it exists, so that a caller
    interrupted (KeyboardInterrupt) before this returns still knows it."""
    path = os.path.abspath(path)
    folder, base = os.path.split(path)
    for _ in range(16):
        trash = os.path.join(folder, hidden_name(folder, name or base, _token(), "old"))
        _releaser.claim(trash)  # before it exists: this process's clean-up leaves it alone
        try:
            os.link(path, trash, follow_symlinks=False)
            if claimed is not None:
                claimed.append(trash)
            return trash
        except FileExistsError:
            _releaser.drop(trash)
            continue
        except OSError as exc:
            _releaser.drop(trash)
            # EPERM, ENOTSUP, EXDEV, EMLINK, ENOSYS...: no hard links here; the caller does without
            if exc.errno != errno.ENOENT:
                log.debug("fastpersist: cannot link %s to a trash name (%s); its space is freed synchronously",
                          path, exc)
            return None
        except BaseException:
            # interrupted after the link was made, before it was handed back: a name
            # nobody claims, collected by the next save in the folder like any stale one
            _releaser.drop(trash)
            raise
    return None


@contextlib.contextmanager
def replacing(new_path: str, target: str):
    """os.replace(new_path, target) on entry; the file replaced is handed to
    the background releaser on exit, whatever happens in the block. Fsync
    the folder inside the block: an unlink in flight would hold that fsync
    up. Raises what os.replace raises; target then still names its file."""
    claimed: list = []  # the trash name, from the moment it exists, whatever interrupts us
    try:
        link_to_trash(target, claimed=claimed)
        os.replace(new_path, target)  # without a trash name (no old file, no hard links): the plain way
        yield
    finally:
        for trash in claimed:
            # After a failed replace the trash is a second name of the file still at target: cheap to drop.
            release_later(trash)


def replace_releasing_later(new_path: str, target: str) -> None:
    """os.replace(new_path, target), except that the file replaced is freed
    by the background releaser, not by the rename."""
    with replacing(new_path, target):
        pass


def release_later(path: str) -> None:
    """Unlinks path in the background: for files whose data is garbage (a
    replaced checkpoint's), whose unlink may cost seconds. Failures are
    logged, never raised."""
    _releaser.submit(os.path.abspath(path))


def releasing(path: str) -> bool:
    """Whether this process (or, in a forked child, its parent at the fork)
    has path queued or claimed for release: not for anyone else in this
    process to touch."""
    path = os.path.abspath(path)
    with _releaser.lock:
        return path in _releaser.pending or path in _releaser.parents


def pending() -> frozenset:
    """The absolute paths this process has queued or claimed for release
    (wait_for_releases waits for them)."""
    with _releaser.lock:
        return frozenset(_releaser.pending)


def wait_for_releases(timeout: Optional[float] = None) -> bool:
    """Waits until this process's replaced checkpoints are unlinked
    (``fastpersist.wait_for_releases``); returns False if timeout ran out first.
    Called at interpreter exit too."""
    return _releaser.wait(timeout)


def _at_exit() -> None:
    # What was handed over; not bare claims: a claim whose holder will never
    # hand it over (a thread interrupted, or stopped with the interpreter)
    # must not make exit wait forever.
    _releaser.wait(None, queued_only=True)


def _forget_in_child() -> None:
    """After fork, in the child: the parent's queue and thread are the
    parent's (the thread does not exist here); start with none. What the
    parent was releasing stays the parent's: the child's clean-up leaves it
    alone, and the child's exit does not wait for it."""
    global _releaser
    parent = _releaser
    # copied without the lock, which a thread that does not exist here may hold; the GIL keeps the sets whole
    _releaser = _Releaser(frozenset(parent.pending) | parent.parents)


# Registered at import, and fastpersist.async_save imports this module before
# registering its own: atexit runs last-registered first, so the save_async
# writer finishes (and queues its releases) before this waits.
atexit.register(_at_exit)
os.register_at_fork(after_in_child=_forget_in_child)

__all__ = ["TRASH_NAME", "link_to_trash", "pending", "release_later", "releasing", "replace_releasing_later",
           "replacing", "wait_for_releases"]
