"""Every use of torch's private serialization API, in one place, so that a
torch upgrade touches this file alone (checked against torch 2.13).

Also torch's own ``save`` and ``load`` as they were before fastpersist
routed them (``patching`` swaps the public names; the source patch in
``patches/`` keeps torch's body as ``_fastpersist_vanilla_save``).
"""
from __future__ import annotations

import collections
import io
import pickle
import re
import sys
import types
from typing import Callable, Optional

import torch
import torch.serialization as _ts

from . import _state_pickle

DEFAULT_PROTOCOL: int = _ts.DEFAULT_PROTOCOL


def _unwrapped(func: Callable) -> Callable:
    # fastpersist's wrappers carry __fastpersist__ and functools.wraps' __wrapped__
    return func.__wrapped__ if getattr(func, "__fastpersist__", False) else func


_original_save: Callable = _unwrapped(getattr(_ts, "_fastpersist_vanilla_save", _ts.save))
_original_load: Callable = _unwrapped(_ts.load)


def original_save() -> Callable:
    """torch.save as it was before fastpersist routed it."""
    return _original_save


def original_load() -> Callable:
    """torch.load as it was before fastpersist routed it."""
    return _original_load


def source_patch_applied() -> bool:
    return hasattr(_ts, "_fastpersist_vanilla_save")


# -- saving -------------------------------------------------------------------

def log_api_usage(name: str) -> None:
    torch._C._log_api_usage_once(name)


def check_dill_version(pickle_module) -> None:
    _ts._check_dill_version(pickle_module)


def pickle_into(obj, zip_writer, pickle_module, pickle_protocol: int, disable_byteorder_record: bool,
                capture: bool = True) -> Optional[dict]:
    """torch's own pickling: zip_writer stands in for PyTorchFileWriter.

    Returns the storages torch's pickling met, by storage key ("0", "1",
    ...; record ``data/<key>``), captured as they are, on their device:
    torch's ``_save`` would copy each device storage to fresh host memory
    before handing it to the zip writer, and the plan would hold every such
    copy until it is written. Captured, torch hands over nothing: ``_save``
    runs with its ``skip_data`` flag (which makes it call
    ``write_record_metadata`` for each storage) and a Pickler that notes the
    storage behind each key its ``persistent_id`` returns. The pickle and
    the records are torch's, byte for byte.

    Returns None where torch's own path ran: capture=False; nothing to
    gain (every tensor on the CPU, whose storages torch hands over without
    a copy); an object that is not plain data (see _worth_capturing); the
    caller set ``skip_data`` itself; a fake mode is active; or a tensor
    that pickles differently under ``skip_data`` (meta, quantized, nested,
    storage-less backends such as XLA)."""
    if capture and _capture_applies() and (CAPTURE == "always" or (CAPTURE == "auto" and _accelerator_initialized() and _worth_capturing(obj))):
        tls = _ts._serialization_tls
        capture = _StorageCapture(pickle_module)
        tls.skip_data = True
        try:
            _ts._save(obj, zip_writer, capture, pickle_protocol, disable_byteorder_record)
            return capture.storages
        except _NotCapturable:
            zip_writer.records.clear()
        finally:
            tls.skip_data = False
    if pickle_module.Pickler is pickle.Pickler:
        pickle_module = _QUICK_PICKLE
    _ts._save(obj, zip_writer, pickle_module, pickle_protocol, disable_byteorder_record)
    return None


# Types whose objects torch's persistent_id always answers None for: neither
# a TypedStorage nor one of torch's storage classes. CPython's pickler asks
# persistent_id about every object it meets (~23 times per tensor of a state
# dict: ints, strings, tuples, the rebuild function, the storage's class),
# and torch's answers through three Python calls; a state dict's pickling
# takes ~15% less time when these are answered by one set lookup.
_NEVER_STORAGES = frozenset((int, float, bool, str, bytes, type(None), complex, tuple, list, dict,
                             collections.OrderedDict, type, types.FunctionType, types.BuiltinFunctionType,
                             type(torch.FloatStorage), torch.Tensor, torch.nn.Parameter, torch.Size,
                             torch.dtype, torch.device, torch.layout, torch.memory_format))


def _quick_persistent_ids(base: type, on_storage_id: Optional[Callable] = None) -> type:
    """A Pickler class to hand torch's _save (which subclasses it and gives
    the subclass its persistent_id): the subclass's persistent_id is wrapped
    so objects of the types above skip it, with the same answer (None). For
    every other object torch's runs as before; on_storage_id(obj, pid) sees
    each storage id it returns."""

    class QuickIdPickler(base):
        def __init_subclass__(cls, **kwargs):
            super().__init_subclass__(**kwargs)
            theirs = cls.persistent_id

            def persistent_id(self, obj, _never=_NEVER_STORAGES):
                if type(obj) in _never:
                    return None
                pid = theirs(self, obj)
                if on_storage_id is not None and pid is not None:
                    on_storage_id(obj, pid)
                return pid

            cls.persistent_id = persistent_id

    return QuickIdPickler


class _QuickPickleModule:
    """The stdlib pickle module as torch's _save uses it (only its Pickler),
    with quick persistent ids."""

    Pickler = _quick_persistent_ids(pickle.Pickler)


_QUICK_PICKLE = _QuickPickleModule()


def stream_save_applies() -> bool:
    """Whether a save to a file object may be planned and written by
    fastpersist: not under skip_data (torch then seeks over the storages'
    bytes) or a fake mode (storages without memory)."""
    return _capture_applies()


def _capture_applies() -> bool:
    return (not _ts._serialization_tls.skip_data and not _ts._serialization_tls.materialize_fake_tensors
            and torch._guards.detect_fake_mode(None) is None)


# "auto": capture plain data holding a tensor off the CPU; "always" and "never": tests
# (capture's wrapped persistent_id costs ~7% of planning: not paid where it gains nothing)
CAPTURE = "auto"


def _accelerator_initialized() -> bool:
    """Whether this process has started CUDA (or XPU): without that it holds
    no device tensor, and a CPU save skips the walk below (0.5-2.5 ms for a
    model's and its optimizer's state)."""
    xpu = getattr(torch, "xpu", None)
    return torch.cuda.is_initialized() or bool(xpu is not None and xpu.is_initialized())


def _worth_capturing(obj, budget: int = 100_000) -> bool:
    """True where a walk of obj finds a tensor off the CPU and nothing but
    plain data: dicts, lists and tuples (values, not keys), numbers and
    strings, dtypes, and tensors and Parameters of torch's own classes.

    Capture sets torch's skip_data flag for the pickling thread, and any code
    pickling runs (a custom class's __reduce__ or __getstate__, a tensor
    subclass's __reduce_ex__) would see it: a torch.load or torch.save in
    there would skip its data. So any other object, or a walk too long to
    finish, keeps torch's own path."""
    seen, stack, off_cpu = set(), [obj], False
    while stack:
        budget -= 1
        if budget < 0:
            return False
        node = stack.pop()
        kind = type(node)
        if kind in _PLAIN_TYPES:
            continue
        if kind is torch.Tensor or kind is torch.nn.Parameter:
            off_cpu = off_cpu or node.device.type != "cpu"
        elif kind in _CONTAINER_TYPES:
            if id(node) not in seen:
                seen.add(id(node))
                stack.extend(node.values() if isinstance(node, dict) else node)
        else:
            return False
    return off_cpu


_CONTAINER_TYPES = frozenset((dict, collections.OrderedDict, collections.defaultdict, list, tuple))
_PLAIN_TYPES = frozenset((int, float, bool, str, bytes, type(None), complex, torch.dtype, torch.Size))


class _NotCapturable(Exception):
    """A tensor that torch pickles differently under skip_data: torch's own path pickles the object."""


class _StorageCapture:
    """The pickle_module handed to torch's _save while capturing: its
    Pickler is the caller's, with two hooks put on the subclass _save
    defines (torch's persistent_id is a method of that subclass)."""

    def __init__(self, pickle_module):
        storages: dict = {}
        self.storages = storages

        def note(obj, pid):
            if type(pid) is tuple and pid[0] == "storage":
                storages[pid[2]] = obj._untyped_storage if isinstance(obj, torch.storage.TypedStorage) else obj

        class CapturingPickler(_quick_persistent_ids(pickle_module.Pickler, note)):
            def reducer_override(self, obj):
                # runs before a tensor's __reduce_ex__ (CPython calls it for
                # every object that is not a builtin container or atom)
                if isinstance(obj, torch.Tensor) and _pickles_differently_without_data(obj):
                    raise _NotCapturable(obj.device.type)
                return NotImplemented

        self.Pickler = CapturingPickler


def _pickles_differently_without_data(tensor) -> bool:
    """Tensors whose __reduce_ex__ raises, warns or changes under skip_data (torch 2.13's _tensor.py)."""
    if type(tensor) is not torch.Tensor and not isinstance(tensor, torch.nn.Parameter):
        from torch._subclasses.fake_tensor import FakeTensor

        if isinstance(tensor, FakeTensor):
            return True
    return (tensor.device.type in ("xla", "maia", "mtia", "meta", torch._C._get_privateuse1_backend_name())
            or tensor.is_quantized or tensor.is_nested)


def save_settings() -> tuple[bool, int]:
    """torch's compute_crc32 and storage_alignment settings."""
    from torch.utils.serialization import config

    return bool(config.save.compute_crc32), int(config.save.storage_alignment)


def empty_archive_from_torch() -> bytes:
    """An archive written by torch's own zip writer with no records of ours."""
    buf = io.BytesIO()
    writer = torch._C.PyTorchFileWriter(buf)
    writer.write_end_of_file()
    return buf.getvalue()


# -- loading ------------------------------------------------------------------

def unpickle_from(zip_reader, map_location, unpickler, **pickle_load_args):
    """torch's own unpickling: zip_reader stands in for PyTorchFileReader."""
    return _ts._load(zip_reader, map_location, unpickler, **pickle_load_args)


def unpickle_weights_only(zip_reader, map_location, *, unpickling=None, **pickle_load_args):
    """torch.load(weights_only=True)'s unpickling: torch's own, or the same
    result faster where the pickle is a plain state dict.

    torch's weights-only unpickler interprets the pickle in Python (0.016 s
    for GPT-2's 269 tensors here, against 0.006 s for CPython's C unpickler
    with the globals below). The C unpickler goes first; any global outside
    the few a plain state dict uses, a protocol other than torch's 2, or
    any error hands the whole pickle to torch's unpickler, which then allows
    or refuses it (and words its refusal) as torch.load does.

    Only where zip_reader checks the pickle against its CRC-32: the C
    unpickler takes opcodes torch's refuses, so a damaged pickle that torch
    would refuse could load. A file saved without CRCs goes to torch's
    unpickler alone.

    unpickling, if given, wraps each pickle module used."""
    plain, theirs = _PlainStateUnpickling, _ts._weights_only_unpickler
    if unpickling is not None:
        plain, theirs = unpickling(plain), unpickling(theirs)
    if not getattr(zip_reader, "records_checked", False):
        return _ts._load(zip_reader, map_location, theirs, **pickle_load_args)
    try:
        return _ts._load(zip_reader, map_location, plain, **pickle_load_args)
    except Exception:
        return _ts._load(zip_reader, map_location, theirs, **pickle_load_args)


class _PlainStateUnpickler(pickle.Unpickler):
    """CPython's C unpickler, allowed only globals that torch's weights-only
    unpickler allows too, and that a state dict of dense tensors needs.
    torch's _load resolves storage classes itself, before find_class.

    No object can be built but from these: the C unpickler reaches every
    class and function through find_class (GLOBAL, STACK_GLOBAL, INST, OBJ
    and the extension registry alike), and REDUCE, NEWOBJ and BUILD act only
    on what is on the stack. tests/test_load.py checks that torch still
    allows each of them."""

    def __init__(self, file, *, encoding: str = "bytes"):  # the signature of torch's weights-only Unpickler
        # Restricting globals is not enough: the C unpickler runs opcodes
        # and object operations torch's refuses (BUILD on a function sets its
        # __defaults__ for the whole process). Only a pickle shaped as
        # torch.save writes state dicts goes on; see _state_pickle.
        pickled = file.getvalue() if isinstance(file, io.BytesIO) else file.read()
        if not _state_pickle.admits(pickled):
            raise _NeedsTorchUnpickler("not a state dict pickle the C unpickler may take")
        file.seek(0)
        super().__init__(file, encoding=encoding)

    def find_class(self, module: str, name: str):
        found = PLAIN_STATE_GLOBALS.get((module, name))
        if found is None:
            raise _NeedsTorchUnpickler(f"{module}.{name}")
        return found

    def __init_subclass__(cls, **kwargs):
        """torch's _load subclasses this and resolves any global whose name
        holds "Storage" from the name alone, module ignored; torch's
        weights-only unpickler allows only the real storage classes. The same
        rule here, before torch's find_class, so that a pickle whose storage
        global is damaged goes to torch's unpickler and fails there too."""
        super().__init_subclass__(**kwargs)
        theirs = cls.find_class

        def find_class(self, module, name):
            if isinstance(name, str) and "Storage" in name and (module, name) not in _STORAGE_GLOBALS:
                raise _NeedsTorchUnpickler(f"{module}.{name}")
            return theirs(self, module, name)

        cls.find_class = find_class


class _NeedsTorchUnpickler(pickle.UnpicklingError):
    pass


class _PlainStateWithStorages(_PlainStateUnpickler):
    """_PlainStateUnpickler resolving the storage classes as torch's _load
    does (to StorageType), for unpickle_plain_state, which runs without _load,
    and building tensors with _rebuild_plain_tensor."""

    def find_class(self, module: str, name: str):
        if (module, name) in _STORAGE_GLOBALS:
            return _ts.StorageType(name)
        if (module, name) == ("torch._utils", "_rebuild_tensor_v2"):
            return _rebuild_plain_tensor
        return super().find_class(module, name)


_element_sizes: dict = {}


def _rebuild_plain_tensor(storage, storage_offset, size, stride, requires_grad, backward_hooks, metadata=None):
    """torch._utils._rebuild_tensor_v2 for unpickle_plain_state, which makes
    sure no fake mode is active before it unpickles: torch's looks for one
    after every tensor (half of a small tensor's load time)."""
    untyped = storage._untyped_storage
    tensor = torch.empty((0,), dtype=storage.dtype, device=untyped.device).set_(untyped, storage_offset, size, stride)
    tensor.requires_grad = requires_grad
    if metadata:
        torch._utils.set_tensor_metadata(tensor, metadata)
    tensor._backward_hooks = backward_hooks  # as torch's: an empty OrderedDict, not None
    return tensor


class NotPlainState(Exception):
    """unpickle_plain_state does not apply: torch's own _load must run."""


class StoredStorage:
    """A storage of a checkpoint as load_into's layout sees it: its dtype,
    element size, where its data starts in the file and its bytes."""

    __slots__ = ("dtype", "element_size", "offset", "nbytes")

    def __init__(self, dtype, element_size: int, offset: int, nbytes: int):
        self.dtype, self.element_size, self.offset, self.nbytes = dtype, element_size, offset, nbytes


class StoredTensor:
    """A dense tensor of a checkpoint as load_into's plan needs it, without
    building it: dtype, shape, stride, storage offset (elements), the
    neg/conj bits it is read through, and its storage's place in the file
    (``storage_offset_in_file``; None where unknown) and size."""

    __slots__ = ("dtype", "shape", "stride", "storage_offset", "metadata", "element_size", "storage_offset_in_file",
                 "storage_nbytes")

    @classmethod
    def of(cls, tensor) -> "StoredTensor":
        """The fields of a meta tensor a layout built (torch's own unpickling)."""
        stored = cls.__new__(cls)
        storage = tensor.untyped_storage()
        stored.dtype, stored.shape, stored.stride = tensor.dtype, tuple(tensor.shape), tuple(tensor.stride())
        stored.storage_offset, stored.metadata = tensor.storage_offset(), tensor_metadata(tensor)
        stored.element_size = tensor.element_size()
        stored.storage_offset_in_file, stored.storage_nbytes = checkpoint_offset(storage), storage.nbytes()
        return stored

    def numel(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n

    def is_contiguous(self) -> bool:
        """As Tensor.is_contiguous(): row-major, strides of size-1 dimensions not counted."""
        expected = 1
        for size, stride in zip(reversed(self.shape), reversed(self.stride)):
            if size == 0:
                return True
            if size != 1:
                if stride != expected:
                    return False
                expected *= size
        return True

    def view_end(self) -> int:
        """Bytes from its storage's start to the end of its view (numel > 0)."""
        last = self.storage_offset + sum((s - 1) * st for s, st in zip(self.shape, self.stride))
        return (last + 1) * self.element_size


_QUANTIZED_DTYPES = frozenset(getattr(torch, name) for name in ("qint8", "quint8", "qint32", "quint4x2", "quint2x4")
                              if hasattr(torch, name))


_INT64_LIMIT = 1 << 63


def _is_dims(values) -> bool:
    return type(values) is tuple and all(type(v) is int and 0 <= v < _INT64_LIMIT for v in values)


def _may_require_grad(dtype, requires_grad: bool) -> bool:
    return not requires_grad or dtype.is_floating_point or dtype.is_complex  # torch refuses the others


def _stored_tensor(storage, storage_offset, size, stride, requires_grad, backward_hooks, metadata=None):
    """_rebuild_tensor_v2's arguments as a StoredTensor, checked as set_ and
    torch's rebuild would check them; anything else, or anything torch would
    refuse (an integer tensor requiring grad, a value past int64), raises
    NotPlainState: torch's own layout decides, and words the error."""
    if type(storage) is not StoredStorage or type(storage_offset) is not int \
            or not 0 <= storage_offset < _INT64_LIMIT or not _is_dims(size) or not _is_dims(stride) \
            or len(size) != len(stride) or type(requires_grad) is not bool \
            or not _may_require_grad(storage.dtype, requires_grad) or not (metadata is None or type(metadata) is dict):
        raise NotPlainState("tensor arguments")
    if metadata and (set(metadata) - {"conj", "neg"} or any(type(v) is not bool for v in metadata.values())):
        raise NotPlainState("tensor metadata")
    # within its storage, as set_ checks every tensor of the pickle, restored or not (a view past its
    # record, then replaced by a duplicate key, makes torch refuse the file): the bytes to the end of the
    # view, none where a dimension is empty (torch's computeStorageNbytes)
    end = storage_offset + 1
    for n, step in zip(size, stride):
        if not n:
            end = 0
            break
        end += (n - 1) * step
    if end * storage.element_size > storage.nbytes:
        raise NotPlainState("a view past its storage")
    stored = StoredTensor.__new__(StoredTensor)
    stored.dtype, stored.shape, stored.stride, stored.storage_offset = storage.dtype, size, stride, storage_offset
    stored.metadata, stored.element_size = metadata or {}, storage.element_size
    stored.storage_offset_in_file, stored.storage_nbytes = storage.offset, storage.nbytes
    return stored


def _stored_parameter(data, requires_grad, backward_hooks):
    """_rebuild_parameter (its three arguments) for the layout: load_into fills
    the target's own Parameter."""
    if type(data) is not StoredTensor or type(requires_grad) is not bool \
            or not _may_require_grad(data.dtype, requires_grad):
        raise NotPlainState("parameter arguments")
    return data


class _PlainLayoutUnpickler(_PlainStateWithStorages):
    """_PlainStateWithStorages building StoredTensors (unpickle_plain_state(layout=True))."""

    def find_class(self, module: str, name: str):
        if module == "torch._utils":
            if name == "_rebuild_tensor_v2":
                return _stored_tensor
            if name == "_rebuild_parameter":
                return _stored_parameter
        return super().find_class(module, name)


def _is_cpu_or_meta(map_location) -> bool:
    if map_location is None:
        return True
    if not isinstance(map_location, (str, torch.device)):
        return False
    device = torch.device(map_location)
    return device.type in ("cpu", "meta") and device.index is None


def unpickle_plain_state(zip_reader, storage_for, map_location, *, encoding: str = "utf-8", layout: bool = False):
    """What torch's _load returns for a plain state dict of CPU tensors, built
    without its per-storage machinery (fake-mode checks, the restore-location
    walk, its reader calls): 1.8 ms instead of 3.2 ms for 110 tensors here.

    Tensors are still built by torch's _rebuild_tensor_v2 and
    _rebuild_parameter over TypedStorages made as _load makes them; nothing
    reads tensor data, so the caller may still be reading it into the
    storages storage_for(key, nbytes, storage_alignment) returns (slices of
    one file image; for map_location "meta", meta storages that say where
    their data is, as torch's meta loads do). The caller logs what _load logs
    at its end (log_load_metadata), once the serialization id can be read
    cheaply.
    Raises NotPlainState, before any data is needed, wherever torch's path
    must decide: a global outside PLAIN_STATE_GLOBALS and the storage
    classes, a storage saved from another device or mapped elsewhere, a file
    whose bytes need swapping, a pickle torch's unpickler would word errors
    for. Which unpickler rules apply (weights-only or not) is the caller's
    choice: this one allows only what both allow.

    layout=True (load_into's plan): no tensors at all. Each is a
    StoredTensor, each storage a StoredStorage whose offset is
    storage_for(key, nbytes, storage_alignment), the data's place in the
    file: a meta tensor cost ~10 us to build and ~6 more to ask about."""
    from torch.serialization import LoadEndianness, get_default_load_endianness

    if not _is_cpu_or_meta(map_location):
        raise NotPlainState("map_location")
    if torch._guards.detect_fake_mode(None) is not None:  # torch's rebuild makes fake tensors then
        raise NotPlainState("a fake mode is active")
    # what _load reads before the pickle (each a CRC-checked record here)
    if zip_reader.has_record(".format_version"):
        zip_reader.get_record(".format_version")
    alignment = 64
    if zip_reader.has_record(".storage_alignment"):
        alignment = int(zip_reader.get_record(".storage_alignment"))
    if zip_reader.has_record("byteorder"):
        order = zip_reader.get_record("byteorder").decode("ascii", "replace")
    else:
        endianness = get_default_load_endianness()
        order = "little" if endianness in (None, LoadEndianness.LITTLE) else (
            "big" if endianness == LoadEndianness.BIG else sys.byteorder)
    if order != sys.byteorder:
        raise NotPlainState("byte order")

    storages = {}

    def persistent_load(saved_id):
        if not (isinstance(saved_id, tuple) and len(saved_id) == 5 and saved_id[0] == "storage"):
            raise NotPlainState("persistent id")
        _, storage_type, key, location, numel = saved_id
        if location != "cpu" or type(key) is not str or type(numel) is not int or numel < 0 \
                or not isinstance(storage_type, _ts.StorageType):
            raise NotPlainState("storage")
        typed = storages.get(key)
        if typed is None:
            dtype = storage_type.dtype
            size = _element_sizes.get(dtype)
            if size is None:  # torch's _element_size, remembered (0.5 us a call)
                size = _element_sizes[dtype] = torch._utils._element_size(dtype)
            if layout:
                if dtype in _QUANTIZED_DTYPES:
                    raise NotPlainState("a quantized storage")
                typed = StoredStorage(dtype, size, storage_for(key, numel * size, alignment), numel * size)
            else:
                untyped = storage_for(key, numel * size, alignment)
                typed = torch.storage.TypedStorage(wrap_storage=untyped, dtype=dtype, _internal=True)
            # as _load: empty storages are not shared (they have no data pointer); nor are meta ones there,
            # but a layout must give a key's later references the first's storage (and dtype) as a real load does
            if numel:
                storages[key] = typed
        return typed

    try:
        unpickling = _PlainLayoutUnpickler if layout else _PlainStateWithStorages
        unpickler = unpickling(io.BytesIO(zip_reader.get_record("data.pkl")), encoding=encoding)
        unpickler.persistent_load = persistent_load
        _ts._serialization_tls.map_location = map_location
        try:
            result = unpickler.load()
        finally:
            _ts._serialization_tls.map_location = None
    except NotPlainState:
        raise
    except Exception as exc:  # torch's unpickler decides, and words the error
        raise NotPlainState(repr(exc)) from exc
    torch._utils._validate_loaded_sparse_tensors()
    return result


def restore_target(map_location, location: str) -> str:
    """The location torch.load restores a storage saved at ``location`` to,
    for a map_location that is None, a dict, a str or a torch.device (as
    torch 2.13's _get_restore_location resolves them)."""
    if map_location is None:
        return location
    if isinstance(map_location, dict):
        return map_location.get(location, location)
    return str(map_location)


def cuda_restore_device(location: str):
    """The torch.device a storage restored to ``location`` lands on where
    that is a CUDA device, with torch's own checks and errors (no such
    device, CUDA unavailable); None for any other location."""
    if location == "cuda" or re.match("cuda(:|[0-9]+)", location):
        return _ts._validate_device(location, "cuda")
    return None


# Rebuild functions that read map_location themselves (torch 2.13's
# _utils._get_restore_location): a load that hands torch's _load a
# map_location of its own must not meet them in the pickle.
_READ_MAP_LOCATION = (b"_rebuild_device_tensor_from_cpu_tensor", b"_rebuild_device_tensor_from_numpy",
                      b"_rebuild_wrapper_subclass", b"_rebuild_xla_tensor", b"_restore_device_fake_mode")


def pickle_reads_map_location(pickled: bytes) -> bool:
    return any(name in pickled for name in _READ_MAP_LOCATION)


def log_load_metadata(zip_reader) -> None:
    """What torch's _load logs when it has loaded a file."""
    torch._C._log_api_usage_metadata("torch.load.metadata", {"serialization_id": zip_reader.serialization_id()})


class _PlainStateUnpickling:
    """What torch's _load takes as its pickle_module."""

    Unpickler = _PlainStateUnpickler


PLAIN_STATE_GLOBALS = {
    ("collections", "OrderedDict"): collections.OrderedDict,  # state_dict() and its _metadata
    ("torch._utils", "_rebuild_tensor_v2"): torch._utils._rebuild_tensor_v2,  # every dense tensor
    ("torch._utils", "_rebuild_parameter"): torch._utils._rebuild_parameter,  # nn.Parameter (keep_vars=True)
}


# the storage classes torch's weights-only unpickler allows, by (module, name)
_STORAGE_GLOBALS = frozenset((ts.__module__, ts.__name__) for ts in torch._storage_classes)


def default_to_weights_only(pickle_module) -> bool:
    return _ts._default_to_weights_only(pickle_module)


def lazy_or_meta_load(map_location, mmap) -> bool:
    """Loads that read no tensor data up front: mmap, meta, skip_data, fake tensors."""
    if mmap is None:
        from torch.utils.serialization import config

        mmap = config.load.mmap
    return (bool(mmap) or _ts._is_meta_location(map_location) or _ts._serialization_tls.skip_data
            or torch._guards.detect_fake_mode(None) is not None)


def tensor_metadata(tensor) -> dict:
    """The bits a tensor's data is read through (torch 2.13: ``neg``,
    ``conj``), as torch.save records them; torch.load sets them back."""
    return torch._utils.get_tensor_metadata(tensor)


def set_tensor_metadata(tensor, metadata: dict) -> None:
    torch._utils.set_tensor_metadata(tensor, metadata)


def checkpoint_offset(storage):
    """Where a storage's bytes start in the file, as torch's meta-device load
    records it (``map_location="meta"`` reads no data), or None."""
    return getattr(storage, "_checkpoint_offset", None)


# -- torch.distributed.checkpoint ---------------------------------------------
# fastpersist.dcp writes and reads the files of DCP's FileSystemWriter, so it
# uses the classes DCP pickles into ``.metadata`` and the helpers its own
# filesystem storage uses. Imported lazily: torch.distributed is heavy.

def dcp_filesystem():
    """torch.distributed.checkpoint.filesystem: _StorageInfo (pickled into
    .metadata; the stock reader needs exactly this class), its metadata file
    name, DCP_VERSION and the stock reader (for items fastpersist leaves to it)."""
    import torch.distributed.checkpoint.filesystem as fs

    return fs


def dcp_narrow(tensor, offsets, lengths):
    """The part of a saved tensor a read request asks for (resharding)."""
    from torch.distributed._shard._utils import narrow_tensor_by_index

    return narrow_tensor_by_index(tensor, offsets, lengths)
