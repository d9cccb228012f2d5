"""Data-parallel partitioned save: N ranks that hold the same state write one
standard checkpoint file together, each a disjoint, balanced, block-aligned
byte range of it, with offset-based writes.

The call sequence, on every rank of the group (collectives are
torch.distributed's ``all_gather_object``, so any backend works):

1. plan: each rank pickles the object and plans the archive
   (``CheckpointPlan``) with rank 0's serialization id; the ranks compare a
   digest of their plans and refuse if they differ (the state is not the same
   on every rank).
2. create: rank 0 creates the locked temporary beside the destination,
   allocates its full size, and every rank opens it (the same inode, checked).
3. write: each rank writes the file bytes of its range (headers, pickle,
   tensor data) through the engine, with zeros where data descriptors and the
   central directory go, computes the CRC-32 of each record piece it wrote,
   and makes its range durable (fsync).
4. finish: the ranks exchange their pieces' CRCs and combine them into every
   record's CRC (``fp_crc32_combine``); rank 0 writes the descriptors and the
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
from typing import Optional

from . import _engine, release, torch_format
from .options import Options

PARTITION_ALIGN = 4096  # rank boundaries fall on whole blocks, so O_DIRECT writes stay whole


class PartitionedSaveError(RuntimeError):
    """A partitioned save failed on one or more ranks (the same error on every rank)."""


def partition(size: int, world: int, align: int = PARTITION_ALIGN) -> list[tuple[int, int]]:
    """[lo, hi) byte ranges of a file of `size` bytes for `world` ranks:
    contiguous, disjoint, covering it, boundaries on `align`, as even as that allows."""
    bounds = [0] + [min(size, (size * i // world) // align * align) for i in range(1, world)] + [size]
    return list(zip(bounds, bounds[1:]))


def _plan_digest(plan: torch_format.CheckpointPlan, target: str, sequence: int) -> str:
    """What must be the same on every rank: the file, which of the group's
    saves this is, the CRC setting, names, sizes, offsets and the byte records
    (the pickle). Tensor values are not compared: replicated state is the
    caller's promise."""
    digest = hashlib.sha256(f"{target}\0{sequence}\0{plan.compute_crc32}\0".encode())
    for r in plan.records:
        digest.update(f"{r.layout.name}:{r.layout.header_offset}:{r.source.nbytes};".encode())
        if r.source.data is not None and r.source.name != ".data/serialization_id":
            digest.update(r.source.data)
    digest.update(str(plan.size).encode())
    return digest.hexdigest()


class _Group:
    """The exchanges the protocol needs, over a torch.distributed group."""

    def __init__(self, group):
        import torch.distributed as dist

        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError("fastpersist.save(group=...) needs an initialized torch.distributed process group")
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
            plan = torch_format.CheckpointPlan.for_path(obj, path, pickle_module, pickle_protocol,
                                                        disable_byteorder_record)
        except BaseException as exc:  # noqa: BLE001 - every rank must reach the exchange
            error = exc
    return write_partitioned(plan, path, group, opts, error, sequence=sequence)


_sequences: dict = {}


def next_sequence(group) -> int:
    """How many group saves this process has started with `group`: ranks whose
    sequences of saves differ are refused, never paired save for save wrongly."""
    _sequences[group] = _sequences.get(group, 0) + 1
    return _sequences[group]


def checkpoint_group(group):
    """A gloo group of the same ranks as `group`, for checkpoint exchanges
    from a background thread while training uses `group` itself (two threads
    must not run collectives on one group). Made once per group; every rank of
    the group must ask for it at the same point of its program."""
    import torch.distributed as dist

    if group not in _checkpoint_groups:
        ranks = dist.get_process_group_ranks(group)
        _checkpoint_groups[group] = dist.new_group(ranks=ranks, backend="gloo", use_local_synchronization=True)
    return _checkpoint_groups[group]


_checkpoint_groups: dict = {}


def write_partitioned(plan: Optional[torch_format.CheckpointPlan], path: str, group, opts: Options,
                      planning_error: Optional[BaseException] = None, target: Optional[str] = None,
                      sequence: int = 0) -> int:
    """Steps 1 to 4 above for a plan made on this rank (None with the error
    that stopped its planning); returns the checkpoint's size."""
    from .save import _fsync_folder, _keep_mode_of, _Temporary, remove_stale_temporaries
    from .writer import FastFileWriter

    g = _Group(group)
    target = target or os.path.realpath(path)
    folder = os.path.dirname(target)

    # 1. the same plan on every rank, with rank 0's serialization id
    mine = (_plan_digest(plan, target, sequence), torch_format.new_serialization_id()) if plan is not None else None
    agreed = g.agree("pickled the object", path, planning_error, mine)
    differing = [rank for rank, (digest, _) in enumerate(agreed) if digest != agreed[0][0]]
    if differing:
        raise ValueError(f"fastpersist: the partitioned save of {path} needs every rank to save the same state "
                         f"to the same file in the same order, but rank(s) {differing} planned a different "
                         "checkpoint, file or save than rank 0; nothing was written")
    plan.set_serialization_id(agreed[0][1])

    # 2. create
    temporary, writer, identity = None, None, None
    lo, hi = partition(plan.size, g.world)[g.rank]
    try:
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

        # 3. write
        pieces, error = [], None
        try:
            pieces = _write_range(plan, writer, lo, hi)
            writer.close()  # waits for every write; fsyncs with opts.fsync
        except BaseException as exc:  # noqa: BLE001
            error = exc
        all_pieces = g.agree(f"wrote bytes {lo}..{hi}", path, error, pieces)

        # 4. finish
        error = None
        try:
            _set_crcs(plan, [p for rank_pieces in all_pieces for p in rank_pieces])
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


def _write_range(plan: torch_format.CheckpointPlan, writer, lo: int, hi: int) -> list:
    """Writes the file's bytes in [lo, hi) in order, zeros where the CRCs go;
    returns (record index, offset in record, length, crc) of each storage piece written."""
    pieces = []
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
            address = record.source.storage.data_ptr() + (start - offset)
            crc = writer.write_address(address, n, 0 if plan.compute_crc32 else None)
            pieces.append((i, start - offset, n, crc or 0))
        else:
            writer.write_zeros(n)  # skip_data: space reserved
    return pieces


def _set_crcs(plan: torch_format.CheckpointPlan, pieces: list) -> None:
    """Combines the pieces' CRCs, in file order, into each storage record's CRC."""
    by_record: dict[int, list] = {}
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
        plan.set_crc(plan.records[i], crc)


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
