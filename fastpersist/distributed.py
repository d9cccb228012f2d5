"""Data-parallel partitioned save: N ranks that hold the same state write one
standard checkpoint file together, each a disjoint, balanced, block-aligned
byte range of it, with offset-based writes.

The call sequence, on every rank of the group (collectives are
torch.distributed's ``all_gather_object``, so any backend works):

1. plan: each rank pickles the object and plans the archive
   (``CheckpointPlan``) with rank 0's serialization id; the ranks compare a
   digest of their plans and refuse if they differ (the state is not the same
   on every rank). With ``compare_replicas`` (on unless every rank turns it
   off) each rank then starts a helper thread computing the CRC-32 of the
   tensor bytes it holds outside its own range, during steps 2 and 3.
2. create: rank 0 creates the locked temporary beside the destination,
   allocates its full size, and every rank opens it (the same inode, checked).
3. write: each rank writes the file bytes of its range (headers, pickle,
   tensor data) through the engine, with zeros where data descriptors and the
   central directory go, computes the CRC-32 of each record piece it wrote,
   and makes its range durable (fsync).
4. compare: the ranks exchange their pieces' CRCs and, when comparing, the
   CRC-32 of every storage record as each rank holds it (its own pieces'
   combined with the helper's). A record whose CRC differs between ranks, or
   whose written pieces do not combine into rank 0's CRC, makes every rank
   raise ``ReplicaMismatchError`` naming it (the file would mix the ranks'
   values); every rank decides from the same exchanged lists, so none waits.
5. finish: the pieces' CRCs combine into every record's CRC
   (``fp_crc32_combine``); rank 0 writes the descriptors and the
   central directory, fsyncs, renames the temporary over the destination and
   fsyncs the folder; the replaced file is freed in the background
   (fastpersist.release).

After each step the ranks exchange their outcome: a failure on any rank fails
the save on every rank with the same error, rank 0 removes the temporary,
and the previous checkpoint stays as it was. The file is byte for byte the
one a single-process ``fastpersist.save`` writes with the same serialization
id. Every rank must see the destination folder (one machine, or a shared
filesystem): the ranks write into one file.
"""
from __future__ import annotations

import hashlib
import os
import pickle
import threading
import weakref
from typing import Optional

from . import _engine, device_io, release, torch_format
from .options import Options
from .atomic_write import _fsync_folder, _keep_mode_of, _Temporary, remove_stale_temporaries
from .writer import FastFileWriter

PARTITION_ALIGN = 4096  # rank boundaries fall on whole blocks, so O_DIRECT writes stay whole


class PartitionedSaveError(RuntimeError):
    """A partitioned save failed on one or more ranks (the same error on every rank)."""


class ReplicaMismatchError(PartitionedSaveError, ValueError):
    """The ranks of a partitioned save hold different tensor values (the same
    error on every rank; nothing replaced the destination)."""


def partition(size: int, world: int, align: int = PARTITION_ALIGN) -> list[tuple[int, int]]:
    """[lo, hi) byte ranges of a file of `size` bytes for `world` ranks:
    contiguous, disjoint, covering it, boundaries on `align`, as even as that allows."""
    bounds = [0] + [min(size, (size * i // world) // align * align) for i in range(1, world)] + [size]
    return list(zip(bounds, bounds[1:]))


def _plan_digest(plan: torch_format.CheckpointPlan, target: str, sequence: int) -> str:
    """What must be the same on every rank: the file, which of the group's
    saves this is, the CRC setting, names, sizes, offsets and the byte records
    (the pickle). Tensor values are compared by CRC-32 after the write
    (compare_replicas), where checksumming them overlaps with writing."""
    digest = hashlib.sha256(f"{target}\0{sequence}\0{plan.compute_crc32}\0".encode())
    for r in plan.records:
        digest.update(f"{r.layout.name}:{r.layout.header_offset}:{r.source.nbytes};".encode())
        if r.source.data is not None and r.source.name != ".data/serialization_id":
            digest.update(r.source.data)
    digest.update(str(plan.size).encode())
    return digest.hexdigest()


def _initialized_distributed():
    """torch.distributed, where a process group is initialized."""
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError("fastpersist.save(group=...) needs an initialized torch.distributed process group")
    return dist


class _Group:
    """The exchanges the protocol needs, over a torch.distributed group."""

    def __init__(self, group):
        dist = _initialized_distributed()
        self.dist, self.group = dist, group
        self.rank = dist.get_rank(group)
        self.world = dist.get_world_size(group)

    def gather(self, value) -> list:
        out = [None] * self.world
        self.dist.all_gather_object(out, value, group=self.group)
        return out

    def agree(self, step: str, path: str, error: Optional[BaseException], value=None,
              replaced: bool = False) -> list:
        """Exchanges each rank's outcome of a step; raises on every rank if any
        failed (a KeyboardInterrupt or SystemExit stays itself on its rank, after
        the exchange, so that no other rank waits for it forever). replaced:
        this rank has already renamed the new file over the destination."""
        message = None if error is None else f"{type(error).__name__}: {error}"
        outcomes = self.gather((message, value, replaced))
        failed = [(rank, m) for rank, (m, _, _) in enumerate(outcomes) if m]
        if failed:
            if error is not None and not isinstance(error, Exception):
                raise error
            detail = "; ".join(f"rank {rank}: {m}" for rank, m in failed)
            consequence = ("the new checkpoint has replaced the previous one, but that may not be durable"
                           if any(r for _, _, r in outcomes) else "the previous checkpoint is untouched")
            raise PartitionedSaveError(f"fastpersist: the partitioned save of {path} failed while it {step} "
                                       f"({detail}); {consequence}") from error
        return [v for _, v, _ in outcomes]


def save_partitioned(obj, path: str, group, opts: Options, pickle_module=pickle, pickle_protocol: int = 2,
                     disable_byteorder_record: bool = False, refusal: Optional[BaseException] = None) -> int:
    """Plans obj's checkpoint on this rank and writes it with the others
    (write_partitioned); returns the checkpoint's size. refusal: why this
    rank cannot save (it still takes part in the exchange, so every rank fails)."""
    sequence = next_sequence(group)
    plan, error = None, refusal
    if refusal is None:
        try:
            # device storages stay where they are: each rank streams its slice of them through the
            # engine's buffers and checksums the rest on the device (no host copy of the state)
            plan = torch_format.CheckpointPlan.for_path(obj, path, pickle_module, pickle_protocol,
                                                        disable_byteorder_record)
        except BaseException as exc:  # noqa: BLE001 - every rank must reach the exchange
            error = exc
    return write_partitioned(plan, path, group, opts, error, sequence=sequence)


# Both tables hold their groups weakly. A process group that outlives
# destroy_process_group() keeps its gloo worker threads running into
# interpreter exit, where one that drops the last reference to a finished
# collective's tensors needs the GIL, is ended by the finalizing interpreter
# and aborts the process ("terminate called without an active exception").
_sequences: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def next_sequence(group) -> int:
    """How many group saves this process has started with `group`: ranks whose
    sequences of saves differ are refused, never paired save for save wrongly."""
    _initialized_distributed()
    _sequences[group] = _sequences.get(group, 0) + 1
    return _sequences[group]


def checkpoint_group(group):
    """A gloo group of the same ranks as `group`, for checkpoint exchanges
    from a background thread while training uses `group` itself (two threads
    must not run collectives on one group). Made once per group; every rank of
    the group must ask for it at the same point of its program."""
    dist = _initialized_distributed()
    made = _checkpoint_groups.get(group)
    io_group = made() if made is not None else None
    if io_group is None:
        ranks = dist.get_process_group_ranks(group)
        io_group = dist.new_group(ranks=ranks, backend="gloo", use_local_synchronization=True)
        _checkpoint_groups[group] = weakref.ref(io_group)  # torch.distributed holds it until destroyed
    return io_group


_checkpoint_groups: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def write_partitioned(plan: Optional[torch_format.CheckpointPlan], path: str, group, opts: Options,
                      planning_error: Optional[BaseException] = None, target: Optional[str] = None,
                      sequence: int = 0) -> int:
    """Steps 1 to 5 above for a plan made on this rank (None with the error
    that stopped its planning); returns the checkpoint's size."""
    g = _Group(group)
    target = target or os.path.realpath(path)
    folder = os.path.dirname(target)

    # 1. the same plan on every rank, with rank 0's serialization id
    mine = ((_plan_digest(plan, target, sequence), torch_format.new_serialization_id(), opts.compare_replicas)
            if plan is not None else None)
    agreed = g.agree("pickled the object", path, planning_error, mine)
    differing = [rank for rank, (digest, _, _) in enumerate(agreed) if digest != agreed[0][0]]
    if differing:
        raise ValueError(f"fastpersist: the partitioned save of {path} needs every rank to save the same state "
                         f"to the same file in the same order, but rank(s) {differing} planned a different "
                         "checkpoint, file or save than rank 0; nothing was written")
    plan.set_serialization_id(agreed[0][1])
    compare = any(asked for _, _, asked in agreed)  # one rank asking is enough: all of them checksum

    # 2. create
    temporary, writer, identity, others = None, None, None, None
    lo, hi = partition(plan.size, g.world)[g.rank]
    try:
        if compare:  # overlaps with the steps below; the engine's CRC runs without the GIL
            others = _OutsideChecksums(plan, lo, hi)
        error = None
        try:
            if g.rank == 0:
                remove_stale_temporaries(folder)
                temporary = _Temporary.create(folder, os.path.basename(target), opts, sole_writer=False)
                writer = temporary.writer
                os.posix_fallocate(writer.fd, 0, plan.size)  # the final size: every write lands inside the file
                identity = (temporary.path, os.fstat(writer.fd).st_ino)
        except BaseException as exc:  # noqa: BLE001 - every rank must reach the exchange
            error = exc
        identity = g.agree("created its temporary file", path, error, identity)[0]
        error = None
        try:
            if g.rank != 0:
                writer = FastFileWriter(identity[0], lo, create=False, options=opts)
                if os.fstat(writer.fd).st_ino != identity[1]:
                    raise OSError(f"{identity[0]} is not the file rank 0 created (do all ranks share the folder?)")
        except BaseException as exc:  # noqa: BLE001
            error = exc
        g.agree("opened the temporary file", path, error)

        # 3. write (the pieces' CRCs are computed for the comparison even where the file stores none)
        pieces, held, error = [], None, None
        try:
            pieces = _write_range(plan, writer, lo, hi, checksum=plan.compute_crc32 or compare)
            writer.close()  # waits for every write; fsyncs with opts.fsync
            if others is not None:
                held = _storage_crcs(plan, pieces + others.result())
        except BaseException as exc:  # noqa: BLE001
            error = exc
        exchanged = g.agree(f"wrote bytes {lo}..{hi}", path, error, (pieces, held))

        # 4. compare: every rank has the same lists, so every rank raises or none does
        written = _combine(plan, [p for rank_pieces, _ in exchanged for p in rank_pieces])
        if compare:
            _check_replicas(plan, path, [h for _, h in exchanged], written)

        # 5. finish
        error = None
        try:
            for i, crc in written.items():
                plan.set_crc(plan.records[i], crc)
            if g.rank == 0:
                _write_trailer(plan, temporary.path, opts)
                _keep_mode_of(target, temporary.path)
                with release.replacing(temporary.path, target):  # the old file is freed in the background, after
                    temporary.renamed()
                    if opts.fsync:
                        _fsync_folder(folder)
        except BaseException as exc:  # noqa: BLE001
            error = exc
        g.agree("finished the file", path, error, replaced=temporary is not None and temporary.in_place)
    except BaseException:
        if writer is not None:
            writer.abort()
        if temporary is not None:
            temporary.discard()
        raise
    finally:
        if others is not None:
            others.join()  # it reads the state's memory, which an async save hands back when this returns
        if temporary is not None:
            temporary.unlock()
    return plan.size


def _segments(plan: torch_format.CheckpointPlan):
    """The file as (offset, length, kind, record index) in order; kind: header,
    data, descriptor or directory (the last two are written after the CRCs are known)."""
    for i, r in enumerate(plan.records):
        lay = r.layout
        yield lay.header_offset, len(r.header), "header", i
        yield lay.data_offset, lay.size, "data", i
        yield lay.data_offset + lay.size, lay.descriptor_size, "descriptor", i
    yield plan.central_directory_offset, plan.size - plan.central_directory_offset, "directory", -1


def _write_range(plan: torch_format.CheckpointPlan, writer, lo: int, hi: int, checksum: bool = True) -> list:
    """Writes the file's bytes in [lo, hi) in order, zeros where the CRCs go;
    returns (record index, offset in record, length, crc) of each storage piece
    written (crc 0 without checksum)."""
    pieces = []
    copiers: dict = {}  # device_io.stream_bytes', one side stream per device for the file
    for offset, length, kind, i in _segments(plan):
        start, end = max(offset, lo), min(offset + length, hi)
        if start >= end:
            continue
        n = end - start
        if kind in ("descriptor", "directory"):
            writer.write_zeros(n)
            continue
        record = plan.records[i]
        if kind == "header":
            writer.write(record.header[start - offset:end - offset])
        elif record.source.data is not None:
            writer.write(record.source.data[start - offset:end - offset])
        elif record.source.storage is not None:
            storage = record.source.storage
            if _on_host(storage):
                crc = writer.write_address(storage.data_ptr() + (start - offset), n, 0 if checksum else None)
            else:  # through the engine's buffers, or GPUDirect Storage for its aligned middle
                source = device_io.byte_view(storage)[start - offset:end - offset]
                crc = device_io.write_storage(source, writer, 0 if checksum else None, copiers)
            pieces.append((i, start - offset, n, crc or 0))
        else:
            writer.write_zeros(n)  # skip_data: space reserved
    return pieces


def _on_host(storage) -> bool:
    """Whether a storage's bytes are read by address (host memory), not
    copied from its device (tests force CPU storages the device's way)."""
    return storage.device.type == "cpu" and not torch_format.STREAM_CPU_STORAGES


def _combine(plan: torch_format.CheckpointPlan, pieces: list) -> dict:
    """Combines (record index, offset, length, crc) pieces, in record order,
    into {record index: the record's CRC}; the pieces must cover each record."""
    by_record: dict[int, list] = {}
    crcs = {}
    for i, at, n, crc in pieces:
        by_record.setdefault(i, []).append((at, n, crc))
    for i, parts in by_record.items():
        parts.sort()
        crc, expected = 0, 0
        for at, n, piece_crc in parts:
            if at != expected:
                raise RuntimeError(f"record {plan.records[i].layout.name}: pieces do not cover it (gap at {expected})")
            crc = _engine.crc32_combine(crc, piece_crc, n)
            expected = at + n
        if expected != plan.records[i].source.nbytes:
            raise RuntimeError(f"record {plan.records[i].layout.name}: pieces cover {expected} of "
                               f"{plan.records[i].source.nbytes} bytes")
        crcs[i] = crc
    return crcs


# -- comparing the ranks' values (compare_replicas) --------------------------

def _storages(plan: torch_format.CheckpointPlan) -> list:
    """Indices of the records whose bytes come from a tensor's memory."""
    return [i for i, r in enumerate(plan.records)
            if r.source.data is None and r.source.storage is not None and r.source.nbytes]


class _OutsideChecksums:
    """A helper thread computing the CRC-32 of the storage bytes this rank
    holds outside its own range [lo, hi) (its own are checksummed as they are
    written), as (record index, offset, length, crc) pieces. fp_crc32 runs
    without the GIL, so it overlaps with the rank's own work."""

    def __init__(self, plan: torch_format.CheckpointPlan, lo: int, hi: int):
        self._pieces: list = []
        self._error: Optional[BaseException] = None
        # a device storage's CRC runs on the device, after the kernels the caller queued on its current stream
        streams = {}
        for i in _storages(plan):
            device = plan.records[i].source.storage.device
            if device.type == "cuda" and device not in streams:
                import torch

                streams[device] = torch.cuda.current_stream(device)
        self._thread = threading.Thread(target=self._run, args=(plan, lo, hi, streams), daemon=True,
                                        name="fastpersist-compare-replicas")
        self._thread.start()

    def _run(self, plan, lo: int, hi: int, streams: dict) -> None:
        try:
            lib, ffi = _engine._load()
            for i in _storages(plan):
                r = plan.records[i]
                start, end = r.layout.data_offset, r.layout.data_offset + r.layout.size
                storage = r.source.storage
                for a, b in ((start, min(end, lo)), (max(start, hi), end)):  # before and after the range
                    if a >= b:
                        continue
                    if _on_host(storage):
                        crc = int(lib.fp_crc32(0, ffi.cast("const void *", storage.data_ptr() + a - start), b - a))
                    else:
                        crc = _device_crc(device_io.byte_view(storage)[a - start:b - start], streams)
                    self._pieces.append((i, a - start, b - a, crc))
        except BaseException as exc:  # noqa: BLE001 - raised by result(), on the rank's own thread
            self._error = exc

    def join(self) -> None:
        self._thread.join()

    def result(self) -> list:
        self.join()
        if self._error is not None:
            raise self._error
        return self._pieces


def _device_crc(source, streams: dict) -> int:
    """CRC-32 of bytes on a device, computed there (device_crc), on the
    caller's current stream of that device."""
    from . import device_crc

    stream = streams.get(source.device)
    if stream is None:
        return device_crc.crc32(source)
    import torch

    with torch.cuda.stream(stream):
        return device_crc.crc32(source)


def _storage_crcs(plan: torch_format.CheckpointPlan, pieces: list) -> list:
    """The CRC-32 of every storage record, in record order, from pieces covering them."""
    crcs = _combine(plan, pieces)
    return [crcs[i] for i in _storages(plan)]


_LISTED = 4  # differing records named in the error; the rest are counted


def _check_replicas(plan: torch_format.CheckpointPlan, path: str, held: list, written: dict) -> None:
    """Raises ReplicaMismatchError where the ranks' CRCs of a storage record
    differ (held: each rank's list, in _storages order), or where the bytes
    the ranks wrote do not combine into rank 0's CRC (written: {index: crc})."""
    indices = _storages(plan)
    problems = []
    for k, i in enumerate(indices):
        ranks = [rank for rank, crcs in enumerate(held) if crcs[k] != held[0][k]]
        if ranks:
            problems.append((i, f"rank(s) {ranks} hold other values than rank 0"))
        elif written.get(i, 0) != held[0][k]:
            problems.append((i, "the bytes written are not the values the ranks hold (did they change "
                                "during the save?)"))
    if not problems:
        return
    names = _tensor_names(plan)

    def describe(i):  # "data/0 (model.w, 4000 bytes)"
        source = plan.records[i].source
        tensors = names.get(source.name.rsplit("/", 1)[-1], [])
        shown = ", ".join(tensors[:3] + (["..."] if len(tensors) > 3 else []) + [f"{source.nbytes} bytes"])
        return f"{source.name} ({shown})"

    listed = "; ".join(f"{describe(i)}: {why}" for i, why in problems[:_LISTED])
    more = f"; and {len(problems) - _LISTED} more record(s)" if len(problems) > _LISTED else ""
    raise ReplicaMismatchError(
        f"fastpersist: the partitioned save of {path} was refused: the ranks do not hold the same tensor values "
        f"(CRC-32 of each storage record, {len(problems)} of {len(indices)} differ): {listed}{more}. The file "
        "would mix the ranks' bytes; nothing replaced the destination and the previous checkpoint is untouched "
        "(compare_replicas=False, or FASTPERSIST_COMPARE_REPLICAS=0, turns this comparison off)")


class _Opaque:
    """Whatever a pickle builds, with its arguments and state kept and none of its code run."""

    def __new__(cls, *args, **kwargs):
        self = object.__new__(cls)
        self.parts = [args, kwargs]
        return self

    def __init__(self, *args, **kwargs):
        pass

    def __setstate__(self, state):
        self.parts.append(state)

    def __setitem__(self, key, value):
        self.parts.append({key: value})

    def append(self, value):
        self.parts.append(value)

    def extend(self, values):
        self.parts.extend(values)


class _StorageKey(str):
    pass


class _NamesUnpickler(pickle.Unpickler):
    def find_class(self, module, name):
        return _Opaque  # never imports, never calls anything of the pickle's

    def persistent_load(self, pid):
        return _StorageKey(pid[2]) if isinstance(pid, tuple) and len(pid) > 2 else None


def _tensor_names(plan: torch_format.CheckpointPlan) -> dict:
    """{storage key: where the pickle puts tensors on it ("model.w", "opt[1]")},
    for the error only; {} where the pickle is not one this can read."""
    import io

    names: dict = {}
    budget = [100_000]

    def walk(node, where, depth):
        budget[0] -= 1
        if budget[0] < 0 or depth > 64:
            return
        if isinstance(node, _StorageKey):
            names.setdefault(str(node), []).append(where or "the saved object")
        elif isinstance(node, dict):
            for key, value in node.items():
                walk(value, f"{where}.{key}" if where else str(key), depth + 1)
        elif isinstance(node, (list, tuple)):
            for n, value in enumerate(node):
                walk(value, f"{where}[{n}]", depth + 1)
        elif isinstance(node, _Opaque):  # a tensor, a module, an OrderedDict
            args, kwargs, *later = node.parts
            for value in (*args, *kwargs.values()):  # constructor arguments add nothing to the name
                walk(value, where, depth + 1)
            for part in later:  # items and attributes (dicts) name themselves; a state tuple does not
                for value in (part if isinstance(part, tuple) else (part,)):
                    walk(value, where, depth + 1)

    try:
        pickled = next(r.source.data for r in plan.records if r.source.name == "data.pkl")
        walk(_NamesUnpickler(io.BytesIO(pickled)).load(), "", 0)
    except Exception:  # noqa: BLE001 - a custom pickle_module's format: the record names must do
        pass
    return names


def _pwrite_all(fd: int, data: bytes, offset: int) -> None:
    view = memoryview(data)
    while view:
        n = os.pwrite(fd, view, offset)
        if n <= 0:
            raise OSError(f"pwrite made no progress at offset {offset}")
        view, offset = view[n:], offset + n


def _write_trailer(plan: torch_format.CheckpointPlan, path: str, opts: Options) -> None:
    """Rank 0: the data descriptors and the central directory, now that every CRC is known."""
    fd = os.open(path, os.O_WRONLY | os.O_CLOEXEC | os.O_NOFOLLOW)
    try:
        for r in plan.records:
            descriptor = plan.descriptor(r)
            if descriptor:
                _pwrite_all(fd, descriptor, r.layout.data_offset + r.layout.size)
        _pwrite_all(fd, plan.central_directory(), plan.central_directory_offset)
        if opts.fsync:
            os.fsync(fd)
    finally:
        os.close(fd)
