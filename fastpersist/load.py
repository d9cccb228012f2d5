"""fastpersist.load and fastpersist.load_into: torch.load's format and
behaviour, read through the engine.

``load`` reads the whole checkpoint through the engine's buffers (a small
one with no engine idle, through the page cache) into one page-aligned
mapping (reused from freed results, or fresh with helper threads faulting
its pages in ahead of the copies); every tensor is a slice of that mapping,
the way ``torch.load(mmap=True)`` slices a file mapping: no copy after the
read. A plain state dict of CPU tensors is unpickled while the file is
still being read (``_torch_api.unpickle_plain_state``); anything else waits
for the read and goes through torch's own unpickling
(``torch.serialization._load``), with torch's handling of ``map_location``,
``weights_only``, byte order and storage sharing.

``load_into`` writes a checkpoint's tensors straight into the memory of
tensors that already exist (a model being restarted): the tensors' places in
the file come from unpickling with ``map_location="meta"``, which reads no
tensor data; then one pass over the file copies every tensor out of the
engine's buffers into its destination.
"""
from __future__ import annotations

import contextlib
import ctypes
import io
import mmap as _mmap
import os
import pickle
import stat
import sys
import threading
import warnings
from collections.abc import Mapping
from typing import Any, NamedTuple, Optional

from . import _engine, _torch_api, device_io, gc_pause, load_memory, read_pipeline
from .fileio import reading_engine, same_file
from .helper_threads import HelperThreads, StopSignal
from .options import Options, current_options
from ._torch_api import StoredStorage, StoredTensor
from .torch_format import ArchiveIndex, CheckpointError, TorchArchiveReader, fixed_size

_TRUE = ("1", "y", "yes", "true")


# ---------------------------------------------------------------------------
# fastpersist.load

# Below this, a load with no engine idle reads without one (see read_pipeline); one idle is used at any size.
# (The name safetensors imports; read_pipeline.SMALL_FILE_BYTES is the one every load reads.)
SMALL_LOAD_BYTES = read_pipeline.SMALL_FILE_BYTES


def load(f, map_location=None, pickle_module=None, *, weights_only: Optional[bool] = None,
         mmap: Optional[bool] = None, verify: bool = False, **pickle_load_args) -> Any:
    """Loads a checkpoint like ``torch.load(f, ...)`` and returns the same objects.

    Paths to zip checkpoints (what torch.save has written since 1.6) are read
    through fastpersist's engine, and so is a file opened read-only at its
    start (``open(path, "rb")``, fsspec's local files), by its path. Other
    file objects (``BytesIO``, compressed streams, files opened for writing),
    ``mmap=True``, legacy and TorchScript files, meta/fake loads and
    ``.safetensors`` go to the original ``torch.load``. Differences: the tensors of one checkpoint share one
    allocation, freed when the last of them is (as with ``mmap=True``). It
    holds the whole file; a file of which more than half, and more than 64
    MiB, lies outside every record (a hole) is read record by record
    instead, each storage in an allocation of its own, as ``torch.load``
    reads: what any one tensor keeps alive is at most the file, and the bytes
    in no record at most max(64 MiB, the bytes in records). Records that no
    tensor references count as records here (``mmap=True`` keeps them too).

    ``verify=True`` checks every record against the CRC-32 in the archive
    first and raises :class:`fastpersist.CheckpointError` on a mismatch (and
    for files saved without checksums, which cannot be verified).

    Args:
        f: a ``str`` or ``os.PathLike`` path, or a file object (a plain file
            opened read-only at its start is read by its path; others are
            handed to the original ``torch.load``).
        map_location: as ``torch.load``'s: a device, a string, a dict or a
            callable. CUDA devices are read into directly, buffer by buffer.
        pickle_module: as ``torch.load``'s.
        weights_only: as ``torch.load``'s (its default, its environment
            variables, its allowlist and its refusals).
        mmap: as ``torch.load``'s; ``True`` goes to the original ``torch.load``.
        verify: check every record's CRC-32 before unpickling.
        **pickle_load_args: as ``torch.load``'s.

    Returns:
        What ``torch.load`` returns for the same file and arguments.

    Raises:
        fastpersist.CheckpointError: the file is truncated, empty or corrupt
            (names the file and the record), its pickle fails its CRC-32, or
            ``verify`` found a mismatch.
        OSError: reading failed (errno, path, engine, operation, offset).
        pickle.UnpicklingError: ``weights_only`` refused the pickle, in
            torch's own words.
        RuntimeError: whatever ``torch.load`` raises for the same arguments
            (an unknown device in ``map_location``, ...).
    """
    def delegate():
        if verify and _is_plain_path(f) and not mmap:
            raise CheckpointError(f"{os.fspath(f)}: verify=True checks zip checkpoints written by torch.save; "
                                  "this file is not one (legacy, TorchScript or compressed, or its first bytes "
                                  "are damaged), and the original torch.load that reads it checks no CRCs")
        if verify:
            raise ValueError(f"verify=True needs a path to a zip checkpoint; {f!r} is read by the original "
                             "torch.load, which does not check CRCs")
        return _torch_api.original_load()(f, map_location, pickle_module, weights_only=weights_only, mmap=mmap,
                               **pickle_load_args)

    source = f if _is_plain_path(f) else _path_of_file_object(f)  # an open file is read by its path
    if source is None or os.fspath(source).endswith(".safetensors") \
            or _torch_api.lazy_or_meta_load(map_location, mmap):
        return delegate()
    path = os.fspath(source)

    # The file first: legacy and TorchScript files go to torch.load before
    # anything below could warn twice.
    with gc_pause.paused():  # the index: a few objects per record
        # an open file's own descriptor (a copy): its name may name another file by now
        image = _CheckpointImage.open(path, current_options(), None if source is f else os.dup(f.fileno()))
    if image is None:  # legacy format, TorchScript or compressed records: torch's own path
        return delegate()
    if source is not f:
        image.caller = f  # left where torch.load would leave it (see _CheckpointImage.leave_caller)
    with image:
        # Resolve the arguments exactly as torch.load does (torch 2.13).
        _torch_api.log_api_usage("torch.load")
        wo_requested = weights_only
        if weights_only is None:
            weights_only = _torch_api.default_to_weights_only(pickle_module)
        force_wo = os.getenv("TORCH_FORCE_WEIGHTS_ONLY_LOAD", "0").lower() in _TRUE
        force_no_wo = os.getenv("TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD", "0").lower() in _TRUE
        if force_wo and force_no_wo:
            raise RuntimeError("Only one of `TORCH_FORCE_WEIGHTS_ONLY_LOAD` or `TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD` "
                               "should be set, but both were set.")
        if force_wo:
            weights_only = True
        elif force_no_wo and wo_requested is None:
            warnings.warn("Environment variable TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD detected, since the"
                          "`weights_only` argument was not explicitly passed to `torch.load`, forcing "
                          "weights_only=False.", UserWarning, stacklevel=2)
            weights_only = False
        if weights_only:
            if pickle_module is not None:
                raise RuntimeError("Can not safely load weights when explicit pickle_module is specified")
        elif pickle_module is None:
            pickle_module = pickle
        if pickle_load_args and weights_only:
            warnings.warn("pickle_load_args only works if `weights_only=False`.", stacklevel=2)
        _torch_api.check_dill_version(pickle_module)
        load_args = dict(pickle_load_args)
        load_args.setdefault("encoding", "utf-8")

        if _through_buffers(image, map_location):
            try:
                return _load_through_buffers(image, map_location, weights_only, pickle_module, load_args, verify,
                                             pickle_load_args)
            except _NotThroughBuffers:
                pass  # a location only torch knows how to restore: the path below
        if image.mostly_outside_records():
            # Each record read into a storage of its own, as torch's reader does: an image of the
            # whole file would be kept alive, holes and all, by any one tensor sliced from it.
            image.index.resolve(image.read_at)
            if verify:
                image.verify_records({})
            reader = image.reader(None, image.read_file_into)
            return _unpickle(reader, image.fd, map_location, weights_only, pickle_module, load_args, pickle_load_args)
        plain = not verify and _plain_state_may_apply(image.index.has_checksums, weights_only, pickle_module,
                                                      pickle_load_args)
        if plain:
            # The pickle and the small records beside it, before the bulk
            # read: behind its queue of large reads each small read waited
            # milliseconds (unpickling a 50 MB file's 110 tensors took 24 ms
            # instead of 2.4 ms here). Read again below, from the page cache.
            image.prefetch_pickle()
        image.start_reading()
        reader = image.reader(image.as_storage(), image.read_file_into)
        result = _NOT_LOADED
        if plain:
            # while the file is read: the tensors are views of the memory being filled
            try:
                with gc_pause.paused():
                    result = _torch_api.unpickle_plain_state(reader, reader.storage_for_key, map_location,
                                                             **load_args)
            except _torch_api.NotPlainState:
                pass
        try:
            image.finish_reading(resolve=result is _NOT_LOADED)
        except BaseException:
            reader = result = None  # the storage over the memory dies, and the memory goes back to the pool
            raise
        if result is not _NOT_LOADED:
            if reader.predictions_hold():
                _torch_api.log_load_metadata(reader)
                return result
            # a writer other than torch's placed the data elsewhere: torch's path decides
            result = None
            image.index.resolve(image.read_at)
        if verify:
            image.verify()
        return _unpickle(reader, image.fd, map_location, weights_only, pickle_module, load_args, pickle_load_args)


def _unpickle(reader, fd: int, map_location, weights_only: bool, pickle_module, load_args: dict,
              pickle_load_args: dict):
    """torch's own unpickling of the checkpoint reader stands in for (of
    the file open on fd)."""
    try:
        if weights_only:
            return _torch_api.unpickle_weights_only(reader, map_location, **load_args)
        return _torch_api.unpickle_from(reader, map_location, pickle_module, **load_args)
    except pickle.UnpicklingError as refusal:
        if not weights_only:
            raise
        # torch.load words weights_only refusals with a helper private to
        # it; let it refuse the file itself so the error is word for word
        # the same (it stops at the same global, before loading tensors):
        # the file read (a copy of its descriptor), not whatever its name
        # names by now. Its warnings (an unusual pickle protocol) were given
        # once already.
        with warnings.catch_warnings(), open(os.dup(fd), "rb") as same_file:
            warnings.simplefilter("ignore")
            _torch_api.original_load()(same_file, map_location, None, weights_only=True, mmap=False,
                                       **pickle_load_args)
        raise refusal  # torch accepted what it refused here: never hand back another file's objects


_NOT_LOADED = object()


# ---------------------------------------------------------------------------
# loads to a GPU: each storage allocated on its device, filled from the
# engine's buffers (device_io.read_into); no host copy of the checkpoint

STREAM_LOADS = False  # tests: loads to the CPU take this path too (a memcpy consumer)


class _NotThroughBuffers(Exception):
    """A storage restored to a location other than the CPU or a CUDA device."""


def _through_buffers(image: "_CheckpointImage", map_location) -> bool:
    """Whether the load may restore storages to a CUDA device (map_location
    names one, or leaves saved CUDA locations as they are) and can take the
    buffered path: map_location is not a callable (its result is the
    caller's), the file is in this machine's byte order, and no rebuild
    function in the pickle reads map_location itself."""
    import torch

    if not (map_location is None or isinstance(map_location, (str, dict, torch.device))):
        return False
    if not STREAM_LOADS and (not torch.backends.cuda.is_built() or (  # a CPU build of torch: nothing to ask
            isinstance(map_location, (str, torch.device)) and not str(map_location).startswith("cuda"))):
        return False
    record = image.index.lookup("data.pkl")
    if record is None:
        return False
    pickled = image.index.read_record(image.read_at, record)  # small; read again from the page cache
    if not STREAM_LOADS:
        # None or a dict keep saved locations (perhaps renamed): a CUDA one is named in the pickle, or
        # the dict renames a location the pickle names to a CUDA one
        named = isinstance(map_location, (str, torch.device)) or b"cuda" in pickled or (
            isinstance(map_location, dict) and any(str(v).startswith("cuda") and str(k).encode() in pickled
                                                   for k, v in map_location.items()))
        if not (named and torch.cuda.is_available()):
            return False
    return not _torch_api.pickle_reads_map_location(pickled) and _file_byte_order(image) == sys.byteorder


class _DeviceTargetReader(TorchArchiveReader):
    """Hands torch's _load a meta storage for each record, which says where
    the record's data starts; _load_through_buffers' restore callable
    allocates the real one on its device."""

    def get_storage_from_record(self, name: str, nbytes: int, storage_type):
        import torch

        r = self.index.entry(name)
        self._check_size(r, nbytes)
        self.index.resolve(self._read_at, [r])
        storage = torch.UntypedStorage(nbytes, device="meta")
        storage._checkpoint_offset = r.data_offset
        return torch.empty(0, dtype=torch.uint8, device="meta").set_(storage)


def _load_through_buffers(image: "_CheckpointImage", map_location, weights_only: bool, pickle_module,
                          load_args: dict, verify: bool, pickle_load_args: dict):
    """fastpersist.load for loads that may restore storages to a GPU: the
    pickle is unpickled first, each storage allocated where map_location
    puts it (torch's rules and errors), then one pass over the file fills
    them all from the engine's buffers: host-to-device copies without
    blocking, each buffer given back once its copies are done (CPU
    storages: plain copies). Host memory: the engine's buffers and the CPU
    storages, no copy of the device storages."""
    import torch

    pieces: list = []

    def restore(storage, location):
        target = _torch_api.restore_target(map_location, location)
        device = _torch_api.cuda_restore_device(target)
        if device is None:
            if target != "cpu":
                raise _NotThroughBuffers(target)
            device = torch.device("cpu")
        restored = torch.UntypedStorage(storage.nbytes(), device=device)
        pieces.append(device_io.Piece(_torch_api.checkpoint_offset(storage), storage.nbytes(),
                                      device_io.byte_view(restored)))
        # fixed in size, as torch's own: a view past the record is refused, never grown into fresh memory
        return fixed_size(restored)

    image.prefetch_local_headers()
    reader = image.reader(kind=_DeviceTargetReader)
    result = _unpickle(reader, image.fd, restore, weights_only, pickle_module, load_args, pickle_load_args)
    try:
        crcs = read_pipeline.read_pieces(image.fd, image.path, image.size, image.options, pieces, verify)
    except EOFError:
        raise CheckpointError(f"{image.path}: the file ended before its {image.size} bytes were read "
                              "(did it shrink while being read?)") from None
    if verify:
        image.verify_records(crcs)
    return result


def _plain_state_may_apply(checksummed: bool, weights_only: bool, pickle_module, pickle_load_args: dict) -> bool:
    """Whether _torch_api.unpickle_plain_state may try the pickle while its
    tensors are being read: it allows only globals that both of torch's
    unpicklers allow, so with weights_only=False only for the standard pickle
    module, and with weights_only=True only where the pickle is checked against
    its CRC-32 (CPython's unpickler takes opcodes torch's refuses, so a damaged
    pickle torch would refuse could load)."""
    if set(pickle_load_args) - {"encoding"}:
        return False
    if weights_only:
        return checksummed
    return pickle_module is pickle


def _is_plain_path(f) -> bool:
    return isinstance(f, (str, os.PathLike)) and isinstance(os.fspath(f), str)


def _path_of_file_object(f) -> Optional[str]:
    """The path to read for a file object, or None where torch.load must read
    the object itself: a plain file opened read-only (``open(path, "rb")``,
    or fsspec's local file without compression, which Lightning hands
    torch.load) at its start, whose name still names its file. Wrappers
    (gzip, zip members, sockets, BytesIO) and files opened for writing
    (their unflushed bytes) are the object's own to read."""
    if type(f).__name__ == "LocalFileOpener" and type(f).__module__ == "fsspec.implementations.local":
        f = getattr(f, "f", None)
    raw = f.raw if type(f) is io.BufferedReader else f  # exact types: a subclass may read otherwise
    if type(raw) is not io.FileIO:
        return None
    try:
        name = f.name
        if not isinstance(name, str) or f.closed or not f.readable() or f.writable() or f.tell() != 0:
            return None
        opened = os.fstat(f.fileno())
        if not stat.S_ISREG(opened.st_mode) or not same_file(opened, os.stat(name)):
            return None  # renamed or replaced since it was opened, or not a file
    except (OSError, ValueError):
        return None
    return name


class _NotesReads:
    """Mixed into a reader of a caller's open file (_CheckpointImage.reader):
    notes in its image the last record torch's own reader would have read
    bytes of, whichever of load's paths unpickles (see leave_caller)."""

    image: "_CheckpointImage"

    def get_record(self, name: str) -> bytes:
        data = super().get_record(name)
        if data:
            self.image.last_read = name
        return data

    def storage_for_key(self, key: str, nbytes: int, alignment: int):
        storage = super().storage_for_key(key, nbytes, alignment)
        if nbytes:
            self.image.last_read = "data/" + key
        return storage

    def get_storage_from_record(self, name: str, nbytes: int, storage_type):
        storage = super().get_storage_from_record(name, nbytes, storage_type)
        if nbytes:
            self.image.last_read = name
        return storage


def _noting_reads(kind: type) -> type:
    """kind (a TorchArchiveReader class) with _NotesReads mixed in, made once."""
    noting = _NOTING_READS.get(kind)
    if noting is None:
        noting = _NOTING_READS[kind] = type(kind.__name__, (_NotesReads, kind), {"__module__": __name__})
    return noting


_NOTING_READS: dict = {}


class _CheckpointImage:
    """An open checkpoint file, its index, and (after finish_reading) its bytes in
    page-aligned memory."""

    def __init__(self, path: str, fd: int, size: int, index: Optional[ArchiveIndex], options: Options):
        self.path, self.fd, self.size, self.index, self.options = path, fd, size, index, options
        self.memory: Optional[_mmap.mmap] = None
        self.view: Optional[memoryview] = None
        self._reading: Optional[HelperThreads] = None  # start_reading's read, until waited for
        self._read_error: Optional[BaseException] = None  # what start_reading's thread raised
        self._storage_made = False
        # a caller's file object (load(open(path, "rb"))), left where torch.load leaves it: see leave_caller
        self.caller = None
        self.last_read: Optional[str] = None  # the record torch's reader would have read bytes of last

    @classmethod
    def open(cls, path: str, options: Options, fd: Optional[int] = None) -> Optional["_CheckpointImage"]:
        """None where torch.load must handle the file itself. fd: a
        descriptor of the file already open (the image owns it), else path
        is opened."""
        if fd is None:
            fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        try:
            size = os.fstat(fd).st_size
            if size == 0:
                raise CheckpointError(f"{path}: the file is empty (0 bytes); it is not a checkpoint")
            if os.pread(fd, 4, 0) != b"PK\x03\x04":  # torch's own test for the zip format
                os.close(fd)
                return None
            index = ArchiveIndex.read(lambda o, n: os.pread(fd, n, o), size, path)
            if index.is_torchscript or index.has_compressed_records:
                os.close(fd)
                return None
        except BaseException:
            _close_quietly(fd)
            raise
        return cls(path, fd, size, index, options)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self._wait_for_read(give_up=exc[0] is not None)  # never leave a read going into memory that may be reused
        try:
            if exc[0] is None and self.caller is not None:
                self.leave_caller()
        finally:
            self._close()

    def _close(self) -> None:
        if self.view is not None:
            self.view.release()
            self.view = None
        if self.memory is not None and not self._storage_made:
            load_memory.give_back(self.memory)  # a load that failed before its result was made
        self.memory = None
        _close_quietly(self.fd)

    def reader(self, storage=None, read_file_into=None, kind: Optional[type] = None) -> TorchArchiveReader:
        """A reader of this image's records for torch's _load: kind (a
        TorchArchiveReader class) over read_at, with storage and
        read_file_into as TorchArchiveReader takes them; for a caller's file
        object, one that notes in last_read what torch's reader would read."""
        kind = TorchArchiveReader if kind is None else kind
        if self.caller is None:
            return kind(self.index, self.read_at, storage, self.path, read_file_into)
        reader = _noting_reads(kind)(self.index, self.read_at, storage, self.path, read_file_into)
        reader.image = self
        return reader

    def leave_caller(self) -> None:
        """Leaves the caller's file object where torch.load leaves it. torch
        reads an open file through the object itself (PyTorchFileReader over
        it: a seek and a readinto for every read), so the object stands at
        the end of the last bytes read: a record's data (miniz reads a
        stored record's local header, then its data in one read; an empty
        record, nothing). torch's _load reads .format_version, byteorder,
        .storage_alignment, then data.pkl, then each storage's record at
        its key's first reference in the pickle (a non-empty storage is
        kept for later references, an empty one read again: nothing); the
        readers of this load note the same reads (_NotesReads). fastpersist
        reads the file through its own descriptor (pread), which moves
        nothing."""
        if self.last_read is None:
            return
        record = self.index.entry(self.last_read)
        self.index.resolve(self.read_at, [record])
        self.caller.seek(record.data_offset + record.size)

    def start_reading(self) -> None:
        """Maps memory for the whole file and starts reading it there on a
        thread (the engine and the page-cache reads release the GIL), so
        that unpickling can build the tensors over that memory meanwhile;
        finish_reading waits for it. Until then read_at reads the file."""
        import ctypes

        memory, fresh = load_memory.image_memory(self.size)
        self.memory = memory
        # through ctypes, which torch has loaded, not the engine's binding: a small
        # file read without an engine then loads no extension (1 ms, the first time)
        address = ctypes.addressof(ctypes.c_char.from_buffer(memory))
        extents = [(address, 0, self.size)]

        def read(stop) -> None:
            try:
                # fresh memory: faulted in ahead of the copies, by helper threads for
                # the engine (started before it, which may still have to be created),
                # by the readers themselves through the page cache. MADV_HUGEPAGE
                # instead made no difference (0.047 s against 0.048 s for 50 MB, 5 rounds).
                self.read_extents(extents, checksums=False, started=started, fresh=fresh, stop=stop)
            except BaseException as exc:  # handed to finish_reading
                self._read_error = exc
            finally:
                started.set()

        # The caller goes on once the thread is inside the read itself, which
        # runs without the GIL. Before that (taking an engine, opening the
        # file) each call that lets the GIL go would wait to get it back
        # while the caller unpickles, up to the interpreter's switch interval
        # (5 ms) each time: that made a 20 ms read 2.4 ms slower here.
        # An interrupt while the caller waits or unpickles leaves through the
        # image's __exit__, which stops the read and waits for it (HelperThreads):
        # the memory it reads into is freed or pooled only then.
        started = threading.Event()
        self._reading = HelperThreads(name="fastpersist-load")
        if not self._reading.start(read, self._reading.stop):
            read(self._reading.stop)  # no thread to be had: read here, then unpickle
        started.wait()

    def finish_reading(self, resolve: bool = True) -> None:
        """Waits for start_reading's read; raises what it raised (the memory
        given back unless a storage over it is out). Then, unless told not
        to, locates every record's data from the local headers in memory."""
        self._wait_for_read()
        exc, self._read_error = self._read_error, None
        if exc is not None:
            if not self._storage_made:  # else the storage's finalizer gives it back
                load_memory.give_back(self.memory)
            self.memory = None
            if isinstance(exc, EOFError):
                raise CheckpointError(f"{self.path}: the file ended before its {self.size} bytes were read "
                                      "(did it shrink while being read?)") from None
            raise exc
        self.view = memoryview(self.memory)
        if resolve:
            self.index.resolve(self.read_at)

    def _wait_for_read(self, give_up: bool = False) -> None:
        """Waits for start_reading's read (stopped first where given up on);
        an interrupt meanwhile stops it, and is raised once it has stopped."""
        if self._reading is not None:
            if give_up:
                self._reading.stop.set()
            self._reading.wait()
            self._reading = None

    # Bytes outside every record (headers, the central directory, holes) past which, when they also
    # outnumber the records' own, load reads record by record instead of into one image of the file.
    MOST_OUTSIDE_RECORDS = 64 << 20

    def mostly_outside_records(self) -> bool:
        """Whether most of the file, and more than MOST_OUTSIDE_RECORDS, is
        bytes in no record: a hole (zip allows any bytes between records or
        before the central directory) that an image of the file would hold
        in memory for as long as any tensor of it lives. torch.save's files
        hold under 1 KiB outside records per record."""
        if self.size <= self.MOST_OUTSIDE_RECORDS:
            return False  # not worth listing the records (a few us each) to know
        outside = self.size - sum(r.size for r in self.index.records.values())
        return outside > self.MOST_OUTSIDE_RECORDS and outside > self.size // 2

    def pickle_size(self) -> int:
        r = self.index.lookup("data.pkl")
        return 0 if r is None else r.size

    def prefetch_pickle(self) -> None:
        """Brings data.pkl and what lies just past it (torch's small records)
        into the page cache."""
        r = self.index.lookup("data.pkl")
        if r is not None and 0 <= r.header_offset < self.size:
            end = min(self.size, r.header_offset + r.size + (64 << 10))
            os.posix_fadvise(self.fd, r.header_offset, end - r.header_offset, os.POSIX_FADV_WILLNEED)
            os.pread(self.fd, 1, r.header_offset)  # waits for the first of those pages

    HEADER_GAP = 64 << 10  # read between two headers rather than ask twice

    def prefetch_local_headers(self) -> None:
        """Starts reading every record's local header, which says where its
        data starts, before the layout pass asks for them: one pread after
        another, cold, took 18 ms for GPT-2's 269 records here; asking the
        kernel to read them all ahead first (POSIX_FADV_WILLNEED starts the
        reads, not waiting for them), 4 ms."""
        if self.view is not None:
            return  # the whole file is in memory already
        for start, end in self.local_header_spans():
            os.posix_fadvise(self.fd, start, end - start, os.POSIX_FADV_WILLNEED)

    def headers_span_most_data(self) -> bool:
        """Whether the spans of local_header_spans cover most of the file:
        records small and close together, as an optimizer's state has them."""
        return 2 * sum(end - start for start, end in self.local_header_spans()) >= self.size

    def local_header_spans(self) -> list:
        """(start, end) spans of the file holding every record's local header,
        headers closer than HEADER_GAP in one span (each fadvise costs ~8 us)."""
        spans: list = []
        start = end = -1
        for offset in sorted(r.header_offset for r in self.index.records.values() if 0 <= r.header_offset < self.size):
            if offset - end > self.HEADER_GAP:
                if end > start:
                    spans.append((start, end))
                start = offset
            end = offset + 4096
        if end > start:
            spans.append((start, end))
        return spans

    def read_extents(self, extents: list, checksums: bool, started: Optional[threading.Event] = None,
                     fresh: bool = False, stop: Optional[StopSignal] = None) -> dict:
        """Reads (address, offset, nbytes) extents of the file through the read
        pipeline (read_pipeline.read_extents' contract: the source picks the
        page cache, in parallel, or the engine's O_DIRECT reads)."""
        return read_pipeline.read_extents(self.fd, self.path, self.size, self.options, extents, checksums,
                                          fresh=fresh, started=started, stop=stop)

    def copy_extents(self, extents: list, checksums: bool) -> dict:
        """read_extents' contract for a file read whole into memory already
        (finish_reading): each extent copied from there."""
        base = ctypes.addressof(ctypes.c_char.from_buffer(self.memory))
        _engine.copy_many([(base + offset, address, nbytes) for address, offset, nbytes in extents])
        if not checksums:
            return {}
        return {(offset, nbytes): _engine.crc32(self.view[offset:offset + nbytes]) for _, offset, nbytes in extents}

    def read_at(self, offset: int, n: int) -> bytes:
        if self.view is None:
            return os.pread(self.fd, n, offset)
        return bytes(self.view[offset:offset + n])

    def read_file_into(self, address: int, offset: int, nbytes: int) -> None:
        """The file's bytes at offset into memory at address (not the image's,
        which torch may have byteswapped in place)."""
        try:
            read_pipeline.pread_extents(self.fd, self.path, [(address, offset, nbytes)], False)
        except EOFError:
            raise CheckpointError(f"{self.path}: the file ended before its {self.size} bytes were read "
                                  "(did it shrink while being read?)") from None

    def as_storage(self):
        """The file's bytes as one storage. When the last tensor sliced from
        it dies, the memory goes to load_memory, kept briefly for the next load."""
        import torch

        return torch.frombuffer(self.as_buffer(), dtype=torch.uint8, count=self.size).untyped_storage()

    def as_buffer(self):
        """The file's bytes as a buffer object: storages made over parts of it
        (torch.frombuffer) keep it alive; when the last of them dies, the
        memory goes to load_memory."""
        self._storage_made = True
        return load_memory.as_buffer(self.memory)

    def verify(self) -> None:
        """Every record's CRC-32 against the central directory's."""
        self.require_checksums()
        for r in self.index.records.values():
            if r.size:
                self.check_crc(r, _engine.crc32(self.view[r.data_offset:r.data_offset + r.size]))

    def require_checksums(self) -> None:
        if not self.index.has_checksums:
            raise CheckpointError(f"{self.path}: saved without CRC-32 checksums "
                                  "(torch.utils.serialization.config.save.compute_crc32=False); cannot verify it")

    def check_crc(self, record, crc: int, consequence: str = "") -> None:
        if crc != record.crc:
            raise CheckpointError(f"{self.path}: record '{record.name}' fails its CRC-32 check "
                                  f"({record.size} bytes at offset {record.data_offset}); the file is corrupt"
                                  + consequence)

    def verify_records(self, crcs: dict, consequence: str = "") -> None:
        """Checks every record's CRC-32: from crcs ({(data offset, size): crc}
        of the bytes a read moved) where the read covered the record whole,
        else read again from the file."""
        self.require_checksums()
        for r in self.index.records.values():
            if not r.size:
                continue
            self.index.resolve(self.read_at, [r])
            crc = crcs.get((r.data_offset, r.size))
            self.check_crc(r, self.record_crc(r) if crc is None else crc, consequence)

    def record_crc(self, record) -> int:
        """CRC-32 of a record read from the file in pieces (no whole-record allocation)."""
        crc, offset, end = 0, record.data_offset, record.data_offset + record.size
        while offset < end:
            piece = os.pread(self.fd, min(16 << 20, end - offset), offset)
            if not piece:
                raise CheckpointError(f"{self.path}: the file ended inside record '{record.name}'")
            crc = _engine.crc32(piece, crc)
            offset += len(piece)
        return crc


def _close_quietly(fd: int) -> None:
    try:
        os.close(fd)
    except OSError:
        pass


# ---------------------------------------------------------------------------
# fastpersist.load_into


class IncompatibleKeys(NamedTuple):
    """What load_into could not match, like nn.Module.load_state_dict's result."""

    missing_keys: list
    unexpected_keys: list


def load_into(target, f, *, strict: bool = True, verify: bool = False, weights_only: bool = True,
              **options) -> IncompatibleKeys:
    """Reads the checkpoint at path ``f`` straight into the tensors of
    ``target``, an ``nn.Module`` or a state dict (nested dicts and lists;
    a tuple or other container holding tensors is refused).

    Every stored tensor goes into the memory of the existing tensor with the
    same key: no intermediate tensor and no second copy for contiguous CPU
    tensors (others are read into a temporary and copied). Before anything is
    written, keys, shapes and dtypes are checked; with ``strict`` (the default)
    missing and unexpected keys are errors too, all reported in one
    RuntimeError, and nothing is modified. Non-tensor values of a dict target
    (an optimizer's param_groups) are replaced by the file's. For an
    optimizer, restore into ``sd = opt.state_dict()`` and then call
    ``opt.load_state_dict(sd)`` for the hyperparameters: the state tensors,
    already filled in place, are kept as they are, not copied again.

    ``verify=True`` also checks the CRC-32 of every record read; a mismatch
    raises CheckpointError after the read, and the target then holds the
    file's corrupt bytes.

    Args:
        target: an ``nn.Module`` (its ``state_dict()`` is filled) or a state
            dict of tensors, possibly nested in dicts and lists.
        f: a ``str`` or ``os.PathLike`` path; file objects are not taken.
        strict: missing and unexpected keys are errors, as in
            ``load_state_dict``.
        verify: check every record's CRC-32 as it is read.
        weights_only: unpickle the file's layout with torch's weights-only
            unpickler (the default), as ``torch.load`` does.
        **options: :class:`fastpersist.Options` fields for this call.

    Returns:
        ``IncompatibleKeys(missing_keys, unexpected_keys)``, as
        ``load_state_dict`` returns.

    Raises:
        RuntimeError: keys (with ``strict``), shapes or dtypes do not match;
            all mismatches in one message, and the target is untouched.
        TypeError: ``target`` is neither a module nor a state dict, holds
            tensors in a container other than dicts and lists, or ``f`` is not
            a path.
        ValueError: ``target`` holds itself (a cycle), or its shared
            containers expand to more keys than the bound allows.
        fastpersist.CheckpointError: the file is not a zip checkpoint of
            ``torch.save`` 1.6 or later, is truncated or corrupt (the
            target is untouched), ``verify`` found a mismatch (after the
            read), or (without ``strict``) the names of its missing and
            unexpected keys would take more than 16 MiB and 16 characters
            per byte of its pickle (keys repeated down a deep tree), nothing
            written; with ``strict`` the error lists the names that fit and
            counts the rest.
        OSError: reading failed (errno, path, engine, operation, offset).
    """
    import torch

    opts = current_options().replace(**options)
    if not _is_plain_path(f):
        raise TypeError(f"load_into reads from a path, got {type(f).__name__}")
    path = os.fspath(f)
    is_module = isinstance(target, torch.nn.Module)
    if not is_module and not isinstance(target, Mapping):
        raise TypeError(f"load_into needs an nn.Module or a state dict, got {type(target).__name__}")

    # the index, the layout and the plan: a few objects per tensor (a state_dict() hook of the
    # target's may run meanwhile: the collector only waits, nothing is lost)
    with gc_pause.paused():
        image = _CheckpointImage.open(path, opts)
        if image is None:
            raise CheckpointError(f"{path}: load_into reads zip checkpoints written by torch.save (1.6 or later); "
                                  "this one is legacy, TorchScript or compressed")
        with image:
            if verify:
                image.require_checksums()  # before anything is written: the check comes after the copies
            plan = _fill(image, target, is_module, strict, verify, weights_only, read_early=True)
            if plan is None:  # a guessed data place was wrong (nothing was written): again, from the local headers
                plan = _fill(image, target, is_module, strict, verify, weights_only, read_early=False)
    return IncompatibleKeys(plan.missing, plan.unexpected)


def _fill(image: _CheckpointImage, target, is_module: bool, strict: bool, verify: bool, weights_only: bool,
          read_early: bool) -> Optional["_Plan"]:
    """One layout, plan and read of load_into. read_early: the read of the
    storages' bytes begins before the layout where it can (see _DataAhead),
    and the layout's guesses of where each record's data starts are checked
    only once the plan is made. Returns None, with nothing written, where a
    guess was wrong."""
    import torch

    if is_module:  # a module's keys are already dotted paths: matched against the checkpoint's joined ones
        names = target.state_dict(keep_vars=True)
        target_leaves = list(names.values())
    else:
        names = None
        target_leaves = [leaf for _, _, leaf, _ in _leaves(target, "target")]
    with contextlib.ExitStack() as stack:
        early = None
        if read_early and image.view is None and image.size < read_pipeline.SMALL_FILE_BYTES and not STREAM_LOADS \
                and image.headers_span_most_data() \
                and all(v.is_cpu for v in target_leaves if isinstance(v, torch.Tensor)):
            early = _WholeFileRead(image)
        elif read_early:
            early = _DataAhead.begin(image)
        if early is None:
            early = _HeadersFetched(image)
        stack.callback(early.close)
        reader = _NativeOrderReader(image.index, image.read_at, source=image.path)
        stored, mapped = _layout(image, reader, weights_only, early)
        # a tree-shaped pickle holds fewer leaves than bytes: more keys than
        # that and the target's come from shared containers nested in each other
        try:
            match = _Match(stored, target, names, len(target_leaves), len(target_leaves) + image.pickle_size())
        except ValueError as exc:
            raise CheckpointError(f"{image.path}: {exc}") from None
        unchecked = early.unchecked
        try:
            plan = _plan(image, match, strict, is_module, target,
                         reader.guessed_records() if unchecked else image.index.by_data_offset(), mapped)
        except CheckpointError:
            # guessed places that do not hold (small records of a file without torch's padding can
            # round up to one place) make a sound file look corrupt: the local headers decide
            if unchecked and not reader.predictions_hold():
                return None
            raise
        return plan if plan.execute(image, verify, early if unchecked else None, reader) else None


# What load_into reads while its layout unpickles, each with the same calls:
# guesses_hold(reader) once a plain layout is made (whether it stands, the
# records' data places it guessed confirmed or left to check later: then
# ``unchecked``), stop() before torch's own layout, close() at the end.

class _HeadersFetched:
    """Nothing but the local headers that confirm the guessed data places,
    fetched while the layout unpickles; the data is read after the plan."""

    unchecked = False

    def __init__(self, image: _CheckpointImage):
        image.prefetch_local_headers()

    def guesses_hold(self, reader: TorchArchiveReader) -> bool:
        return reader.predictions_hold()

    def stop(self) -> None:
        pass

    def close(self) -> None:
        pass


class _WholeFileRead:
    """The whole file read into memory while the layout runs, for a small
    file of small records: fetching their local headers reads most of it
    through the page cache, and the engine's read of the data would read it
    again (Adam's state of 1,452 tensors, cold: 74 ms against 29 for
    fastpersist.load). The headers are checked in that memory, and CPU
    tensors copied from it (others go through the engine's buffers, a read
    of their own)."""

    unchecked = False

    def __init__(self, image: _CheckpointImage):
        self.image = image
        image.prefetch_pickle()  # read ahead of the whole file's read, which the layout does not wait for
        image.start_reading()

    def guesses_hold(self, reader: TorchArchiveReader) -> bool:
        self.stop()
        return reader.predictions_hold()

    def stop(self) -> None:
        if self.image.view is None:
            self.image.finish_reading(resolve=False)

    def close(self) -> None:
        pass  # the image waits for its read when it closes


class _DataAhead:
    """The engine's read of a checkpoint's storages, begun before load_into
    knows where their bytes go, so that it overlaps the layout and the plan
    (unpickling and matching keys: 6 ms of a 50 MB load_into here): the
    engine fills its buffers meanwhile, and they are copied out once the plan
    is made. The local headers, which confirm the layout's guessed data
    places, are asked for before it: behind it, each would wait for the
    reads queued ahead of it. They are checked before a tensor is written
    (``unchecked`` until then)."""

    def __init__(self, pull: Optional[device_io.PullRead], engine_context):
        self.pull = pull
        self._engine_context = engine_context
        self.unchecked = True

    @classmethod
    def begin(cls, image: _CheckpointImage) -> Optional["_DataAhead"]:
        """None where the read goes the usual way: a file the pipeline reads
        through the page cache (cached, or small with no engine idle; asking
        the kernel to read a small one ahead while the layout runs made
        that slower here)."""
        span = image.index.data_span()
        if span is None or read_pipeline.through_page_cache(image.fd, image.size, image.options):
            return None
        start, end = span
        # the pickle, torch's small records and the local headers first: reads queued after the data's wait for it
        image.prefetch_pickle()
        image.prefetch_local_headers()
        context = reading_engine(image.path, image.options, image.size, image.fd)
        engine, direct_fd = context.__enter__()
        try:
            return cls(device_io.PullRead(engine, direct_fd, image.fd, image.path, start, end), context)
        except BaseException:
            context.__exit__(None, None, None)
            raise

    def guesses_hold(self, reader: TorchArchiveReader) -> bool:
        return True  # checked by _Plan.execute, before a tensor is written

    def stop(self) -> None:
        self.close()

    def close(self) -> None:
        """Ends the read if it is still going (the layout could not guess: the
        read then goes the usual way) and gives the engine back."""
        self.unchecked = False
        if self.pull is not None:
            self.pull.abandon()
        if self._engine_context is not None:
            context, self._engine_context = self._engine_context, None
            context.__exit__(None, None, None)


def _layout(image: _CheckpointImage, reader: TorchArchiveReader, weights_only: bool, early):
    """The checkpoint's objects and the mapping they were loaded over (None
    for a plain layout): tensors as StoredTensors (shapes and file places
    only, no tensor data read) or as CPU tensors. A plain state dict is
    unpickled while ``early`` reads (the local headers, the whole file or
    the data: see _HeadersFetched and the classes beside it), with each
    record's data place guessed (see layout_offset_for_key), and kept where
    early says the guesses hold. Anything else stops early, then waits for
    the headers and is loaded by torch's own unpickling (_loaded_layout)."""
    if _plain_state_may_apply(reader.records_checked, weights_only, None if weights_only else pickle, {}):
        try:
            stored = _torch_api.unpickle_plain_state(reader, reader.layout_offset_for_key, "meta", layout=True)
        except _torch_api.NotPlainState:
            pass
        else:
            if early.guesses_hold(reader):
                return stored, None
    early.stop()
    image.index.resolve(image.read_at)  # lenient: a record torch would refuse raises where it is used
    return _loaded_layout(image, weights_only)


def _loaded_layout(image: _CheckpointImage, weights_only: bool):
    """torch.load(map_location="cpu")'s own result, its storages slices of a
    private (copy-on-write) mapping of the file: what torch decides is
    decided by torch's code on real CPU storages, as torch.load decides it
    (a view past its record or a negative stride refused by set_, a tensor
    whose data the pickle reads, as a neg bit, read; a big-endian file
    swapped by each storage's dtype), and nothing is read but what the
    unpickling touches. A meta-device load instead went through code
    torch.load never runs (_get_offset's assertion that the first key is
    "0"), grew meta storages where set_ refuses real ones, and failed where
    data was needed. Returns (objects, the mapping's storage): _plan reads a
    tensor lying in the mapping from the file by its place there; one that
    does not (a copy), or whose bytes torch swapped, is copied from."""
    import torch

    mapping = _mmap.mmap(image.fd, image.size, flags=_mmap.MAP_PRIVATE, prot=_mmap.PROT_READ | _mmap.PROT_WRITE)
    mapped = torch.frombuffer(mapping, dtype=torch.uint8).untyped_storage()
    reader = image.reader(mapped, image.read_file_into)
    try:
        if weights_only:  # torch.load's encoding: SHORT_BINSTRING and BINSTRING decoded as UTF-8, strictly
            return _torch_api.unpickle_weights_only(reader, "cpu", encoding="utf-8"), mapped
        return _torch_api.unpickle_from(reader, "cpu", pickle, encoding="utf-8"), mapped
    except RuntimeError as exc:
        if "not resizable" not in str(exc) or isinstance(exc, CheckpointError):
            raise
        # torch's refusal of a view past its record, said of the file (a RuntimeError still)
        raise CheckpointError(f"{image.path}: a tensor's view reaches past its storage's record (torch.load "
                              f"refuses the file: {exc}); the file is corrupt") from None


def _placed(tensor, mapped, swap: bool):
    """A CPU tensor of _loaded_layout as a StoredTensor at its storage's
    place in the file, or the tensor itself where its bytes are not the
    file's (a copy, or swapped by torch)."""
    if swap or mapped is None or tensor.device.type != "cpu":
        return tensor
    storage = tensor.untyped_storage()
    start = storage.data_ptr() - mapped.data_ptr()
    if not storage.nbytes() or not 0 <= start <= mapped.nbytes() - storage.nbytes():
        return tensor
    stored = StoredTensor.__new__(StoredTensor)
    stored.dtype, stored.shape, stored.stride = tensor.dtype, tuple(tensor.shape), tuple(tensor.stride())
    stored.storage_offset, stored.metadata = tensor.storage_offset(), _torch_api.tensor_metadata(tensor)
    stored.element_size = tensor.element_size()
    stored.storage_offset_in_file, stored.storage_nbytes = start, storage.nbytes()
    return stored


class _NativeOrderReader(TorchArchiveReader):
    """Reports the file as native byte order to the plain layout, which
    refuses other orders: its tensors are built by _rebuild_tensor_v2 alone,
    each of its storage's dtype, which is what torch swaps by, so the plan
    swaps the real bytes after reading them, as torch.load would."""

    def get_record(self, name: str) -> bytes:
        if name == "byteorder":
            return sys.byteorder.encode("ascii")
        return super().get_record(name)


# Key paths. A leaf's path is a chain of nodes (parent node, key), the top
# level's parent None: a container's node is shared by everything under it,
# so the paths of a checkpoint take memory in proportion to its pickle. The
# dotted name load_state_dict reports ("a.b.0") is made only for a key that
# is reported, and only within a budget (_KeyNames): a pickle names a long
# string once and refers to it in a few bytes, so one key joined at every
# level of a deep tree makes names far longer than the file (a 0.2 MB pickle
# asked for 1.4 GB of them here), which torch.load never makes.

def _parts(path) -> list:
    """The keys of a path node, top first."""
    parts = []
    while path is not None:
        path, key = path
        parts.append(key)
    parts.reverse()
    return parts


def _key(path) -> str:
    """A path's dotted name: a module's own name as it is, a node's keys joined."""
    if isinstance(path, str):
        return path
    return ".".join(map(str, _parts(path)))


def _key_length(path, limit: int) -> Optional[int]:
    """len(_key(path)) without making it; None past limit (then sooner)."""
    if isinstance(path, str):
        return len(path) if len(path) <= limit else None
    n, seen = -1, {}
    while path is not None:
        path, key = path
        n += 1 + _str_length(key, seen)
        if n > limit:
            return None
    return n


def _str_length(value, seen: dict) -> int:
    """len(str(value)), without making the string for a tuple (its items may
    be one long string referred to many times; seen: lengths by id)."""
    if type(value) is str:
        return len(value)
    if type(value) is not tuple:
        return len(str(value))
    known = seen.get(id(value))
    if known is None:
        items = [len(repr(v)) if type(v) is not tuple else _str_length(v, seen) for v in value]
        known = seen[id(value)] = 2 + sum(items) + 2 * max(0, len(items) - 1) + (len(items) == 1)
    return known


def _shown(path, limit: int = 1 << 16) -> str:
    """A path's name for an error message, however long it would be."""
    if _key_length(path, limit) is not None:
        return _key(path)
    return f"(a key {len(_parts(path))} levels deep whose name is longer than {limit:,} characters)"


class _KeyNames:
    """Names for reported keys, at most ``budget`` characters of them all."""

    def __init__(self, budget: int):
        self.budget = self.left = budget

    def name(self, path) -> Optional[str]:
        """The path's name, or None where it does not fit what is left (and nothing fits after it)."""
        n = _key_length(path, self.left)
        if n is None:
            self.left = -1
            return None
        self.left -= n
        return _key(path)


def _is_branch(value, kinds: Optional[dict] = None) -> bool:
    """What load_into walks into: a mapping, a non-empty list (other values
    are leaves). kinds: _kind's answers by type, kept by the caller."""
    kind = _kind(value, {} if kinds is None else kinds)
    return kind == 1 or (kind == 2 and bool(value))


def _kind(value, kinds: dict) -> int:
    """1 for a mapping, 2 for a list, else 0; remembered in kinds by type
    (an ABC's isinstance took most of a walk's time per leaf)."""
    t = type(value)
    kind = kinds.get(t)
    if kind is None:
        kind = 1 if isinstance(value, Mapping) else 2 if isinstance(value, list) else 0
        if value.__class__ is t:  # not an object that says it is another class
            kinds[t] = kind
    return kind


def _leaves(root, what: str, limit: Optional[int] = None, enter=None, place=None):
    """A state dict's leaves in order, through nested dicts and non-empty
    lists (items keyed by their index): (parent node, key, leaf, place) for
    each, parent the node of the container holding it (see _key).

    place follows the walk in another tree: root's is ``place``, a
    container's enter(its parent's place, its key), or None under a None
    (enter is not asked).

    A container met again under another key (shared, as in {"a": D, "b": D})
    is walked again: each key path gets its leaf. Nested sharing multiplies
    the paths (20 levels of {"a": D, "b": D} hold 2**20); past ``limit``
    leaves load_into refuses the object rather than exhaust memory. Cycles
    are refused. Walked without recursion: any depth the unpickler built."""
    if not isinstance(root, Mapping):
        raise TypeError(f"the {what} holds a {type(root).__name__}, not a state dict")
    count = 0
    on_path = {id(root)}  # ids of the containers being walked: a cycle's
    stack = [(iter(root.items()), None, place, id(root))]
    kinds: dict = {}
    while stack:
        items, node, place, ident = stack[-1]
        for key, value in items:
            kind = kinds.get(type(value))
            if kind is None:
                kind = _kind(value, kinds)
            if kind == 1 or (kind == 2 and value):
                if id(value) in on_path:
                    raise ValueError(f"the {what} holds itself at {_shown((node, key))}: load_into reads trees")
                on_path.add(id(value))
                stack.append((iter(value.items() if kind == 1 else enumerate(value)), (node, key),
                              None if place is None else enter(place, key), id(value)))
                break
            count += 1
            if limit is not None and count > limit:
                raise ValueError(f"the {what}'s shared containers expand to more than {limit} keys: "
                                 "load_into reads state dicts (fastpersist.load reads any object)")
            yield node, key, value, place
        else:
            stack.pop()
            on_path.discard(ident)


_ABSENT = object()
_NAME = object()  # in a trie of a module's names: the name ending at that node


class _Match:
    """Where a checkpoint's leaves go in a target: the checkpoint's tree is
    walked once, with the place in the target that its path has reached so
    far (a container of a dict target; for a module, a node of a trie of
    its names split at their dots, since a checkpoint's key path matches a
    module's name where its keys joined by dots spell it), so no key path
    is joined or copied to be matched.

    pairs: (path, stored leaf, target container, target key, target leaf)
    in the checkpoint's order; path a node, or for a module its name
    (container and key None). unexpected: the checkpoint's unmatched paths
    (nodes), in its order; missing: the target's (nodes or names), in its."""

    def __init__(self, stored, target, names: Optional[dict], target_leaves: int, limit: int):
        self.pairs: list = []
        self.unexpected: list = []
        self._indexes: dict = {}  # id(container) -> {key: its own key}, for containers other than dicts
        self._kinds: dict = {}  # _kind's answers for the other tree's values
        if names is None:
            self._match_tree(stored, target, target_leaves, limit)
        else:
            self._match_names(stored, names, limit)

    def _entry(self, container, key):
        """(the container's own key equal to key, its value), or None."""
        if type(container) is dict:
            value = container.get(key, _ABSENT)
            return None if value is _ABSENT else (key, value)
        index = self._indexes.get(id(container))
        if index is None:
            keys = container.keys() if isinstance(container, Mapping) else range(len(container))
            index = self._indexes[id(container)] = {k: k for k in keys}
        own = index.get(key, _ABSENT)
        return None if own is _ABSENT else (own, container[own])

    def _enter(self, container, key):
        """The container under key, or None (no such key, or a leaf there)."""
        entry = self._entry(container, key)
        return entry[1] if entry is not None and _is_branch(entry[1], self._kinds) else None

    def _match_tree(self, stored, target, target_leaves: int, limit: int) -> None:
        pairs, unexpected, kinds = self.pairs, self.unexpected, self._kinds
        for node, key, value, place in _leaves(stored, "checkpoint", limit, self._enter, target):
            if type(place) is dict:  # _entry's first case, inline: most leaves of most state dicts
                dst, own = place.get(key, _ABSENT), key
            elif place is None:
                dst = _ABSENT
            else:
                entry = self._entry(place, key)
                own, dst = (None, _ABSENT) if entry is None else entry
            kind = kinds.get(type(dst))
            if kind is None:
                kind = _kind(dst, kinds)
            if dst is _ABSENT or kind == 1 or (kind == 2 and dst):
                unexpected.append((node, key))
            else:
                pairs.append(((node, key), value, place, own, dst))
        # every target leaf matched once (distinct paths match distinct paths): none missing
        self._missing_of = None if len(pairs) == target_leaves else (stored, target)

    def _match_names(self, stored, names: dict, limit: int) -> None:
        self._names = names
        self._trie = None
        self._longest = None
        found: dict = {}  # name -> its pair's index in pairs (a name spelled twice: the last leaf, the first place)
        for node, key, value, place in _leaves(stored, "state dict", limit, self._descend, self):
            name = self._name_at(place, key)
            if name is None:
                self.unexpected.append((node, key))
                continue
            pair = (name, value, None, None, names[name])
            at = found.get(name)
            if at is None:
                found[name] = len(self.pairs)
                self.pairs.append(pair)
            else:
                self.pairs[at] = pair
        self._missing_of = None if len(found) == len(names) else found

    # places in a module's names: self (the top level, where a leaf's key is its name), or a trie node

    def _descend(self, place, key):
        if place is self:
            if self._trie is None:
                self._trie = {}
                for name in self._names:
                    node = self._trie
                    for part in name.split("."):
                        node = node.setdefault(part, {})
                    node[_NAME] = name
            place = self._trie
        text = self._text(key)
        if text is None:
            return None
        start = 0
        while True:  # part by part, stopping at the first no name has: never more of the key than names hold
            dot = text.find(".", start)
            place = place.get(text[start:] if dot < 0 else text[start:dot])
            if place is None or dot < 0:
                return place
            start = dot + 1

    def _name_at(self, place, key) -> Optional[str]:
        if place is None:
            return None
        if place is self:
            text = self._text(key)
            return text if text is not None and text in self._names else None
        place = self._descend(place, key)
        return None if place is None else place.get(_NAME)

    def _text(self, key) -> Optional[str]:
        """str(key), or None where it is longer than every name (so never made)."""
        if type(key) is str:
            return key
        if self._longest is None:
            self._longest = max(map(len, self._names), default=0)
        return str(key) if _str_length(key, {}) <= self._longest else None

    def missing(self) -> list:
        """The target's unmatched paths (nodes, or a module's names), in its order."""
        if self._missing_of is None:
            return []
        if isinstance(self._missing_of, dict):
            return [name for name in self._names if name not in self._missing_of]
        stored, target = self._missing_of
        missing = []
        for node, key, _, place in _leaves(target, "target", None, self._enter, stored):
            entry = None if place is None else self._entry(place, key)
            if entry is None or _is_branch(entry[1], self._kinds):
                missing.append((node, key))
        return missing


def _holds_tensors(value, known: Optional[dict] = None) -> bool:
    """A value that load_into would have to rebuild rather than fill in
    place. known: {id: answer} for containers already looked at, shared
    across calls (a container shared at every level is looked at once)."""
    import torch

    if isinstance(value, (torch.Tensor, StoredTensor, StoredStorage, torch.storage.TypedStorage, torch.UntypedStorage)):
        return True  # storages too: the layout's hold no data
    if not isinstance(value, (tuple, list, set, frozenset, Mapping)):
        return False
    known = {} if known is None else known
    answer = known.get(id(value))
    if answer is None:
        known[id(value)] = False  # a cycle holds what its other items hold
        items = value.values() if isinstance(value, Mapping) else value
        answer = known[id(value)] = any(_holds_tensors(v, known) for v in items)
    return answer


class _Plan:
    def __init__(self, target, swap: bool):
        self.target = target
        self.swap = swap   # the file's byte order is not this machine's: stage and swap everything
        self.direct = []   # (file offset, nbytes, destination tensor)
        self.staged = []   # (file offset of the storage, storage nbytes, StoredTensor, destination tensor)
        self.values = []   # (target container, key, value) for non-tensor leaves of a dict target
        self.loaded = []   # (CPU tensor loaded by torch, destination tensor): copied
        self.missing: list = []
        self.unexpected: list = []

    def execute(self, image: _CheckpointImage, verify: bool, ahead: Optional[_DataAhead] = None,
                reader: Optional[TorchArchiveReader] = None) -> bool:
        """Reads every tensor into its destination; False, with nothing
        written, where the places ``ahead`` (the data's read, begun before
        the layout's guesses were checked) read from proved wrong."""
        import torch

        temporaries = {}  # one per stored storage, however many tensors view it
        for offset, nbytes, _, dst in self.staged:
            if (offset, nbytes) not in temporaries:
                # beside its destination (a GPU's tensors need no host copy), unless bytes are swapped on the host
                device = "cpu" if self.swap else dst.device
                temporaries[offset, nbytes] = torch.empty(nbytes, dtype=torch.uint8, device=device)
        early = ahead is not None and ahead.unchecked
        if early:
            # the local headers, asked for ahead of the data, say whether the guesses hold before a tensor is written
            if not reader.predictions_hold():
                return False
            if not ahead.pull.covers([(offset, nbytes) for offset, nbytes, _ in self.direct] + list(temporaries)):
                ahead.close()  # a record reaching past the next one's header: read the usual way
                early = False
            elif device_io.takes_direct(self._pieces(temporaries), image.options.transfer,
                                        image.options.allow_gds_compat):
                ahead.close()  # GPUDirect Storage reads the large GPU tensors: the buffers need not read them too
                early = False
        if early:  # the engine has been reading since the layout began
            try:
                checksums = ahead.pull.deliver(self._pieces(temporaries), verify, image.options.transfer,
                                               image.options.allow_gds_compat)
            except EOFError:
                raise CheckpointError(f"{image.path}: the file ended early while reading tensors "
                                      "(did it shrink while being read?)") from None
            finally:
                ahead.close()
        elif STREAM_LOADS or any(dst.device.type != "cpu" for _, _, dst in self.direct) or any(
                t.device.type != "cpu" for t in temporaries.values()):
            # one pass through the engine's buffers, copied to each tensor's device
            checksums = self._read(image, self._pieces(temporaries), verify, through_buffers=True)
        else:
            extents = [(dst.data_ptr(), offset, nbytes) for offset, nbytes, dst in self.direct]
            extents += [(tmp.data_ptr(), offset, nbytes) for (offset, nbytes), tmp in temporaries.items()]
            checksums = self._read(image, extents, verify)
        with torch.no_grad():
            # A storage is swapped by its dtype; torch.load swaps each key's copy by the dtype the key
            # is first read as (the layout gives later references that one): a record read under two
            # keys as different dtypes needs a copy swapped each way.
            swap_dtypes: dict = {}  # (offset, nbytes) -> {dtype}
            for offset, nbytes, meta, _ in self.staged if self.swap else ():
                swap_dtypes.setdefault((offset, nbytes), set()).add(meta.dtype)
            swapped: dict = {}  # (offset, nbytes, dtype) -> the storage in this machine's byte order
            for offset, nbytes, meta, dst in self.staged:
                storage = temporaries[offset, nbytes].untyped_storage()
                if self.swap:
                    in_order = swapped.get((offset, nbytes, meta.dtype))
                    if in_order is None:
                        in_order = storage if len(swap_dtypes[offset, nbytes]) == 1 else storage.clone()
                        in_order.byteswap(meta.dtype)
                        swapped[offset, nbytes, meta.dtype] = in_order
                    storage = in_order
                view = torch.empty(0, dtype=meta.dtype, device=storage.device).set_(
                    storage, meta.storage_offset, meta.shape, meta.stride)
                if meta.metadata:  # neg/conj bits: copy_ resolves them, as load_state_dict(torch.load(...)) does
                    _torch_api.set_tensor_metadata(view, meta.metadata)
                dst.copy_(view)
            for _, _, dst in self.direct:
                if dst.dtype == torch.bool:  # the file's bytes as copy_ takes them: any but 0 is True (1)
                    dst.view(torch.uint8).ne_(0)
                torch.autograd.graph.increment_version(dst)  # like an in-place copy_
            for value, dst in self.loaded:
                dst.copy_(value)
        for container, key, value in self.values:
            container[key] = value
        if verify:
            image.verify_records(checksums, ", and the tensors read from it hold its corrupt bytes")
        return True

    def _pieces(self, temporaries: dict) -> list:
        """What the engine's buffers are copied into: each direct destination (a CUDA one as bytes), each temporary."""
        pieces = [device_io.Piece(offset, nbytes, dst if dst.device.type == "cpu" else _bytes_of(dst))
                  for offset, nbytes, dst in self.direct]
        return pieces + [device_io.Piece(offset, nbytes, tmp) for (offset, nbytes), tmp in temporaries.items()]

    @staticmethod
    def _read(image: _CheckpointImage, extents: list, checksums: bool, through_buffers: bool = False) -> dict:
        """Reads (address, offset, nbytes) extents in passes of non-overlapping
        ones (tied tensors share file bytes), or device_io pieces in one pass
        through the engine's buffers; returns {(offset, nbytes): crc} with
        checksums."""
        try:
            if through_buffers:
                return read_pipeline.read_pieces(image.fd, image.path, image.size, image.options, extents, checksums)
            if image.view is not None:  # the file is in memory (see _fill)
                return image.copy_extents(extents, checksums)
            return image.read_extents(extents, checksums, fresh=True)  # a model built on meta: fresh memory
        except EOFError:
            raise CheckpointError(f"{image.path}: the file ended early while reading tensors "
                                  "(did it shrink while being read?)") from None


def _bytes_of(tensor):
    """A contiguous tensor's bytes as a 1-D uint8 tensor, on its device."""
    start = tensor.storage_offset() * tensor.element_size()
    return device_io.byte_view(tensor.untyped_storage())[start:start + tensor.numel() * tensor.element_size()]


def _file_byte_order(image: _CheckpointImage) -> str:
    if "byteorder" not in image.index.records:
        return "little"  # torch's default for files without the record
    reader = TorchArchiveReader(image.index, image.read_at, source=image.path)
    return reader.get_record("byteorder").decode("ascii", "replace")


# The names load_into reports (missing and unexpected keys, the keys of errors) take at most this
# many characters, and this many more per byte of the pickle: a state dict's names take about as
# many as its pickle, or a few times that (a key spelled once names it at every level below).
KEY_NAME_CHARS = 16 << 20
KEY_NAME_CHARS_PER_PICKLE_BYTE = 16


def _plan(image: _CheckpointImage, match: _Match, strict: bool, is_module: bool,
          target_obj, records_at: dict, mapped=None) -> _Plan:
    """Matches stored leaves to target leaves; raises on any mismatch before
    anything is written. records_at: {data offset: record} of the records
    the layout located (or guessed where); mapped: the mapping of the file
    _loaded_layout's tensors lie in (see _placed)."""
    import torch

    plan = _Plan(target_obj, swap=_file_byte_order(image) != sys.byteorder)
    missing = match.missing()
    errors = []  # (text before the key, key path, text after it)
    looked_at: dict = {}  # _holds_tensors' answers by container id
    for path, value, container, own_key, dst in match.pairs:
        layout = torch.strided
        if isinstance(value, torch.Tensor):  # a tensor of torch's own layout (_loaded_layout)
            layout = value.layout
            if layout == torch.strided and not value.is_quantized:
                value = StoredTensor.of(value) if value.is_meta else _placed(value, mapped, plan.swap)
        if not isinstance(value, (StoredTensor, torch.Tensor)):
            if isinstance(dst, torch.Tensor):
                stored_type = "TypedStorage" if type(value) is StoredStorage else type(value).__name__
                errors.append(('"', path, f'" is a tensor in the target but a {stored_type} in the checkpoint.'))
            elif isinstance(value, (StoredStorage, torch.storage.TypedStorage, torch.UntypedStorage)):
                # the layout's storages hold no data: storing one would lose it
                errors.append(('"', path, '" is a storage; load_into restores tensors (use fastpersist.load).'))
            elif is_module:
                errors.append(('"', path, f'" holds a {type(value).__name__}, not a tensor; load_into restores '
                              "tensors (use load_state_dict for modules with extra state)."))
            elif _holds_tensors(value, looked_at):
                # the layout pass sees its tensors as meta tensors: storing it would lose their data
                errors.append(('"', path, f'" is a {type(value).__name__} holding tensors; load_into restores tensors '
                              "in dicts and lists (use fastpersist.load for other containers)."))
            else:
                plan.values.append((container, own_key, value))
            continue
        if not isinstance(dst, torch.Tensor):
            errors.append(('"', path, f'" is a tensor in the checkpoint but a {type(dst).__name__} in the target.'))
            continue
        if value.shape != dst.shape:
            errors.append(("size mismatch for ", path, f": copying a param with shape {torch.Size(value.shape)} from "
                          f"checkpoint, the shape in current model is {dst.shape}."))
            continue
        if value.dtype != dst.dtype:
            errors.append(("dtype mismatch for ", path, f": the checkpoint holds {value.dtype}, the target {dst.dtype}."))
            continue
        if type(value) is not StoredTensor or dst.layout != torch.strided or dst.is_quantized:
            if isinstance(value, torch.Tensor) and value.layout == torch.strided and not value.is_quantized \
                    and not value.is_meta \
                    and dst.layout == torch.strided and not dst.is_quantized:
                plan.loaded.append((value, dst))  # loaded by torch, bytes not the file's: copied from
                continue
            errors.append(("", path, f": load_into restores dense tensors; this one is {layout}."))
            continue
        numel = value.numel()
        if numel == 0:
            continue
        offset, storage_nbytes = value.storage_offset_in_file, value.storage_nbytes
        record = records_at.get(offset)
        if record is None:
            raise CheckpointError(f"{image.path}: the tensor '{_shown(path)}' points at offset {offset}, "
                                  "where no record starts")
        item = value.element_size
        needed = value.view_end()
        if storage_nbytes != record.size or needed > storage_nbytes or value.storage_offset < 0:
            # torch.load checks the first too; the second guards the pickle's view of the storage
            raise CheckpointError(f"{image.path}: the tensor '{_shown(path)}' needs {max(needed, storage_nbytes)} bytes "
                                  f"of record '{record.name}', which holds {record.size}; the file is corrupt")
        if (value.is_contiguous() and dst.is_contiguous() and (dst.is_cpu or dst.is_cuda) and not plan.swap
                and not value.metadata):  # bytes read through neg/conj bits: staged
            start = offset + value.storage_offset * item
            plan.direct.append((start, numel * item, dst))
        else:
            plan.staged.append((offset, storage_nbytes, value, dst))
    names = _KeyNames(KEY_NAME_CHARS + KEY_NAME_CHARS_PER_PICKLE_BYTE * image.pickle_size())
    if errors or (strict and (missing or match.unexpected)):
        lines = []
        if strict:
            for what, paths in (("Missing", missing), ("Unexpected", match.unexpected)):
                if paths:
                    listed = _names_within(paths, names)
                    rest = "" if len(listed) == len(paths) else (
                        f"{', ' if listed else ''}and {len(paths) - len(listed):,} more, whose names would take more "
                        f"than the {names.budget:,} characters load_into reports for this file")
                    # one copy of the names (a list of quoted names, then their join, took two)
                    lines.append("".join([f"{what} key(s) in state_dict: ", '"' if listed else "", '", "'.join(listed),
                                          '"' if listed else "", rest, "."]))
                    del listed
        for done, (before, path, after) in enumerate(errors):
            name = names.name(path)
            if name is None:
                lines.append(f"and {len(errors) - done:,} more error(s), whose keys' names would take more than the "
                             f"{names.budget:,} characters load_into reports for this file.")
                break
            lines.append(before + name + after)
        lines.insert(0, f"Error(s) in loading state_dict for {type(target_obj).__name__} from {image.path}:")
        raise RuntimeError("\n\t".join(lines))
    plan.missing = _names_within(missing, names)
    plan.unexpected = _names_within(match.unexpected, names)
    if len(plan.missing) < len(missing) or len(plan.unexpected) < len(match.unexpected):
        raise CheckpointError(f"{image.path}: the names of its {len(missing):,} missing and "
                              f"{len(match.unexpected):,} unexpected keys take more than the {names.budget:,} "
                              "characters load_into reports for a pickle of its size (its keys join into names far "
                              "longer than the file): load it with fastpersist.load")
    return plan


def _names_within(paths: list, names: "_KeyNames") -> list:
    """The names of paths, up to the first that does not fit what names has left."""
    shown = []
    for path in paths:
        name = names.name(path)
        if name is None:
            break
        shown.append(name)
    return shown




def release_load_memory() -> None:
    """Gives back now what loads keep for the next one: the memory of freed
    fastpersist.load results (kept at most ``load_memory_seconds``) and the
    staging buffers of loads to a GPU from the page cache (page-locked,
    at most the engine's ``buffer_size * num_buffers`` per concurrent load)."""
    load_memory.release_load_memory()
    device_io.staging_buffers.release()


__all__ = ["IncompatibleKeys", "load", "load_into", "release_load_memory"]
