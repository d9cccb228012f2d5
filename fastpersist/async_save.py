"""fastpersist.save_async: a checkpoint snapshotted into host memory that
fastpersist owns, then written in the background while training goes on.

The calling thread pickles the object (torch's own pickling) and plans the
archive, then copies every storage's bytes into snapshot memory; from then on
the caller may change its tensors freely. One background thread writes the
planned checkpoints in submission order, each exactly as fastpersist.save
does (temporary file, fsync, rename, folder fsync). Snapshot memory is kept
and reused from save to save, because touching fresh memory costs more than
the copy itself; it is bounded by the snapshot_memory option.
"""
from __future__ import annotations

import atexit
import importlib
import logging
import mmap
import multiprocessing.util
import os
import pickle
import queue
import sys
import threading
import traceback
import weakref
from typing import Optional

from . import _engine, _torch_api, device_io, torch_format
from . import release  # noqa: F401 - registers its exit hook before ours, so it runs after ours
from .distributed import checkpoint_group, next_sequence, write_partitioned
from .options import Options, current_options

# the module fastpersist.save (the package's attribute of that name is the
# public function); its functions are looked up at call time
_single = importlib.import_module(".save", __package__)

log = logging.getLogger("fastpersist")

_ALIGN = 64  # each storage's copy starts on a cache line
_ARENA_STEP = 64 << 20  # arenas grow in these steps, so checkpoints of similar sizes reuse one


class SaveHandle:
    """The future of one save_async: ``wait()``, ``done()``, ``result()``."""

    def __init__(self, path: str):
        self.path = path
        self._event = threading.Event()
        self._size: Optional[int] = None
        self._error: Optional[BaseException] = None
        self._observed = False  # someone called wait() or result(): they saw any error

    def done(self) -> bool:
        """True once the checkpoint is durable at its path, or the save failed."""
        return self._event.is_set()

    def wait(self, timeout: Optional[float] = None) -> None:
        """Blocks until the save has finished; raises what the background write raised.

        Args:
            timeout: seconds to wait at most; None waits for as long as it takes.

        Raises:
            TimeoutError: the save had not finished within ``timeout``.
            OSError: the background write failed (the previous file is untouched).
        """
        if not self._event.wait(timeout):
            raise TimeoutError(f"fastpersist: the save of {self.path} has not finished within {timeout} s")
        self._observed = True
        if self._error is not None:
            raise self._error

    def result(self, timeout: Optional[float] = None) -> int:
        """Waits, then returns the checkpoint's size in bytes.

        Args:
            timeout: as for :meth:`wait`.

        Raises:
            TimeoutError: as for :meth:`wait`; and what the background write raised.
        """
        self.wait(timeout)
        return self._size

    def _finish(self, size: Optional[int] = None, error: Optional[BaseException] = None) -> None:
        self._size, self._error = size, error
        self._event.set()

    def __repr__(self) -> str:
        state = "pending" if not self.done() else ("failed" if self._error else "done")
        return f"<fastpersist.SaveHandle {self.path!r} {state}>"


# ---------------------------------------------------------------------------
# snapshot memory


class _Arena:
    """One anonymous mapping that snapshots are copied into."""

    def __init__(self, size: int):
        import torch

        self.size = size
        # private: a forked child gets its own copy on write, never the parent's pages
        self.memory = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE)
        if hasattr(mmap, "MADV_HUGEPAGE"):
            self.memory.madvise(mmap.MADV_HUGEPAGE)  # cheaper first touch, fewer TLB misses in the copy
        self.bytes = torch.frombuffer(self.memory, dtype=torch.uint8)
        self.registered_in = 0  # the process that registered it with CUDA, 0: none

    def register_for(self, device) -> None:
        """Before the first copy from a CUDA device into this arena: registers
        it with CUDA (page-locked, so device-to-host copies go by DMA at full
        speed), once. It is unregistered when the arena is collected, before
        its mapping goes, and never in a forked child (the mapping is the
        child's own copy there, and CUDA unusable)."""
        if device.type != "cuda" or self.registered_in == os.getpid():
            return
        unregister = device_io.register_host_memory(self.bytes.data_ptr(), self.size, "snapshot memory")
        if unregister is not None:
            self.registered_in = os.getpid()
            # Page-locked pages of a private mapping are copied at fork, not shared copy-on-write: every
            # fork-based DataLoader worker would copy the whole arena. Children never get it mapped.
            self.memory.madvise(mmap.MADV_DONTFORK)
            _kept_from_children.add(self)
            # holds the mapping until the unregistering is done; at exit the process takes both away
            weakref.finalize(self, _unregister_in, os.getpid(), unregister, self.memory).atexit = False

    def mapped_here(self) -> bool:
        """False in a forked child for an arena registered in an ancestor."""
        return not self.registered_in or self.registered_in == os.getpid()


# Arenas marked MADV_DONTFORK, weakly; in a forked child, strongly and forever (_forked_away): their
# address range is not mapped there, and unmapping it when one is collected could unmap what the
# child has mapped there since.
_kept_from_children: "weakref.WeakSet[_Arena]" = weakref.WeakSet()
_forked_away: list = []
device_io.keep_forever(_forked_away)  # not even at a child's exit: freeing them would unmap the child's own memory


def _unregister_in(pid: int, unregister, _mapping) -> None:
    if os.getpid() == pid:
        unregister()


class _SnapshotMemory:
    """Arenas kept for reuse, at most `limit` bytes of them in all."""

    def __init__(self):
        self.lock = threading.Condition()
        self.free: list[_Arena] = []
        self.total = 0  # bytes of arenas, free or in use

    def take(self, nbytes: int, limit: int) -> _Arena:
        if nbytes > limit:
            raise ValueError(f"fastpersist save_async: the checkpoint's tensors need {nbytes} bytes of snapshot "
                             f"memory, more than snapshot_memory={limit}; raise that option or use "
                             "fastpersist.save")
        size = -(-nbytes // _ARENA_STEP) * _ARENA_STEP
        with self.lock:
            while True:
                fitting = [a for a in self.free if a.size >= nbytes]
                if fitting:
                    arena = min(fitting, key=lambda a: a.size)
                    self.free.remove(arena)
                    return arena
                while self.free and self.total + size > limit:  # too small to reuse: make room
                    self.total -= self.free.pop().size
                if self.total + min(size, limit) <= limit:
                    size = min(size, limit)
                    self.total += size
                    break
                self.lock.wait()  # earlier saves hold the memory: wait for one to finish
        try:
            return _Arena(size)
        except BaseException:
            with self.lock:
                self.total -= size
                self.lock.notify_all()
            raise

    def give_back(self, arena: _Arena) -> None:
        with self.lock:
            if arena.mapped_here():
                self.free.append(arena)
            else:  # an ancestor's arena, given back in a forked child (a staged tensor died there)
                self.total -= arena.size
            self.lock.notify_all()

    def clear(self) -> None:
        """Frees the arenas not in use."""
        with self.lock:
            self.total -= sum(a.size for a in self.free)
            self.free.clear()


def _memory_limit(opts: Options) -> int:
    """snapshot_memory, or half of the memory this process may use: the
    machine's, or its cgroup's (a container's) where that is smaller."""
    if opts.snapshot_memory:
        return opts.snapshot_memory
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    for limit_file in ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"):
        try:
            with open(limit_file) as f:
                text = f.read().strip()
        except OSError:
            continue
        if text.isdigit():
            total = min(total, int(text))
        break
    return total // 2


def _snapshot(plan: torch_format.CheckpointPlan, arena_source: "_SnapshotMemory", limit: int):
    """Copies every storage of the plan into snapshot memory and points the
    plan at the copies; returns the arena (or None: no tensor data)."""
    storages = {}
    for r in plan.records:
        if r.source.storage is not None and r.source.nbytes:
            # a device storage (captured while pickling) is copied once, straight into the snapshot
            storages.setdefault((r.source.storage.data_ptr(), r.source.nbytes), r.source.storage)
    if not storages:
        return None
    copy = _SnapshotCopy.into(storages, arena_source, limit, background=False)
    copy.finish()
    if copy.error is not None:
        arena_source.give_back(copy.arena)
        raise copy.error
    copy.adopt(plan)
    return copy.arena


# ---------------------------------------------------------------------------
# the background writer


class _Job:
    def __init__(self, plan, path: str, opts: Options, arena, handle: SaveHandle, group=None,
                 planning_error: Optional[BaseException] = None, sequence: int = 0):
        self.plan, self.path, self.opts, self.arena, self.handle = plan, path, opts, arena, handle
        # partitioned saves only: the checkpoint group, this rank's planning error, which of the group's saves
        self.group, self.planning_error, self.sequence = group, planning_error, sequence
        self.target = os.path.realpath(path)


def _drop_frames(exc: BaseException) -> None:
    """Clears the locals of every frame in exc's tracebacks (and its causes'),
    so a stored error keeps no engine, plan or snapshot memory alive."""
    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        traceback.clear_frames(exc.__traceback__)
        exc = exc.__cause__ or exc.__context__


class _Writer:
    """One thread writing queued checkpoints in submission order."""

    def __init__(self):
        self.lock = threading.Lock()
        self.jobs: "queue.SimpleQueue[_Job]" = queue.SimpleQueue()
        self.pending: list[_Job] = []  # submitted, not finished, in order
        self.thread: Optional[threading.Thread] = None
        self.memory = _SnapshotMemory()
        self.unobserved_failures: list[SaveHandle] = []

    def submit(self, job: _Job) -> None:
        with self.lock:
            if self.thread is None:
                thread = threading.Thread(target=self._run, name="fastpersist-save-async", daemon=True)
                thread.start()
                self.thread = thread
                # A multiprocessing child started by fork ends with os._exit, which
                # skips atexit: its own exit hook waits for the saves too.
                multiprocessing.util.Finalize(None, _at_exit, exitpriority=100)
            self.jobs.put(job)  # queued before it counts as pending: the writer always finds it
            self.pending.append(job)

    def _run(self) -> None:
        while True:
            job = self.jobs.get()
            size, error = None, None
            try:
                # the file the caller named when it called save_async (not after a chdir)
                if job.group is not None:
                    size = write_partitioned(job.plan, job.path, job.group, job.opts, job.planning_error,
                                             target=job.target, sequence=job.sequence)
                else:
                    size = _single.write_plan_to_path(job.plan, job.path, job.opts, target=job.target)
            except BaseException as exc:  # noqa: BLE001 - handed to the caller through wait()
                error = exc
                _drop_frames(exc)  # the traceback would keep the engine and the snapshot alive
                log.error("fastpersist: the background save of %s failed: %s", job.path, exc)
            finally:
                if job.arena is not None:
                    self.memory.give_back(job.arena)
                # the writer waits for the next job holding this one: nothing of it may outlive the save
                # (a process group held here outlives destroy_process_group(); see distributed.py)
                job.plan = job.arena = job.group = None
            job.handle._finish(size, error)
            with self.lock:
                if job in self.pending:
                    self.pending.remove(job)
                if error is not None:
                    self.unobserved_failures = [h for h in self.unobserved_failures if not h._observed]
                    self.unobserved_failures.append(job.handle)

    def unfinished(self, target: Optional[str] = None) -> list[SaveHandle]:
        with self.lock:
            return [j.handle for j in self.pending if target is None or j.target == target]


_writer = _Writer()


def save_async(obj, f, pickle_module=pickle, pickle_protocol: int = _torch_api.DEFAULT_PROTOCOL,
               _disable_byteorder_record: bool = False, *, group=None, **options) -> SaveHandle:
    """Saves ``obj`` to the path ``f`` like :func:`fastpersist.save`, in the
    background; returns a :class:`SaveHandle` once the tensors are copied.

    Returns after torch's pickling and one copy of every tensor's bytes into
    host memory that fastpersist owns (kept and reused from save to save,
    bounded by the ``snapshot_memory`` option): changing the tensors
    afterwards does not change the checkpoint. The file is written by one
    background thread, saves in submission order, each atomic and durable
    like ``fastpersist.save``'s. A later ``fastpersist.save`` to the same path
    waits for the earlier ones. Errors are raised by ``handle.wait()`` (and
    logged); at interpreter exit, unfinished saves are waited for and
    failures nobody waited for are reported on stderr.

    ``group``: as for ``fastpersist.save``, every rank calls save_async with
    the same state and writes its share of the one file, in the background;
    the ranks' exchanges run on a gloo group of the same ranks made for
    checkpoints (on the first call, at the same point on every rank), never
    on ``group`` itself, which training goes on using. Every rank's handle
    fails if any rank's share fails; a pickling error on one rank too comes
    out of ``wait()`` on every rank.

    Args:
        obj: what to save, as for :func:`fastpersist.save`.
        f: a ``str`` or ``os.PathLike`` path; file objects are refused.
        pickle_module: as ``torch.save``'s.
        pickle_protocol: as ``torch.save``'s.
        _disable_byteorder_record: as ``torch.save``'s.
        group: a ``torch.distributed`` process group whose ranks all save the
            same state into the one file, or None.
        **options: :class:`fastpersist.Options` fields for this save
            (``snapshot_memory`` bounds the host memory snapshots may hold).

    Returns:
        A :class:`SaveHandle`: ``wait()``, ``done()``, ``result()`` (the size).

    Raises:
        TypeError: ``f`` is not a path (or a target torch itself rejects).
        ValueError: an option is unknown or out of range, or the tensors need
            more snapshot memory than the whole ``snapshot_memory`` bound.
        Exception: whatever torch's pickling of ``obj`` raises, on the
            caller's thread. Errors of the background write come out of
            ``handle.wait()`` instead.
    """
    opts = current_options().replace(**options)
    reason = _single.not_accelerated_because(f, pickle_module, True)
    if group is not None:
        return _save_async_partitioned(obj, f, group, opts, pickle_module, pickle_protocol,
                                       _disable_byteorder_record, reason)
    if reason:
        raise TypeError(f"fastpersist.save_async writes checkpoints to paths; {f!r}: {reason}")
    path = os.fspath(f)
    plan, arena = _plan_and_snapshot(obj, path, opts, pickle_module, pickle_protocol, _disable_byteorder_record)
    return _submit(_Job(plan, path, opts, arena, SaveHandle(path)))


def _plan_and_snapshot(obj, path: str, opts: Options, pickle_module, pickle_protocol: int,
                       disable_byteorder_record: bool):
    """The plan, with every storage copied into snapshot memory: the
    caller's stall. The tensors found by walking obj's containers are copied
    while torch pickles obj: CPU ones on a helper thread (each takes about
    as long: 0.07 s of copying and 0.01 s of pickling for 365 tensors of 1
    GB here), GPU ones queued on a side stream without blocking, waited for
    once at the end; whatever the walk did not find (tensors inside other
    objects) is copied after planning, as before."""
    limit = _memory_limit(opts)
    found = _storages_in(obj)
    early = _SnapshotCopy.into(found, _writer.memory, limit, background=True) if found else None
    try:
        plan = torch_format.CheckpointPlan.for_path(obj, path, pickle_module, pickle_protocol,
                                                    disable_byteorder_record)
    except BaseException:
        if early is not None:
            _writer.memory.give_back(early.finish())
        raise
    if early is not None:
        arena = early.finish()
        if early.error is None and early.adopt(plan):
            return plan, arena
        _writer.memory.give_back(arena)  # something was not found: the whole snapshot after planning
        if early.error is not None and not isinstance(early.error, Exception):
            raise early.error
    return plan, _snapshot(plan, _writer.memory, limit)


class _HostCopy:
    """A storage's copy in snapshot memory, as the plan's writers use it
    (data_ptr, device); the job holds the arena until the file is written."""

    __slots__ = ("address",)

    def __init__(self, address: int):
        self.address = address

    def data_ptr(self) -> int:
        return self.address

    @property
    def device(self):
        import torch

        return torch.device("cpu")


def _storages_in(obj, budget: int = 1_000_000) -> dict:
    """{(data_ptr, nbytes): storage} of the dense CPU and CUDA tensors
    reachable through obj's dicts, lists and tuples (a state dict, an
    optimizer's, a checkpoint dict of them); others are left to the plan.
    {} where the walk meets a tensor it cannot take (on another device, a
    subclass): the plan would hold a storage with no early copy, so none
    is made."""
    import torch

    found, seen, stack = {}, set(), [obj]
    while stack and budget > 0:
        budget -= 1
        node = stack.pop()
        if isinstance(node, torch.Tensor):
            if not (node.device.type in ("cpu", "cuda") and node.layout == torch.strided and not node.is_quantized
                    and type(node) in (torch.Tensor, torch.nn.Parameter)):
                return {}
            storage = node.untyped_storage()
            if storage.nbytes():
                found.setdefault((storage.data_ptr(), storage.nbytes()), storage)
        elif isinstance(node, (dict, list, tuple)) and id(node) not in seen:
            seen.add(id(node))
            stack.extend(node.values() if isinstance(node, dict) else node)
    return found


_as_bytes = device_io.byte_view


_COPY_AS_FROM_A_DEVICE = False  # tests: CPU storages take the device storages' copy


class _SnapshotCopy:
    """The copy of storages ({(data_ptr, nbytes): storage}) into one arena of
    snapshot memory. CPU storages by fp_copy_many (one C call, without the
    GIL, as many threads as copy_ uses), in the background on a helper
    thread while the caller goes on (torch pickles the object), where asked
    and worth it. GPU storages by device-to-host copies queued at once on a
    side stream of each device (which first waits for the caller's current
    stream: kernels queued before the save write what it saves), into the
    arena registered with CUDA; finish() waits for them once, not once per
    storage."""

    MIN_BYTES = 4 << 20  # below this no helper thread: copied at once

    def __init__(self, storages: dict, arena: "_Arena", background: bool):
        import torch

        self.storages, self.arena, self.error = storages, arena, None
        self.addresses, copies, device_copies, offset = {}, [], [], 0
        base = int(arena.bytes.data_ptr())
        for key, storage in storages.items():
            self.addresses[key] = base + offset
            if storage.device.type == "cpu" and not _COPY_AS_FROM_A_DEVICE:
                copies.append((storage.data_ptr(), base + offset, key[1]))
            else:
                device_copies.append((storage, offset, key[1]))
            offset += -(-key[1] // _ALIGN) * _ALIGN
        threads = max(1, min(8, torch.get_num_threads()))  # as many as copy_ would use
        self.thread = None
        self.streams: dict = {}  # CUDA device -> the side stream its copies are queued on
        self._queue_device_copies(device_copies)
        if not background or offset < self.MIN_BYTES:
            self._copy(copies, threads)
            return
        thread = threading.Thread(target=self._copy, args=(copies, threads), daemon=True, name="fastpersist-snapshot")
        try:
            thread.start()
        except BaseException:
            # the arena goes back to the pool next: no copy may still write into it
            if thread.ident is not None:  # started, then interrupted while start() waited for it
                thread.join()
            self._wait_for_device()
            raise
        self.thread = thread

    @classmethod
    def into(cls, storages: dict, memory: "_SnapshotMemory", limit: int,
             background: bool) -> Optional["_SnapshotCopy"]:
        """The copy into an arena taken from memory; None in the background
        where the storages need more than the bound (the plan's snapshot then
        refuses with the reason), ValueError otherwise."""
        need = sum(-(-n // _ALIGN) * _ALIGN for _, n in storages)
        if background and need > limit:
            return None
        arena = memory.take(need, limit)
        try:
            return cls(storages, arena, background)
        except BaseException:
            memory.give_back(arena)
            raise

    def _copy(self, copies: list, threads: int) -> None:
        try:
            _engine.copy_many(copies, threads)
        except BaseException as exc:  # noqa: BLE001 - raised by finish()
            self.error = exc

    def _queue_device_copies(self, device_copies: list) -> None:
        """One device-to-host copy per storage, into the snapshot itself
        (torch's _save would first copy to fresh host memory), without
        blocking: finish() waits for them."""
        import torch

        try:
            for storage, offset, nbytes in device_copies:
                device = storage.device
                target = self.arena.bytes[offset:offset + nbytes]
                if device.type != "cuda":
                    target.copy_(_as_bytes(storage))
                    continue
                side = self.streams.get(device)
                if side is None:
                    self.arena.register_for(device)  # page-locked: the copies run as DMA, truly without blocking
                    side = self.streams[device] = torch.cuda.Stream(device)
                    side.wait_stream(torch.cuda.current_stream(device))
                with torch.cuda.stream(side):
                    target.copy_(_as_bytes(storage), non_blocking=True)
        except BaseException as exc:  # noqa: BLE001 - raised by finish()
            self.error = exc

    def finish(self) -> "_Arena":
        """Waits for the copies; returns the arena (its copies are valid only
        where error is None)."""
        if self.thread is not None:
            self.thread.join()
        self._wait_for_device()
        return self.arena

    def _wait_for_device(self) -> None:
        for side in self.streams.values():
            try:
                side.synchronize()  # the arena holds the storages' bytes as of the call from here on
            except BaseException as exc:  # noqa: BLE001 - raised by the caller
                self.error = self.error or exc

    def adopt(self, plan: torch_format.CheckpointPlan) -> bool:
        """Points each of the plan's storage records at its copy; False
        (nothing changed) where a record has none."""
        records = [r for r in plan.records if r.source.storage is not None and r.source.nbytes]
        keys = [(r.source.storage.data_ptr(), r.source.nbytes) for r in records]
        if any(key not in self.addresses for key in keys):
            return False
        for r, key in zip(records, keys):
            r.source.storage = _HostCopy(self.addresses[key])
        self.storages = None  # the copies stand in for them now
        return True


def _submit(job: _Job) -> SaveHandle:
    try:
        _writer.submit(job)
    except BaseException:  # e.g. KeyboardInterrupt: the snapshot memory must not leak
        if job.arena is not None:
            _writer.memory.give_back(job.arena)
        raise
    return job.handle


def _save_async_partitioned(obj, f, group, opts: Options, pickle_module, pickle_protocol: int,
                            disable_byteorder_record: bool, reason: Optional[str]) -> SaveHandle:
    """save_async(group=...): whatever goes wrong on this rank still reaches
    the ranks' exchange, in the background, so that every rank's save fails
    and none waits forever."""
    io_group = checkpoint_group(group)
    sequence = next_sequence(group)
    path = os.fspath(f) if isinstance(f, (str, os.PathLike)) else repr(f)
    plan, arena, error = None, None, None
    try:
        if reason:
            raise TypeError(f"fastpersist.save_async writes checkpoints to paths; {f!r}: {reason}")
        plan, arena = _plan_and_snapshot(obj, path, opts, pickle_module, pickle_protocol, disable_byteorder_record)
    except BaseException as exc:  # noqa: BLE001 - _snapshot gives its memory back itself
        error = exc
    handle = _submit(_Job(plan, path, opts, arena, SaveHandle(path), io_group, error, sequence))
    if error is not None and not isinstance(error, Exception):
        raise error  # KeyboardInterrupt: the caller's, after the other ranks were told
    return handle


def wait_for_saves_to(path: str) -> None:
    """Waits for unfinished save_async calls to path (their errors stay theirs)."""
    if not _writer.pending:  # every save calls this; most processes have none in flight
        return
    target = os.path.realpath(path)
    for handle in _writer.unfinished(target):
        handle._event.wait()


def wait_for_all() -> None:
    """Waits for every unfinished save_async of this process (``fastpersist.wait_for_saves``).
    Call it before ``torch.distributed.destroy_process_group()`` when group
    saves may be in flight: they need their group to finish."""
    for handle in _writer.unfinished():
        handle._event.wait()


def snapshot_memory() -> _SnapshotMemory:
    """The snapshot memory of this process's saves (fastpersist.dcp stages into it too)."""
    return _writer.memory


def release_snapshot_memory() -> None:
    """Frees the snapshot memory that no unfinished save holds. The next
    ``save_async`` allocates and faults in what it needs again."""
    _writer.memory.clear()


def _at_exit() -> None:
    unfinished = _writer.unfinished()
    if unfinished:
        print(f"fastpersist: waiting for {len(unfinished)} checkpoint save(s) to finish before exit: "
              + ", ".join(h.path for h in unfinished), file=sys.stderr, flush=True)
        wait_for_all()
    with _writer.lock:
        failed = [h for h in _writer.unobserved_failures if not h._observed]
    for handle in failed:
        handle._observed = True  # said once, though this runs from atexit and multiprocessing's exit
        print(f"fastpersist: ERROR: the background save of {handle.path} failed and nobody called wait(): "
              f"{type(handle._error).__name__}: {handle._error}", file=sys.stderr, flush=True)


def _forget_in_child() -> None:
    """After fork, in the child: the parent's background writer does not
    exist here and its saves are the parent's to finish; start afresh.
    Handles of the parent's unfinished saves fail in the child instead of
    blocking forever."""
    global _writer
    _forked_away.extend(_kept_from_children)  # the child's pool is new: the parent's arenas are never reused here
    parent = _writer
    _writer = _Writer()
    for job in list(parent.pending):
        # A new Event: the writer thread may have held the old one's lock at the fork.
        job.handle._event = threading.Event()
        job.handle._finish(error=RuntimeError(
            f"fastpersist: the save of {job.path} belongs to process {os.getppid()}, which forked this "
            "one; it finishes there, not here"))


atexit.register(_at_exit)
os.register_at_fork(after_in_child=_forget_in_child)

__all__ = ["SaveHandle", "release_snapshot_memory", "save_async", "wait_for_all"]
