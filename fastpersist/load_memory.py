"""The memory a load reads a whole file into (an image of it, which its
tensors are slices of), and the images of loads whose tensors have all
died, kept a short while for the next load. Format-neutral: torch loads
and safetensors' load_file take their images here."""
from __future__ import annotations

import ctypes
import mmap as _mmap
import os
import queue
import threading
import time
import weakref
from typing import Optional

from .options import current_options


def image_memory(size: int) -> tuple:
    """(memory for an image of size bytes, whether it is fresh): a kept
    image's memory where one is large enough, else a new mapping.

    Rounded up to whole 2 MiB so the mapping starts on a huge-page
    boundary; no MADV_HUGEPAGE: with huge pages, faulting ahead of the reads
    ran at 0.7 GB/s here, against 2.2 GB/s with 4 KiB pages."""
    length = -(-size // (2 << 20)) * (2 << 20)
    memory = _freed_images.take(length)
    if memory is not None:
        return memory, False
    memory = _mmap.mmap(-1, length)
    if hasattr(_mmap, "MADV_NOHUGEPAGE"):
        memory.madvise(_mmap.MADV_NOHUGEPAGE)
    return memory, True


def as_buffer(memory: _mmap.mmap):
    """An image's memory as a buffer object: storages made over parts of it
    (torch.frombuffer) keep it alive; when the last of them dies, the memory
    is kept for the next load (or given back)."""
    owner = (ctypes.c_ubyte * len(memory)).from_buffer(memory)
    # Not at exit: then owner may still be alive, its tensors in use by
    # exit handlers, and a load there must not be handed their memory.
    weakref.finalize(owner, _result_died, memory).atexit = False
    return owner


def give_back(memory: _mmap.mmap) -> None:
    """The memory of an image no result was made of (a load that failed)."""
    _freed_images.give_back(memory)


class _FreedImages:
    """The memory of loads whose tensors have all died, kept a short while
    for the next load: a process that loads shard after shard (each freed
    once copied into the model) reads into memory already faulted in instead
    of faulting in fresh pages every time.

    What it holds is bounded: at most KEEP mappings, each for at most
    ``load_memory_seconds`` (an option; 0 keeps nothing) after its result
    died, and none while the system's available memory is below
    MIN_AVAILABLE_FRACTION of the total or would be less than what is kept.
    A forked child starts empty, and the parent gives its kept memory back
    before forking (a data loader's workers would carry it otherwise).
    ``release_load_memory()`` gives it back at once.

    A result's finalizer runs wherever a garbage collection happens to
    free it, including inside this pool's own locked code on the same
    thread; so it never takes a lock (an Event's included): it appends the
    mapping to a list (atomic, no lock) and rings the keeper thread through
    a SimpleQueue, whose put is safe in such callbacks. The mapping stays in
    that list until whoever holds the lock next (the keeper, take(), kept())
    files it: it is never in a thread's hands alone, where a look at the
    pool would miss it (as when the keeper took it off a queue and had not
    yet filed it)."""

    KEEP = 2
    MIN_AVAILABLE_FRACTION = 8  # keep nothing while less than 1/8 of memory is available

    def __init__(self):
        self.lock = threading.Lock()
        self.free: list = []  # [(mapping, monotonic time it was freed)], most recently freed last
        self.returned: list = []  # mappings of dead results, not yet filed
        self.doorbell: queue.SimpleQueue = queue.SimpleQueue()  # wakes the keeper; carries nothing
        self.keeper: Optional[threading.Thread] = None

    def result_died(self, memory: _mmap.mmap) -> None:
        """A result's finalizer: a list append and a SimpleQueue put, nothing else."""
        self.returned.append(memory)
        self.doorbell.put(None)

    def take(self, length: int) -> Optional[_mmap.mmap]:
        self._start_keeper()
        with self.lock:
            self._file_returned()
            fitting = [entry for entry in self.free if length <= len(entry[0]) <= 2 * length]
            if not fitting:
                return None
            entry = min(fitting, key=lambda e: len(e[0]))
            self.free.remove(entry)
            return entry[0]

    def give_back(self, memory: _mmap.mmap) -> None:
        """Memory that no result ever used (a load that failed)."""
        self.result_died(memory)

    def clear(self) -> None:
        with self.lock:
            self._file_returned()
            _unmap_all(self.free)

    def kept(self) -> list:
        """The mappings kept now, most recently freed last."""
        with self.lock:
            self._file_returned()
            return [memory for memory, _ in self.free]

    def _file_returned(self) -> Optional[float]:
        """Under the lock: files returned mappings, unmaps those past their
        time or beyond the bounds; returns when the next one is due."""
        now = time.monotonic()
        while True:
            try:
                self.free.append((self.returned.pop(0), now))  # atomic: a finalizer may append meanwhile
            except IndexError:
                break
        if not self.free:
            return None
        try:
            keep_for = current_options().load_memory_seconds
        except ValueError:  # a bad FASTPERSIST_ variable: the load itself says so
            keep_for = 0.0
        room = _available_memory()
        kept: list = []
        for entry in reversed(self.free):  # the most recently freed first
            memory, freed_at = entry
            if len(kept) < self.KEEP and now - freed_at < keep_for and len(memory) <= room:
                kept.append(entry)
                room -= len(memory)
            else:
                _unmap(memory)
        kept.reverse()
        self.free = kept
        return min((freed_at + keep_for for _, freed_at in kept), default=None)

    def _start_keeper(self) -> None:
        if self.keeper is None:
            with self.lock:
                if self.keeper is None:
                    self.keeper = threading.Thread(target=self._keep, name="fastpersist-load-memory", daemon=True)
                    self.keeper.start()

    def _keep(self) -> None:
        """The keeper thread: files what results return and unmaps each
        mapping when its time is up."""
        due = None
        while True:
            try:
                self.doorbell.get(timeout=None if due is None else max(0.0, due - time.monotonic()))
            except queue.Empty:
                pass
            with self.lock:
                due = self._file_returned()

    def before_fork(self) -> None:
        """Gives kept memory back in the parent; skipped if another thread
        holds the pool this instant (the child starts empty either way)."""
        if self.lock.acquire(blocking=False):
            try:
                self._file_returned()
                _unmap_all(self.free)
            finally:
                self.lock.release()


def _unmap_all(entries: list) -> None:
    while entries:
        _unmap(entries.pop()[0])


def _available_memory() -> int:
    """Bytes the pool may keep now: what the kernel reports available, less
    MIN_AVAILABLE_FRACTION of the total (kept memory counts as used)."""
    try:
        with open("/proc/meminfo", "rb") as f:
            fields = dict(line.split(b":", 1) for line in f.read().splitlines() if b":" in line)
        available = int(fields[b"MemAvailable"].split()[0]) << 10
        total = int(fields[b"MemTotal"].split()[0]) << 10
    except (OSError, KeyError, ValueError):
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        available = total // 2
    return max(0, available - total // _FreedImages.MIN_AVAILABLE_FRACTION)


def _unmap(memory: _mmap.mmap) -> None:
    """Returns a mapping's memory to the system now, or (while something
    still views it) when the last view goes."""
    try:
        memory.close()
    except BufferError:
        pass


_freed_images = _FreedImages()


def _result_died(memory: _mmap.mmap) -> None:
    """A load result's finalizer. Looks the pool up when called: in a forked
    child that is the child's, which owns its copy of the memory."""
    _freed_images.result_died(memory)


def release_load_memory() -> None:
    """Gives the memory fastpersist.load keeps from freed results (for the
    next load, at most ``load_memory_seconds``) back to the system now."""
    _freed_images.clear()


def _give_back_before_fork() -> None:
    _freed_images.before_fork()


def _forget_freed_images_in_child() -> None:
    global _freed_images
    _freed_images = _FreedImages()  # the parent's pages would be copied on write here


os.register_at_fork(before=_give_back_before_fork, after_in_child=_forget_freed_images_in_child)


