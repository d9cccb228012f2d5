"""torch.distributed.checkpoint (DCP) storage on fastpersist's engine.

``FastPersistWriter`` and ``FastPersistReader`` write and read the files of
DCP's own ``FileSystemWriter``: a folder holding one ``.distcp`` data file
per rank and a ``.metadata`` file. Each tensor is a small torch.save archive
at a recorded offset in its rank's file, each bytes item its raw bytes; so
DCP's stock ``FileSystemReader`` reads what ``FastPersistWriter`` wrote, and
``FastPersistReader`` reads what ``FileSystemWriter`` wrote. DCP never picks
a third-party storage by itself; pass it::

    import torch.distributed.checkpoint as dcp
    from fastpersist.dcp import FastPersistWriter, FastPersistReader

    dcp.save(state_dict, storage_writer=FastPersistWriter("ckpt/step-100"))
    dcp.load(state_dict, storage_reader=FastPersistReader("ckpt/step-100"))
    future = dcp.async_save(state_dict, storage_writer=FastPersistWriter("ckpt/step-200"))

DCP drives a writer through this sequence (``dcp.save``): ``reset`` ->
``set_up_storage_writer`` -> ``prepare_local_plan`` (every rank) ->
``prepare_global_plan`` (the coordinator) -> ``write_data`` (every rank) ->
``finish`` (the coordinator, once every rank has written). A reader
(``dcp.load``): ``reset`` -> ``read_metadata`` -> ``set_up_storage_reader`` ->
``prepare_local_plan`` -> ``prepare_global_plan`` -> ``read_data``.

How a save commits (at least as safe as DCP's own):

1. Every rank writes its data file through the engine (O_DIRECT, pinned
   double buffers) and fsyncs it and the folder.
2. Only then (DCP calls ``finish`` after every rank's ``write_data``) the
   coordinator writes the metadata to a locked temporary, fsyncs it, renames
   it over ``.metadata`` and fsyncs the folder. A folder never lacks a
   ``.metadata`` while a complete checkpoint is in it (DCP's writer deletes
   the old one before renaming).
3. A save into a folder that holds a checkpoint names its data files afresh
   (``__<rank>_<tag>_0.distcp``) instead of overwriting the files the old
   metadata points to, so until step 2 the old checkpoint stays whole. After
   the commit the old checkpoint's files, and data files that saves which
   died left behind, are removed in the background (freeing space can take
   seconds per GB, and is not the save's business).
"""
from __future__ import annotations

import dataclasses
import io
import logging
import mmap as _mmap
import os
import pickle
import re
import uuid
import weakref
from typing import Optional

import torch
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner, SavePlan, SavePlanner, WriteItemType
from torch.distributed.checkpoint.staging import AsyncStager
from torch.distributed.checkpoint.storage import StorageReader, StorageWriter, WriteResult
from torch.futures import Future

from . import _torch_api, atomic_write, read_pipeline, torch_format
from .options import Options, current_options
from .writer import FastFileWriter

log = logging.getLogger("fastpersist")

DATA_SUFFIX = ".distcp"
# data files as DCP names them (__<rank>_<n>.distcp) and as fastpersist names
# them when replacing a checkpoint (__<rank>_<tag>_<n>.distcp)
DATA_FILE_NAME = re.compile(r"^__\d+_(?:[0-9a-f]{8}_)?\d+\.distcp$")
_READ_BATCH = 256 << 20  # bytes read ahead of copying out: bounds the staging memory of a load
# bytes read at each end of a tensor's archive to find its data: its small
# records lie there, and the end record is looked for in the last 69,653
# bytes (where miniz, and so torch.load, looks)
_EDGE = 80 << 10
_DIRECT_MIN = 4 * _EDGE  # smaller tensors are staged whole: one read, no second pass


@dataclasses.dataclass(frozen=True)
class _RankFiles:
    """A rank's share of the global plan: how its data files are named."""

    prefix: str


def _options(overrides: dict) -> Options:
    return current_options().replace(**overrides)


def _fsync_folder(folder: str) -> None:
    from .atomic_write import _fsync_folder as fsync_folder

    fsync_folder(folder)


def _referenced_files(metadata_path: str) -> Optional[set]:
    """The data files a checkpoint's metadata points to; None where there is
    no metadata. A metadata file that cannot be read points to every name."""
    try:
        with open(metadata_path, "rb") as f:
            metadata = pickle.load(f)
    except FileNotFoundError:
        return None
    except Exception as exc:  # noqa: BLE001 - a damaged file: keep every data file
        log.warning("fastpersist.dcp: cannot read %s (%s); its data files are kept", metadata_path, exc)
        return {"*"}
    return {info.relative_path for info in (metadata.storage_data or {}).values()}


class _CheckpointFolder:
    """What DCP asks of both storages about their checkpoint: a folder path."""

    path: str

    @property
    def checkpoint_id(self):
        return self.path

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id) -> bool:
        return _torch_api.dcp_filesystem().FileSystem.validate_checkpoint_id(checkpoint_id)


class FastPersistWriter(_CheckpointFolder, StorageWriter, AsyncStager):
    """A DCP ``StorageWriter`` that writes ``FileSystemWriter``'s files through fastpersist.

    path: the checkpoint folder (created if missing).
    sync_files: make data and metadata durable before the save returns.
    overwrite: False refuses a folder that holds a checkpoint (as DCP's writer does).
    options: fastpersist options for the engine (``buffer_size``, ``engine``, ...).

    It is also DCP's stager for ``dcp.async_save``: ``stage`` copies the state
    dict into fastpersist's snapshot memory (reused from save to save, bounded
    by the ``snapshot_memory`` option), which training may then overwrite.
    """

    _synchronize_after_execute = False  # staging is done when stage() returns

    def __init__(self, path, *, sync_files: bool = True, overwrite: bool = True, **options):
        super().__init__()
        self.path = os.fspath(path)
        self.sync_files = sync_files
        self.overwrite = overwrite
        self.options = dict(options)
        _options(self.options)  # wrong options fail here, not inside dcp.save
        self.save_id = str(uuid.uuid4())
        self.rank: Optional[int] = None
        self.is_coordinator = False
        self.use_collectives = True

    # -- DCP's call sequence ----------------------------------------------
    def reset(self, checkpoint_id=None) -> None:
        if checkpoint_id:
            self.path = os.fspath(checkpoint_id)
        self.save_id = str(uuid.uuid4())

    def set_up_storage_writer(self, is_coordinator: bool, *args, **kwargs) -> None:
        self.is_coordinator = is_coordinator
        self.rank = kwargs.get("rank")
        self.use_collectives = kwargs.get("use_collectives", True)

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        os.makedirs(self.path, exist_ok=True)
        if os.path.exists(self._metadata_path()) and not self.overwrite:
            raise RuntimeError(f"fastpersist.dcp: {self.path} holds a checkpoint and overwrite=False")
        if self.rank is not None and not self.use_collectives:  # no global plan: name this rank's files here
            plan = dataclasses.replace(plan, storage_data=_RankFiles(self._prefix(self.rank)))
        return plan

    def prepare_global_plan(self, plans: list) -> list:
        return [plan if plan.storage_data is not None
                else dataclasses.replace(plan, storage_data=_RankFiles(self._prefix(rank)))
                for rank, plan in enumerate(plans)]

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future:
        name = f"{plan.storage_data.prefix}0{DATA_SUFFIX}"
        path = os.path.join(self.path, name)
        opts = _options(self.options).replace(fsync=self.sync_files)
        pieces = self._plan_file(plan, planner)
        results = []
        offset = 0
        storage_info = _torch_api.dcp_filesystem()._StorageInfo
        for item, piece in pieces:
            length = len(piece) if isinstance(piece, (bytes, memoryview)) else piece.size
            results.append(WriteResult(index=item.index, size_in_bytes=length,
                                       storage_data=storage_info(name, offset, length)))
            offset += length
        _wait_for_release_of(path)
        # not O_EXCL: a save that died may have left a file at this name, unreferenced
        writer = FastFileWriter(path, truncate=True, sole_writer=True, options=opts, expected_size=offset)
        try:
            for _, piece in pieces:
                if isinstance(piece, torch_format.CheckpointPlan):
                    torch_format.write_plan(piece, writer)
                else:
                    writer.write(piece)
            writer.close()  # every write done, and fsynced with sync_files
            if self.sync_files:
                _fsync_folder(self.path)
        except BaseException:
            writer.abort()
            _remove_quietly(path)
            raise
        future: Future = Future()
        future.set_result(results)
        return future

    def finish(self, metadata: Metadata, results: list) -> None:
        fs = _torch_api.dcp_filesystem()
        metadata.version = fs.CURRENT_DCP_VERSION
        metadata.storage_data = {r.index: r.storage_data for rank_results in results for r in rank_results}
        metadata.storage_meta = self.storage_meta()
        metadata_path = self._metadata_path()
        replaced = _referenced_files(metadata_path)
        data = pickle.dumps(metadata)
        atomic_write.write_to_path(metadata_path, _options(self.options).replace(fsync=self.sync_files, atomic=True),
                                   lambda writer: writer.write(data))
        self._release_unreferenced(replaced, {info.relative_path for info in metadata.storage_data.values()})

    def storage_meta(self) -> Optional[StorageMeta]:
        return StorageMeta(checkpoint_id=self.checkpoint_id, save_id=self.save_id)

    # -- dcp.async_save's stager ------------------------------------------
    def stage(self, state_dict):
        return stage_state_dict(state_dict, _options(self.options))

    def synchronize_staging(self) -> None:
        """Nothing to wait for: stage() returns once the copy is made."""

    def close(self) -> None:
        """Snapshot memory returns to fastpersist when the staged tensors die."""

    # -- helpers ------------------------------------------------------------
    def _metadata_path(self) -> str:
        name = _torch_api.dcp_filesystem()._metadata_fn
        if not self.use_collectives and self.rank is not None:
            name = f"__{self.rank}{name}"
        return os.path.join(self.path, name)

    def _prefix(self, rank: int) -> str:
        """DCP's own names in a folder without a checkpoint; beside an existing
        one, names of this save alone, so the old checkpoint stays whole."""
        if os.path.exists(self._metadata_path()):
            return f"__{rank}_{uuid.UUID(self.save_id).hex[:8]}_"
        return f"__{rank}_"

    def _release_unreferenced(self, replaced: Optional[set], kept: set) -> None:
        if replaced and "*" in replaced:
            return
        garbage = set(replaced or ()) - kept
        if self.use_collectives:  # then .metadata names every rank's files: others are left by dead saves
            try:
                garbage |= {n for n in os.listdir(self.path) if DATA_FILE_NAME.match(n) and n not in kept}
            except OSError:
                pass
        for name in sorted(garbage):
            if os.sep in name or name.startswith("."):
                continue  # only plain names in this folder
            _release_later(os.path.join(self.path, name))

    def _plan_file(self, plan: SavePlan, planner: SavePlanner) -> list:
        """(write item, bytes or CheckpointPlan) in file order: bytes items
        first, then tensors, as DCP's FileSystemWriter orders them."""
        pieces = []
        for item in plan.items:
            if item.type == WriteItemType.BYTE_IO:
                data = planner.resolve_data(item)
                pieces.append((item, bytes(data.getbuffer())))
        for item in plan.items:
            if item.type == WriteItemType.BYTE_IO:
                continue
            # A tensor on a GPU stays there: planning captures its storage and
            # writing streams it through the engine's buffers, so a rank's
            # device state is never all in host memory at once.
            tensor = planner.resolve_data(item).detach()
            if tensor.untyped_storage().nbytes() != tensor.nbytes:
                tensor = tensor.clone()  # a view: save its own bytes, not the whole storage (as DCP does)
            # what torch.save writes to a file object (DCP's own writer saves into one)
            pieces.append((item, torch_format.CheckpointPlan.for_stream(
                tensor, pickle, _torch_api.DEFAULT_PROTOCOL, False)))
        return pieces


class FastPersistReader(_CheckpointFolder, StorageReader):
    """A DCP ``StorageReader`` that reads ``FileSystemWriter``'s files through fastpersist.

    Each rank reads the byte ranges its load plan needs through the engine
    (O_DIRECT, deep queues) into reused staging memory and copies each
    tensor, or the part of it this rank needs (resharding), into place.
    """

    def __init__(self, path, **options):
        super().__init__()
        self.path = os.fspath(path)
        self.options = dict(options)
        _options(self.options)
        self.storage_data: dict = {}
        self.load_id = str(uuid.uuid4())
        self.rank: Optional[int] = None
        self.use_collectives = True

    def reset(self, checkpoint_id=None) -> None:
        self.storage_data = {}
        if checkpoint_id:
            self.path = os.fspath(checkpoint_id)
        self.load_id = str(uuid.uuid4())

    def read_metadata(self, *args, **kwargs) -> Metadata:
        name = _torch_api.dcp_filesystem()._metadata_fn
        rank = kwargs.get("rank")
        if rank is not None:
            name = f"__{rank}{name}"
        with open(os.path.join(self.path, name), "rb") as f:
            metadata = pickle.load(f)
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata

    def set_up_storage_reader(self, metadata: Metadata, is_coordinator: bool, *args, **kwargs) -> None:
        if metadata.storage_data is None:
            raise ValueError(f"fastpersist.dcp: the metadata in {self.path} names no data files")
        self.storage_data = metadata.storage_data
        self.rank = kwargs.get("rank")
        self.use_collectives = kwargs.get("use_collectives", True)

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        return plan

    def prepare_global_plan(self, plans: list) -> list:
        return plans

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future:
        per_file: dict = {}
        transformed = []
        for item in plan.items:
            info = self.storage_data[item.storage_index]
            if getattr(info, "transform_descriptors", None):
                transformed.append(item)  # compressed or otherwise transformed by a DCP extension
            else:
                per_file.setdefault(info.relative_path, []).append(item)
        opts = _options(self.options)
        staging = _StagingMemory()
        for relative_path, items in per_file.items():
            self._read_file(os.path.join(self.path, relative_path), items, planner, opts, staging)
        if transformed:  # DCP's reader knows its extensions; fastpersist does not
            stock = _torch_api.dcp_filesystem().FileSystemReader(self.path)
            stock.storage_data = self.storage_data
            stock.read_data(dataclasses.replace(plan, items=transformed), planner).wait()
        future: Future = Future()
        future.set_result(None)
        return future

    # -- reading ------------------------------------------------------------
    def _read_file(self, path: str, items: list, planner: LoadPlanner, opts: Options,
                   staging: "_StagingMemory") -> None:
        """Reads the items of one data file. Tensors that land whole in a
        contiguous CPU tensor of the same dtype are read straight into it
        (their archives' small records first, to find the bytes); the rest
        is read into staging memory in batches of at most _READ_BATCH bytes
        (or one larger item) and copied out."""
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        try:
            source = (fd, path, os.fstat(fd).st_size, opts)  # read through the read pipeline, its mode its own
            large = [it for it in items if it.type != LoadItemType.BYTE_IO and self._length(it) >= _DIRECT_MIN]
            small = [it for it in items if not (it.type != LoadItemType.BYTE_IO and self._length(it) >= _DIRECT_MIN)]
            direct, staged = self._plan_direct(path, large, planner, fd)
            if direct:
                self._read_extents(source, [(target.data_ptr(), start, n) for _, target, start, n in direct],
                                   fresh=True)
                for item, target, _, _ in direct:
                    planner.commit_tensor(item, target)
            staged = sorted(staged + small, key=lambda it: self.storage_data[it.storage_index].offset)
            start = 0
            while start < len(staged):
                end, total = start, 0
                while end < len(staged) and (end == start or total + self._length(staged[end]) <= _READ_BATCH):
                    total += self._length(staged[end])
                    end += 1
                self._read_batch(source, staged[start:end], planner, staging.get(total))
                start = end
        finally:
            os.close(fd)

    def _plan_direct(self, path: str, items: list, planner: LoadPlanner, fd: int):
        """Reads the first and last _EDGE bytes of each item's archive (every
        record but the tensor's data lies there), works out where the
        tensor's bytes are, and returns ([(item, target, file offset,
        nbytes)], [items to stage])."""
        if not items:
            return [], []
        direct, staged = [], []
        for item in items:
            info = self.storage_data[item.storage_index]
            # Plain preads through the page cache: given to the engine, ends
            # less than a buffer apart would be read as one span, gap and all.
            head = os.pread(fd, _EDGE, info.offset)
            tail = os.pread(fd, _EDGE, info.offset + info.length - _EDGE)
            if len(head) < _EDGE or len(tail) < _EDGE:
                raise _incomplete(path)
            where = f"{path} (bytes {info.offset}..{info.offset + info.length})"
            placed = _locate_tensor(head, tail, info.length, where)
            if placed is None:
                staged.append(item)
                continue
            meta, data_offset = placed
            part, target = _part_and_target(meta, item, planner, where)
            if not (part.is_contiguous() and target.is_contiguous() and target.device.type == "cpu"
                    and target.dtype == part.dtype and target.layout == torch.strided and not target.is_quantized):
                staged.append(item)
                continue
            nbytes = part.numel() * part.element_size()
            direct.append((item, target, info.offset + data_offset + part.storage_offset() * part.element_size(),
                           nbytes))
        return direct, staged

    @staticmethod
    def _read_extents(source: tuple, extents: list, fresh: bool = False) -> None:
        fd, path, size, opts = source
        try:
            read_pipeline.read_extents(fd, path, size, opts, extents, checksums=False, fresh=fresh)
        except EOFError:
            raise _incomplete(path) from None

    def _length(self, item) -> int:
        return self.storage_data[item.storage_index].length

    def _read_batch(self, source: tuple, items: list, planner: LoadPlanner, memory: "_Memory") -> None:
        path = source[1]
        placed, extents, cursor = [], [], 0
        for item in items:
            info = self.storage_data[item.storage_index]
            placed.append((item, info, cursor))
            extents.append((memory.address + cursor, info.offset, info.length))
            cursor += -(-info.length // 64) * 64
        self._read_extents(source, extents)
        for item, info, at in placed:
            if item.type == LoadItemType.BYTE_IO:
                planner.load_bytes(item, io.BytesIO(bytes(memory.view[at:at + info.length])))
                continue
            where = f"{path} (bytes {info.offset}..{info.offset + info.length})"
            tensor, target = _part_and_target(_tensor_from_archive(memory, at, info.length, where), item, planner,
                                              where)
            target.copy_(tensor)
            planner.commit_tensor(item, target)
            del tensor


def _incomplete(path: str) -> torch_format.CheckpointError:
    return torch_format.CheckpointError(f"{path}: the file ends before the bytes its checkpoint's metadata "
                                        "points to; the checkpoint is incomplete")


def _part_and_target(saved: torch.Tensor, item, planner: LoadPlanner, where: str):
    """The part of a saved tensor (a real or a meta tensor) that a read item
    asks for, and the tensor it goes into, checked to match in size."""
    part = _torch_api.dcp_narrow(saved, item.storage_offsets, item.lengths)
    target = planner.resolve_tensor(item).detach()
    if target.size() != part.size():
        raise torch_format.CheckpointError(f"{where}: {item.storage_index.fqn} holds a {tuple(part.size())} part, "
                                           f"but the load plan expects {tuple(target.size())}")
    return part, target


class _OutsideEdges(Exception):
    """The archive's small records do not all lie in the bytes read so far."""


def _locate_tensor(head, tail, length: int, where: str):
    """(meta tensor, offset of its storage's bytes in the archive) for the
    torch.save archive of `length` bytes whose first and last bytes are head
    and tail; None where that is not enough to tell, or the bytes are not in
    this machine's byte order (the staged path reads those as torch.load does)."""
    import sys

    def read_at(offset: int, n: int) -> bytes:
        if offset + n <= len(head):
            return bytes(head[offset:offset + n])
        tail_start = length - len(tail)
        if offset >= tail_start:
            return bytes(tail[offset - tail_start:offset - tail_start + n])
        raise _OutsideEdges

    try:
        index = torch_format.ArchiveIndex.read(read_at, length, where)
        byteorder = index.lookup("byteorder")
        if byteorder is not None and index.read_record(read_at, byteorder) != sys.byteorder.encode("ascii"):
            return None
        reader = torch_format.TorchArchiveReader(index, read_at, source=where)
        # map_location="meta": shapes and where each storage's bytes start, no data
        meta = _torch_api.unpickle_weights_only(reader, "meta", encoding="utf-8")
    except _OutsideEdges:
        return None
    if not isinstance(meta, torch.Tensor) or meta.layout != torch.strided or meta.is_quantized or not meta.numel():
        return None
    storage = meta.untyped_storage()
    data_offset = _torch_api.checkpoint_offset(storage)
    record = index.by_data_offset().get(data_offset)
    if (record is None or storage.nbytes() != record.size or torch_format.view_end(meta) > record.size
            or meta.storage_offset() < 0):
        raise torch_format.CheckpointError(f"{where}: the tensor's pickle does not match its data record; "
                                           "the file is corrupt")
    return meta, data_offset


def _tensor_from_archive(memory: "_Memory", at: int, length: int, where: str) -> torch.Tensor:
    """The tensor of a torch.save archive held in memory[at:at + length], as
    torch.load(weights_only=True) would return it, its storage that memory."""
    def read_at(offset: int, n: int) -> bytes:
        return bytes(memory.view[at + offset:at + offset + n])

    index = torch_format.ArchiveIndex.read(read_at, length, where)
    index.resolve(read_at)
    storage = torch.frombuffer(memory.buffer, dtype=torch.uint8, count=length, offset=at).untyped_storage()
    reader = torch_format.TorchArchiveReader(index, read_at, storage, where)
    value = _torch_api.unpickle_weights_only(reader, "cpu", encoding="utf-8")
    if not isinstance(value, torch.Tensor):
        raise torch_format.CheckpointError(f"{where}: holds a {type(value).__name__}, not a tensor")
    return value


class _Memory:
    """Page-aligned anonymous memory the engine reads into."""

    def __init__(self, size: int):
        from ._engine import _load as load_engine

        _, ffi = load_engine()
        self.size = size
        self.buffer = _mmap.mmap(-1, size)
        if hasattr(_mmap, "MADV_NOHUGEPAGE"):
            self.buffer.madvise(_mmap.MADV_NOHUGEPAGE)  # see load.py: huge pages made first touch slower here
        self.view = memoryview(self.buffer)
        self.address = int(ffi.cast("uintptr_t", ffi.from_buffer(self.buffer)))


class _StagingMemory:
    """One reused _Memory, grown as batches need (touched once, not per batch)."""

    def __init__(self):
        self.memory: Optional[_Memory] = None

    def get(self, nbytes: int) -> _Memory:
        need = max(-(-(nbytes + 64 * 1024) // (2 << 20)) * (2 << 20), 2 << 20)
        if self.memory is None or self.memory.size < need:
            self.memory = _Memory(need)
        return self.memory


# ---------------------------------------------------------------------------
# staging for dcp.async_save: a copy of the state dict in snapshot memory


def stage_state_dict(state_dict, opts: Options):
    """A copy of state_dict whose tensors (and DTensors' local tensors) live
    in one arena of fastpersist's snapshot memory; the arena returns to the
    pool when the last staged tensor dies."""
    import ctypes

    from . import async_save

    tensors: list = []
    _walk(state_dict, tensors.append)
    need = sum(-(-t.nbytes // async_save._ALIGN) * async_save._ALIGN for t in tensors)
    if not need:
        return _rebuild(state_dict, iter(()))
    arena = async_save.snapshot_memory().take(need, async_save._memory_limit(opts))
    try:
        # The staged tensors keep this ctypes view alive; when the last one
        # dies, so does the view, and the finalizer returns the arena.
        owner = (ctypes.c_ubyte * arena.size).from_buffer(arena.memory)
        weakref.finalize(owner, async_save.snapshot_memory().give_back, arena)
    except BaseException:
        async_save.snapshot_memory().give_back(arena)
        raise
    # One storage per tensor, not views of one: dcp.async_save's process
    # executor pickles each storage into shared memory (one storage would be
    # copied whole for every tensor), and torch 2.13 crashes pickling two
    # DTensors whose local tensors view one storage.
    copies, offset = [], 0
    with torch.no_grad():
        for device in {t.device for t in tensors if t.device.type == "cuda"}:
            arena.register_for(device)  # page-locked once: each copy from a GPU goes by DMA
        for t in tensors:
            n = t.nbytes
            if n:
                copy = torch.frombuffer(owner, dtype=torch.uint8, count=n, offset=offset).view(t.dtype).view(t.shape)
            else:
                copy = torch.empty(t.shape, dtype=t.dtype)
            copy.copy_(t)
            copies.append(copy)
            offset += -(-n // async_save._ALIGN) * async_save._ALIGN
    del owner
    return _rebuild(state_dict, iter(copies))


def _dtensor_type():
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # pragma: no cover - torch without distributed tensors
        return None
    return DTensor


def _walk(obj, visit) -> None:
    dtensor = _dtensor_type()
    if dtensor is not None and isinstance(obj, dtensor):
        visit(obj._local_tensor)
    elif isinstance(obj, torch.Tensor):
        visit(obj)
    elif isinstance(obj, dict):
        for value in obj.values():
            _walk(value, visit)
    elif isinstance(obj, (list, tuple)):
        for value in obj:
            _walk(value, visit)


def _rebuild(obj, copies):
    dtensor = _dtensor_type()
    if dtensor is not None and isinstance(obj, dtensor):
        return dtensor.from_local(next(copies), obj.device_mesh, obj.placements, run_check=False,
                                  shape=obj.shape, stride=obj.stride())
    if isinstance(obj, torch.Tensor):
        return next(copies)
    if isinstance(obj, dict):
        return {key: _rebuild(value, copies) for key, value in obj.items()}
    if isinstance(obj, list):
        return [_rebuild(value, copies) for value in obj]
    if isinstance(obj, tuple):
        return tuple(_rebuild(value, copies) for value in obj)
    return obj


# ---------------------------------------------------------------------------
# files


def _release_later(path: str) -> None:
    from .release import release_later

    release_later(path)


def _wait_for_release_of(path: str) -> None:
    """A file this process is still removing must be gone before a save reuses its name."""
    from . import release

    if os.path.abspath(path) in release.pending():
        release.wait_for_releases()


def _remove_quietly(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


__all__ = ["FastPersistReader", "FastPersistWriter", "stage_state_dict"]
