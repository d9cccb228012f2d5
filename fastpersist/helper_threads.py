"""Threads that help one call and never outlive it, and the signal that
stops them early.

A read that runs on helper threads writes into memory its caller owns
(an image of the file, the caller's own tensors). If the caller leaves
while a helper still reads (an interrupt raised in it, any exception), the
memory is freed or handed to the next load, and the helper goes on writing
into it. So the caller never leaves before every helper has stopped:

- ``HelperThreads`` starts helpers and, on leaving its ``with`` block,
  waits for each one that started, however the block ends. An exception
  raised while it waits (a second Ctrl-C, an asynchronous exception) does
  not cut the wait short; the first one is raised once all have stopped.
- ``StopSignal`` tells the work to stop early: page-cache readers look at it
  before each piece, the engine before each buffer (``word``). Leaving the
  block with an exception sets it, so the wait is for the pieces in hand,
  not the whole read.

A thread that starts after the block was left (``Thread.start()``
interrupted after the thread was created) sees the block closed and
returns before doing any work: no thread is left unaccounted for."""
from __future__ import annotations

import ctypes
import threading
from typing import Callable, Optional


class ReadStopped(Exception):
    """A read whose StopSignal was set ended early. Whoever set the signal
    raises its own exception; this one is only seen by the thread it gave up on."""


class StopSignal:
    """Set once, by whoever gives up on a read: the work stops at its next
    piece or buffer. A signal made with a parent is set when the parent is
    (a read inside a read that is given up on)."""

    def __init__(self, parent: Optional["StopSignal"] = None):
        self._word = ctypes.c_int(0)  # read by the engine's C loop (fp_read_extents_until)
        self._children: list = []
        if parent is not None:
            parent._children.append(self)  # a list append: atomic, no lock to be interrupted in
            if parent.is_set():
                self.set()

    def set(self) -> None:
        self._word.value = 1
        for child in list(self._children):
            child.set()

    def is_set(self) -> bool:
        return self._word.value != 0

    @property
    def word(self) -> int:
        """The address of the int the engine reads (non-zero: stop)."""
        return ctypes.addressof(self._word)


class HelperThreads:
    """Helpers of one call, used as ``with HelperThreads(parent) as helpers:``.
    ``helpers.start(target, *args)`` runs target on a new daemon thread
    and returns it (None where no thread could be had: the caller does that
    work); ``helpers.stop`` is their StopSignal (a child of parent's, where
    given). Leaving the block with an exception sets it; leaving it at all
    waits for every helper (see the module's docstring).

    Each helper holds a lock of its own while it runs, which wait()
    acquires: unlike Thread.join, an acquire cut short by an interrupt
    leaves nothing changed and is simply tried again. (Python 3.11's join,
    interrupted while the thread runs, releases the thread's own state lock
    and marks it stopped: a join or is_alive after that says it has ended
    while it still runs.)"""

    def __init__(self, parent: Optional[StopSignal] = None, name: str = "fastpersist-read"):
        self.stop = StopSignal(parent)
        self._name = name
        self._running: list = []  # (lock held while it runs, [done]) of each helper that began to run
        self._closed = False

    def __enter__(self) -> "HelperThreads":
        return self

    def __exit__(self, kind, exc, tb) -> None:
        if kind is not None:
            self.stop.set()
        self.wait()

    def start(self, target: Callable, *args) -> Optional[threading.Thread]:
        thread = threading.Thread(target=self._run, args=(target, args), name=self._name, daemon=True)
        try:
            thread.start()
        except RuntimeError:  # no more threads
            return None
        return thread

    def _run(self, target: Callable, args: tuple) -> None:
        running, done = threading.Lock(), [False]
        running.acquire()
        # Registered first, then the check: wait() closes first, then lists those registered. Under the GIL
        # one of the two orders holds, so a thread either is waited for or sees the block closed and leaves.
        self._running.append((running, done))
        try:
            if not self._closed:
                target(*args)
        finally:
            done[0] = True  # before the release: a waiter that got the lock, then was interrupted, sees it
            running.release()

    def wait(self) -> None:
        """Closes the block to threads not yet running and waits for each one
        that is; an exception raised meanwhile (an interrupt) sets stop and is
        raised once every helper has stopped."""
        self._closed = True
        first: Optional[BaseException] = None
        for running, done in list(self._running):
            while not done[0]:
                try:
                    running.acquire()
                except BaseException as exc:  # noqa: BLE001 - raised once every helper has stopped
                    self.stop.set()
                    if first is None:
                        first = exc
        if first is not None:
            raise first


__all__ = ["HelperThreads", "ReadStopped", "StopSignal"]
