"""torch.save's pickle of plain checkpoint data, written without torch's
per-tensor machinery: byte for byte what ``torch.serialization._save``
pickles (CPython's C pickler, protocol 2, torch's persistent ids), at a
few microseconds per tensor instead of ~30.

Plain data is what model and optimizer state dicts and trainer checkpoints
are made of: dicts, OrderedDicts (with attributes such as ``_metadata``),
lists, tuples, None, bools, ints, floats, strings, bytes, ``torch.dtype``,
``torch.device``, ``torch.Size``, and tensors and Parameters of torch's own
classes, strided, on the CPU or a CUDA device, with no Python state, hooks
or conj/neg bits. ``dump`` returns None for anything else, and the caller
runs torch's own pickling, so the file is torch's either way.

Byte identity rests on following the C pickler's rules exactly:

- atoms (None, bools, ints, floats) are never memoized; everything else is
  looked up in the memo by identity first and memoized when first written,
  with indices handed out in order (BINPUT below 256, LONG_BINPUT above);
- exact dicts and lists are written in batches of 1000 (a one-item dict or
  list with SETITEM/APPEND; an exact dict whose size is a multiple of 1000
  ends with an empty batch), OrderedDicts through their ``__reduce__``
  (items from an iterator: a trailing single item gets SETITEM);
- tensors as ``Tensor._reduce_ex_internal`` reduces them, storages as
  torch's ``persistent_id`` names them (keys "0", "1", ... by storage,
  locations "cpu" or a fresh "cuda:N").

Objects torch creates while pickling (argument tuples, sizes, the empty
OrderedDict of hooks) take a memo index but can never be met again; the
strings torch passes by identity ("storage", "cpu") and the classes and
functions it names are looked up in the same memo as the caller's objects,
so a caller's own interned "cpu" is shared exactly where pickle shares it.
tests/test_plain_pickle.py compares every case with torch.save's bytes.
"""
from __future__ import annotations

import collections
import pickle
import struct
import sys
import threading
from typing import Optional

import torch

from . import _torch_api

PROTOCOL = 2
ENABLED = True  # False: torch's pickling for every save (tests, and a way out)
_BATCH = 1000

_pack_u32 = struct.Struct("<I").pack
_pack_i32 = struct.Struct("<i").pack
_pack_u16 = struct.Struct("<H").pack
_pack_double = struct.Struct(">d").pack
_BININT1 = [b"K" + bytes((i,)) for i in range(256)]
_BINPUT = [b"q" + bytes((i,)) for i in range(256)]
_BINGET = [b"h" + bytes((i,)) for i in range(256)]

_Tensor = torch.Tensor
_STRIDED = torch.strided
_Parameter = torch.nn.Parameter
_OrderedDict = collections.OrderedDict
_STORAGE = sys.intern("storage")  # the literal in torch's persistent_id, interned
_CPU = sys.intern("cpu")  # what torch's _cpu_tag returns
_V3_DTYPES = frozenset(torch.storage._new_dtypes())
_STORAGE_CLASSES = {dtype: getattr(torch, name) for dtype, name in torch.storage._dtype_to_storage_type_map().items()}
_REGISTRY = [(priority, tagger) for priority, tagger, _ in torch.serialization._package_registry]
_get_tensor_metadata = torch._C._get_tensor_metadata


def _latin1_is_shared() -> bool:
    """Whether the C pickler's "latin1" (the codec name of a pickled bytes
    object) is the interned string a caller's "latin1" is."""
    # [b"x", "latin1"]: the list 0, encode 1, "x" 2, "latin1" 3: a shared one ends the pickle with BINGET 3
    return pickle.dumps([b"x", sys.intern("latin1")], PROTOCOL).endswith(b"h\x03e.")


_LATIN1 = sys.intern("latin1") if _latin1_is_shared() else None


class Unsupported(Exception):
    """Something ``dump`` does not write as torch would: torch's pickling runs instead."""


def applies(pickle_module, pickle_protocol: int) -> bool:
    """Whether ``dump`` may stand in for torch's pickling of a torch.save call:
    the stdlib pickle at protocol 2, torch's storage locations as shipped,
    and no skip_data, fake mode or fake-tensor materialisation in effect."""
    registry = torch.serialization._package_registry
    return (pickle_module is pickle and pickle_protocol == PROTOCOL and _torch_api._capture_applies()
            and len(registry) == len(_REGISTRY)
            and all(entry[0] == p and entry[1] is t for entry, (p, t) in zip(registry, _REGISTRY)))


class PlainPickle:
    """The pickle ``data.pkl`` and the storages behind it, by key, in the
    order torch writes their records."""

    __slots__ = ("data", "storages")

    def __init__(self, data: bytes, storages: dict):
        self.data = data
        self.storages = storages


def dump(obj) -> Optional[PlainPickle]:
    """torch.save's pickle of obj, or None where obj is not plain data (see
    the module's note) and torch's own pickling must run. A save torch
    would refuse (two tensors viewing the same memory as different dtypes)
    is also None, so that torch raises its own error. Where torch.save's
    pickling could run out of recursion levels, it runs here, as deep in
    the stack as torch.save would run it (``_pickled_by_torch``): its
    RecursionError, or its pickle."""
    if IMPLEMENTATION == "c" and _c is not None:
        try:
            data, storages, depth = _c.dump(obj, _c_context())
        except _c.Unsupported:
            return None
        except RecursionError:
            return _pickled_by_torch(obj)
        plain = PlainPickle(data, storages)
    else:
        writer = _Writer()
        try:
            plain = writer.dump(obj)
        except Unsupported:
            return None
        except RecursionError:
            return _pickled_by_torch(obj)
        depth = writer.max_depth
    if not _has_headroom(2 * depth + HEADROOM_MARGIN):
        return _pickled_by_torch(obj)
    return plain


# Recursion. CPython's pickler enters one recursion level for each object it
# saves but atoms and strings (and a second for an exact dict's or list's
# items), and torch's persistent_id and the reductions of tensors,
# Parameters, sizes and devices run in Python frames below them: a deep
# enough object makes torch.save raise RecursionError, at a depth that
# depends on where it was called and on sys.getrecursionlimit(). The writers
# count containers; where two levels a container and this margin (beyond
# them, a leaf's reduction takes up to 9, measured by
# tests/test_plain_pickle.py) are not free here, deeper in the stack than
# torch.save's pickler would be, torch's own pickling runs instead, as
# deep as torch.save would run it.
HEADROOM_MARGIN = 64


def _has_headroom(n: int) -> bool:
    """Whether n recursion levels are free here (from 3.12 on, C calls and
    Python frames each have their own)."""
    if sys.version_info < (3, 10):
        # a RecursionError there lets the thread overflow its limit (by up to
        # 50) until it climbs back below it: no probing, frames counted
        frames, frame = 0, sys._getframe()
        while frame is not None:
            frames += 1
            frame = frame.f_back
        return sys.getrecursionlimit() - frames >= n + 50
    if _c is not None and _c.headroom(n) < n:
        return False
    if _c is None or sys.version_info >= (3, 12):
        try:
            _descend(n)
        except RecursionError:
            return False
    return True


def _descend(n: int) -> None:
    if n > 0:
        _descend(n - 1)


class _Records:
    """A zip writer for torch's _save that keeps the pickle and the storages."""

    def __init__(self):
        self.data = b""
        self.storages: dict = {}

    def write_record(self, name: str, data, nbytes: int) -> None:
        if name == "data.pkl":
            self.data = bytes(data)
        elif name.startswith("data/"):
            self.storages[name[len("data/"):]] = data

    def write_record_metadata(self, name: str, nbytes: int) -> None:  # skip_data: applies() leaves it to torch
        self.storages[name[len("data/"):]] = None


_limit_lock = threading.RLock()  # one raised limit at a time: each restores the one it found


def _pickled_by_torch(obj) -> Optional[PlainPickle]:
    """torch.save's own pickling of obj (torch.serialization._save, CPython's
    pickler, torch's persistent_id), run with the recursion limit raised by
    the frames fastpersist's save put between its caller and here beyond
    the one torch.save would (its own): it runs out of recursion levels
    where torch.save called from the same place would, raising the same
    RecursionError (or whatever else it raises), or gives the pickle and
    storages torch.save writes (device storages copied to the host, as
    torch's _save copies them). The limit is the process's: other threads
    see the raised one (by a few levels) meanwhile."""
    frames = 0
    frame = sys._getframe()
    while frame is not None and _in_save_stack(frame.f_globals.get("__name__", "")):
        frames += 1
        frame = frame.f_back
    records = _Records()
    with _limit_lock:
        limit = sys.getrecursionlimit()
        sys.setrecursionlimit(limit + frames - 1)
        try:
            torch.serialization._save(obj, records, pickle, PROTOCOL, True)
        finally:
            sys.setrecursionlimit(limit)
    if any(storage is None for storage in records.storages.values()):
        return None
    return PlainPickle(records.data, records.storages)


def _in_save_stack(module: str) -> bool:
    """fastpersist's frames between a save's caller and the pickling (not its
    integrations': they are the callers torch.save would have)."""
    return (module == "fastpersist" or module.startswith("fastpersist.")) \
        and not module.startswith("fastpersist.integrations")


# The writer in C (csrc/fp_plain_pickle.c: ~5 us a tensor against ~8 for
# _Writer below, which stays as its reference and where it is not built).
try:
    from . import _plain_pickle as _c
except ImportError:  # pragma: no cover - a build without the extension
    _c = None
IMPLEMENTATION = "c" if _c is not None else "python"  # tests run both
_context: Optional[tuple] = None


def _c_context() -> tuple:
    """What the C writer compares against and names (its enum's order)."""
    global _context
    if _context is None:
        import _codecs

        names = {}  # GLOBAL's lines: every dtype torch names, then the classes and functions the pickle names
        for dtype in {v for v in vars(torch).values() if isinstance(v, torch.dtype)}:
            name = dtype.__reduce__()
            if isinstance(name, str) and getattr(torch, name, None) is dtype:
                names[dtype] = f"ctorch\n{name}\n".encode()
        for obj, module, name in [(_OrderedDict, "collections", "OrderedDict"),
                                  (torch._utils._rebuild_tensor_v2, "torch._utils", "_rebuild_tensor_v2"),
                                  (torch._utils._rebuild_tensor_v3, "torch._utils", "_rebuild_tensor_v3"),
                                  (torch._utils._rebuild_parameter, "torch._utils", "_rebuild_parameter"),
                                  (bytes, "__builtin__", "bytes"), (_codecs.encode, "_codecs", "encode"),
                                  (torch.device, "torch", "device"), (torch.Size, "torch", "Size"),
                                  *[(cls, cls.__module__, cls.__name__)
                                    for cls in [torch.UntypedStorage, *_STORAGE_CLASSES.values()]]]:
            names[obj] = f"c{module}\n{name}\n".encode()
        _context = (_Tensor, _Parameter, _OrderedDict, _STRIDED, _STORAGE, _CPU, _V3_DTYPES, _STORAGE_CLASSES,
                    torch._utils._rebuild_tensor_v2, torch._utils._rebuild_tensor_v3, torch._utils._rebuild_parameter,
                    _get_tensor_metadata, torch._utils._get_obj_state, _LATIN1, _codecs.encode, bytes, torch.dtype,
                    torch.device, torch.Size, torch.UntypedStorage, _encode_long, names, torch.uint8)
    return _context


def _encode_long(value: int) -> bytes:
    if value == 0:
        return b""
    nbytes = (value.bit_length() >> 3) + 1
    data = value.to_bytes(nbytes, "little", signed=True)
    if value < 0 and nbytes > 1 and data[-1] == 0xFF and data[-2] & 0x80:
        data = data[:-1]
    return data


def _int(value: int) -> bytes:
    if 0 <= value < 256:
        return _BININT1[value]
    if 0 <= value < 65536:
        return b"M" + _pack_u16(value)
    if -0x80000000 <= value <= 0x7FFFFFFF:
        return b"J" + _pack_i32(value)
    data = _encode_long(value)
    if len(data) < 256:
        return b"\x8a" + bytes((len(data),)) + data
    return b"\x8b" + _pack_u32(len(data)) + data


class _Writer:
    def __init__(self):
        self.out = bytearray(b"\x80\x02")
        self.memo: dict = {}     # id(obj) -> memo index
        self.keep: list = []     # objects of ours whose ids are in the memo
        self.size = 0            # next memo index
        self.storages: dict = {}  # key -> storage, in key order
        self.keys: dict = {}      # storage._cdata -> memo index of its key string
        self.dtypes: dict = {}    # data_ptr -> dtype (torch refuses two dtypes over one memory)
        self.depth = 0            # containers being written
        self.max_depth = 0        # the most at once

    def dump(self, obj) -> PlainPickle:
        self.save(obj)
        self.out += b"."
        return PlainPickle(bytes(self.out), self.storages)

    # -- memo --------------------------------------------------------------

    def put(self) -> None:
        """Memoizes the object just written under the next index (not by identity: nothing can meet it again)."""
        i = self.size
        self.size = i + 1
        self.out += _put(i)

    def memoize(self, obj) -> None:
        self.memo[id(obj)] = self.size
        self.put()

    def get(self, i: int) -> None:
        self.out += _get(i)

    def global_(self, obj, module: str, name: str) -> None:
        i = self.memo.get(id(obj))
        if i is not None:
            self.get(i)
            return
        self.out += b"c" + module.encode("utf-8") + b"\n" + name.encode("utf-8") + b"\n"
        self.memoize(obj)

    # -- values --------------------------------------------------------------

    def save(self, obj) -> None:
        kind = type(obj)
        out = self.out
        if obj is None:
            out += b"N"
            return
        if kind is bool:
            out += b"\x88" if obj else b"\x89"
            return
        if kind is int:
            out += _int(obj)
            return
        if kind is float:
            out += b"G" + _pack_double(obj)
            return
        i = self.memo.get(id(obj))
        if i is not None:
            self.get(i)
            return
        if kind is str:
            self.save_str(obj)
        elif kind is _Tensor:
            self.save_tensor(obj)
        elif kind is dict or kind is list or kind is tuple or kind is _OrderedDict or kind is _Parameter:
            self.depth += 1
            if self.depth > self.max_depth:
                self.max_depth = self.depth
            if kind is dict:
                out += b"}"
                self.memoize(obj)
                if obj:
                    self.dict_items(obj)
            elif kind is list:
                out += b"]"
                self.memoize(obj)
                if obj:
                    self.list_items(obj)
            elif kind is tuple:
                self.save_tuple(obj)
            elif kind is _OrderedDict:
                self.save_ordered_dict(obj)
            else:
                self.save_parameter(obj)
            self.depth -= 1
        elif kind is bytes:
            self.save_bytes(obj)
        elif kind is torch.dtype:
            name = obj.__reduce__()
            if type(name) is not str or getattr(torch, name, None) is not obj:
                raise Unsupported(repr(obj))
            self.global_(obj, "torch", name)
        elif kind is torch.device or kind is torch.Size:
            reduced = obj.__reduce_ex__(PROTOCOL)
            self.keep.append(reduced)
            func, args = reduced
            if func is not kind:
                raise Unsupported(repr(obj))
            self.global_(kind, "torch", kind.__name__)
            self.save_tuple(args)
            out += b"R"
            self.memoize(obj)
        else:
            raise Unsupported(kind.__name__)

    def save_str(self, obj: str) -> None:
        data = obj.encode("utf-8", "surrogatepass")
        self.out += b"X" + _pack_u32(len(data)) + data
        self.memoize(obj)

    def save_bytes(self, obj: bytes) -> None:
        # protocol 2 has no bytes opcode: pickle writes _codecs.encode(text, "latin1"), or bytes() when empty
        if not obj:
            self.global_(bytes, "__builtin__", "bytes")
            self.out += b")R"
        else:
            if _LATIN1 is None:
                raise Unsupported("bytes")
            import _codecs

            self.global_(_codecs.encode, "_codecs", "encode")
            text = obj.decode("latin1")
            self.keep.append(text)
            # a one-character text is CPython's cached string, maybe already in the memo: save() looks
            self.save(text)
            self.save(_LATIN1)
            self.out += b"\x86"
            self.put()
            self.out += b"R"
        self.memoize(obj)

    def save_tuple(self, obj: tuple) -> None:
        n = len(obj)
        if n == 0:
            self.out += b")"
            return
        if n > 3:
            self.out += b"("
        for item in obj:
            self.save(item)
        if id(obj) in self.memo:  # reached again through its own items: left to torch's pickling
            raise Unsupported("a recursive tuple")
        self.out += b"t" if n > 3 else b"\x85\x86\x87"[n - 1:n]
        self.memoize(obj)

    def dict_items(self, obj: dict) -> None:
        save = self.save
        if len(obj) == 1:
            for key, value in obj.items():
                save(key)
                save(value)
            self.out += b"s"
            return
        items = list(obj.items())
        for start in range(0, len(items) + 1, _BATCH):  # an exact dict's batches: an empty last one at a multiple of 1000
            self.out += b"("
            for key, value in items[start:start + _BATCH]:
                save(key)
                save(value)
            self.out += b"u"
            if start + _BATCH > len(items):
                break
        if len(obj) != len(items):
            raise Unsupported("a dict changed size while pickled")

    def list_items(self, obj: list) -> None:
        save = self.save
        if len(obj) == 1:
            save(obj[0])
            self.out += b"a"
            return
        total = 0
        while total < len(obj):
            batch = obj[total:total + _BATCH]
            self.out += b"("
            for item in batch:
                save(item)
            self.out += b"e"
            total += len(batch)

    def save_ordered_dict(self, obj) -> None:
        # OrderedDict.__reduce__: (OrderedDict, (), __dict__ or None, None, iter(items))
        state = obj.__dict__ if obj.__dict__ else None
        self.global_(_OrderedDict, "collections", "OrderedDict")
        self.out += b")R"
        self.memoize(obj)
        items = list(obj.items())
        save = self.save
        for start in range(0, len(items), _BATCH):
            batch = items[start:start + _BATCH]
            if len(batch) == 1:
                save(batch[0][0])
                save(batch[0][1])
                self.out += b"s"
            else:
                self.out += b"("
                for key, value in batch:
                    save(key)
                    save(value)
                self.out += b"u"
        if state is not None:
            self.save(state)
            self.out += b"b"

    def save_parameter(self, obj) -> None:
        # Parameter.__reduce_ex__ without Python state: (_rebuild_parameter, (data, requires_grad, OrderedDict()))
        if torch._utils._get_obj_state(obj):
            raise Unsupported("a Parameter with Python state")
        self.global_(torch._utils._rebuild_parameter, "torch._utils", "_rebuild_parameter")
        data = obj.data
        self.keep.append(data)
        self.save(data)
        self.out += b"\x88" if obj.requires_grad else b"\x89"
        self.empty_ordered_dict()
        self.out += b"\x87"
        self.put()
        self.out += b"R"
        self.memoize(obj)

    def empty_ordered_dict(self) -> None:
        self.global_(_OrderedDict, "collections", "OrderedDict")
        self.out += b")R"
        self.put()

    def save_tensor(self, obj) -> None:
        # Tensor._reduce_ex_internal's (rebuild, (storage, offset, size, stride, requires_grad, OrderedDict()[, dtype]))
        # with the storage's persistent id ("storage", class, key, location, numel); one tensor's opcodes in one go
        if obj.layout is not _STRIDED or obj.__dict__ or obj._backward_hooks or obj.is_quantized or obj.is_nested:
            raise Unsupported("a tensor torch pickles another way")
        device = obj.device
        if device.type == "cpu":
            location = None
        elif device.type == "cuda":
            location = f"cuda:{device.index}".encode("ascii")  # torch's tag: a fresh string per storage
        else:
            raise Unsupported(f"a tensor on {device}")
        requires_grad = obj.requires_grad
        if requires_grad and obj.grad_fn is not None:
            raise Unsupported("a non-leaf tensor")
        if _get_tensor_metadata(obj):
            raise Unsupported("a tensor with conj/neg bits")
        dtype = obj.dtype
        storage = obj.untyped_storage()
        nbytes = storage.nbytes()
        v3 = dtype in _V3_DTYPES
        if v3:
            self.global_(torch._utils._rebuild_tensor_v3, "torch._utils", "_rebuild_tensor_v3")
            storage_class = torch.UntypedStorage
            numel = nbytes
            storage_dtype = torch.uint8
        else:
            self.global_(torch._utils._rebuild_tensor_v2, "torch._utils", "_rebuild_tensor_v2")
            storage_class = _STORAGE_CLASSES.get(dtype)
            if storage_class is None:
                raise Unsupported(f"a tensor of {dtype}")
            numel = nbytes // obj.element_size()
            storage_dtype = dtype
        out = self.out
        out += b"(("
        self.save(_STORAGE)
        self.global_(storage_class, storage_class.__module__, storage_class.__name__)
        ptr = storage.data_ptr()
        if ptr:
            seen = self.dtypes.setdefault(ptr, storage_dtype)
            if seen != storage_dtype:
                raise Unsupported("two dtypes over one memory (torch refuses it)")
        cdata = storage._cdata
        known = self.keys.get(cdata)
        i = self.size
        if known is None:
            key = str(len(self.keys))
            self.storages[key] = storage
            self.keys[cdata] = i
            out += b"X" + _pack_u32(len(key)) + key.encode("ascii") + _put(i)
            i += 1
        else:
            out += _get(known)
        if location is None:
            self.size = i
            self.save(_CPU)
            i = self.size
        else:
            out += b"X" + _pack_u32(len(location)) + location + _put(i)
            i += 1
        size = tuple(obj.size())
        stride = obj.stride()
        # numel, the id tuple, its PUT, BINPERSID, the offset; size and stride (empty ones not memoized)
        out += _int(numel) + b"t" + _put(i) + b"Q" + _int(obj.storage_offset())
        i += 1
        if size:
            out += _sizes(size) + _put(i)
            i += 1
        else:
            out += b")"
        if stride:
            out += _sizes(stride) + _put(i)
            i += 1
        else:
            out += b")"
        out += b"\x88" if requires_grad else b"\x89"
        self.size = i
        self.empty_ordered_dict()
        if v3:
            self.save(dtype)
        i = self.size
        out += b"t" + _put(i) + b"R"
        self.size = i + 1
        self.memoize(obj)


def _put(i: int) -> bytes:
    return _BINPUT[i] if i < 256 else b"r" + _pack_u32(i)


def _get(i: int) -> bytes:
    return _BINGET[i] if i < 256 else b"j" + _pack_u32(i)


_SIZES: dict = {}


def _sizes(values: tuple) -> bytes:
    """A size or stride tuple's opcodes (without its PUT), cached: a model's shapes repeat."""
    data = _SIZES.get(values)
    if data is None:
        n = len(values)
        items = b"".join(_int(v) for v in values)
        data = b"(" + items + b"t" if n > 3 else items + b"\x85\x86\x87"[n - 1:n]
        if len(_SIZES) < 4096:
            _SIZES[values] = data
    return data
