"""safetensors files through fastpersist's engine, with the signatures of
``safetensors.torch``: ``save_file``, ``load_file``, ``save``, ``load`` and
``safe_open``.

Saves write what ``safetensors.torch.save_file`` writes, byte for byte (the
header's tensor order and dtype names are read off the installed
safetensors once, so a later version's choices are followed), streamed
from the tensors' own memory (GPU tensors through the engine's pinned
buffers) into a temporary that is fsynced and renamed over the target:
atomic and durable, as fastpersist's torch saves are. Tensors that
safetensors refuses (shared, non-contiguous, sparse) are refused with its
own errors.

Loads read the whole file with the engine into one page-aligned
allocation, the tensors views of it (as ``torch.load(mmap=True)`` gives
views of a mapping); to a GPU, each tensor is filled from the engine's
buffers with no host copy of the file. ``safe_open`` reads the header only,
then each tensor (or the rows of a slice) when asked for.

A file is checked before any tensor is made from it, by safetensors' own
rules: the headers its parser (serde_json) and its checks accept load, with
the same tensors and metadata; every other one (not JSON as serde_json reads
it: NaN, numbers out of range, lone surrogate escapes, nesting of 128 or
more; a duplicate field; -0 or 1.0 for an integer; offsets with holes or
overlaps; a size that disagrees with the header; an unknown dtype) raises
``SafetensorsFileError`` naming the file and the problem. Devices other than
the CPU and CUDA (mps, xpu, npu, ...) are left to safetensors' own loads.
"""
from __future__ import annotations

import contextlib
import ctypes
import json
import os
import re
import struct
import threading
import weakref
from typing import Dict, Optional

import torch

from .fileio import same_file
from .helper_threads import HelperThreads, StopSignal
from .options import current_options
from .errors import CheckpointError

HEADER_LIMIT = 100_000_000  # safetensors' own bound on the JSON header


class SafetensorsFileError(CheckpointError):
    """A safetensors file is truncated, corrupt or not a safetensors file."""


# ---------------------------------------------------------------------------
# dtypes: names in the header, and the order safetensors writes them in

# safetensors 0.8's choices, for a machine without safetensors installed; _dtype_table() reads
# the installed version's off a probe save instead
_STATIC_NAMES = {
    "float64": "F64", "float32": "F32", "float16": "F16", "bfloat16": "BF16", "int64": "I64", "int32": "I32",
    "int16": "I16", "int8": "I8", "uint8": "U8", "bool": "BOOL", "float8_e4m3fn": "F8_E4M3",
    "float8_e4m3fnuz": "F8_E4M3FNUZ", "float8_e5m2": "F8_E5M2", "float8_e5m2fnuz": "F8_E5M2FNUZ",
    "float8_e8m0fnu": "F8_E8M0", "float4_e2m1fn_x2": "F4", "complex64": "C64", "uint64": "U64", "uint32": "U32",
    "uint16": "U16",
}
_STATIC_ORDER = ["U64", "I64", "F64", "C64", "F32", "U32", "I32", "BF16", "F16", "U16", "I16", "F8_E8M0",
                 "F8_E4M3FNUZ", "F8_E4M3", "F8_E5M2FNUZ", "F8_E5M2", "I8", "U8", "F4", "BOOL"]
# header elements per byte of a torch element, where they differ (two 4-bit floats in a byte)
_PACKED = {"F4": 2}

_table_lock = threading.Lock()
_table: Optional[tuple] = None


def _dtype_table() -> tuple:
    """({torch dtype: header name}, {header name: torch dtype}, {header name:
    rank}, where safetensors writes higher ranks first). Read off one save
    by the installed safetensors of a tensor of each dtype; the static
    table where safetensors is not installed."""
    global _table
    with _table_lock:
        if _table is None:
            _table = _probe_dtype_table() or _static_dtype_table()
        return _table


def _static_dtype_table() -> tuple:
    names = {getattr(torch, k): v for k, v in _STATIC_NAMES.items() if hasattr(torch, k)}
    rank = {name: len(_STATIC_ORDER) - i for i, name in enumerate(_STATIC_ORDER)}
    return names, {v: k for k, v in names.items()}, rank


def _probe_dtype_table() -> Optional[tuple]:
    try:
        import safetensors.torch as reference
    except ImportError:
        return None
    dtypes = [d for d in getattr(reference, "_SIZE", {}) if isinstance(d, torch.dtype)]
    # one element each, named so that their names sort in the opposite order of the dtypes' list:
    # the header's order is then the dtypes' rank alone
    probe = {f"{len(dtypes) - i:04d}": torch.zeros(1, dtype=torch.uint8).view(d) if d.itemsize == 1
             else torch.zeros(1, dtype=d) for i, d in enumerate(dtypes)}
    try:
        data = reference.save(probe)
    except Exception:  # noqa: BLE001 - an unexpected version: the static table
        return None
    (n,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8:8 + n])
    header.pop("__metadata__", None)
    names, order = {}, []
    for key, info in header.items():
        dtype = dtypes[len(dtypes) - int(key)]
        names[dtype] = info["dtype"]
        order.append(info["dtype"])
    rank = {name: len(order) - i for i, name in enumerate(order)}
    return names, {v: k for k, v in names.items()}, rank


# ---------------------------------------------------------------------------
# the header


class _Entry:
    __slots__ = ("name", "dtype", "shape", "begin", "end")

    def __init__(self, name: str, dtype: torch.dtype, shape: tuple, begin: int, end: int):
        self.name, self.dtype, self.shape, self.begin, self.end = name, dtype, shape, begin, end

    @property
    def nbytes(self) -> int:
        return self.end - self.begin


class Header:
    """A safetensors file's header, checked: its tensors in file order,
    their offsets relative to the data section, which begins at
    ``data_start``; ``metadata`` (a dict of strings, or None)."""

    def __init__(self, entries: dict, metadata: Optional[dict], data_start: int):
        self.entries, self.metadata, self.data_start = entries, metadata, data_start

    @classmethod
    def read(cls, fd: int, path: str, size: int) -> "Header":
        if size < 8:
            raise SafetensorsFileError(f"{path}: {size} bytes, too short for a safetensors file (an 8-byte header "
                                       "length comes first)")
        (n,) = struct.unpack("<Q", os.pread(fd, 8, 0))
        if n > HEADER_LIMIT:
            raise SafetensorsFileError(f"{path}: header of {n} bytes, more than safetensors allows "
                                       f"({HEADER_LIMIT}); not a safetensors file?")
        if 8 + n > size:
            raise SafetensorsFileError(f"{path}: its header says it is {n} bytes long, but the file has only "
                                       f"{size - 8} after the length: truncated, or not a safetensors file")
        raw = os.pread(fd, n, 8)
        if len(raw) != n:
            raise SafetensorsFileError(f"{path}: the file ended inside its header")
        return cls.parse(raw, path, size)

    @classmethod
    def parse(cls, raw: bytes, path: str, size: int) -> "Header":
        """The header from its JSON bytes; size: the whole file's. Accepts
        exactly the headers safetensors loads (its serde_json parser and its
        checks, then the tensors torch can make: see _header_json and
        _tensor_fields); SafetensorsFileError naming the problem for the rest."""
        from . import gc_pause

        data_start = 8 + len(raw)
        # ~6 objects a tensor, none in a cycle: a collection of the oldest generation set off midway
        # walks every object of the process (0.1 s of a 10,000-tensor header's parse here)
        with gc_pause.paused():
            return cls._parse(raw, path, size, data_start)

    @classmethod
    def _parse(cls, raw: bytes, path: str, size: int, data_start: int) -> "Header":
        try:
            parsed = _header_json(raw)
            if type(parsed) is not tuple:
                raise _Refused(f"the header is not a JSON object but {_kind(parsed)}")
            metadata, fields = _MISSING, {}
            for name, value in parsed:
                if name == "__metadata__":
                    if metadata is not _MISSING:
                        raise _Refused("__metadata__ appears twice (safetensors refuses a duplicate field)")
                    metadata = _metadata_of(value)
                else:
                    fields[name] = _tensor_fields(name, value)  # a name given twice: the last one, as safetensors
            entries = _checked_entries(fields, size - data_start)
        except _Refused as exc:
            raise SafetensorsFileError(f"{path}: {exc}") from None
        return cls(entries, None if metadata is _MISSING else metadata, data_start)


# ---------------------------------------------------------------------------
# the header's JSON, read by safetensors' rules: serde_json's (safetensors parses the header with it
# into a struct of an optional "__metadata__" map of strings and a map of tensors, each a struct of
# dtype, shape and data_offsets), then safetensors' own checks (Metadata::validate), then torch's (a
# tensor it can make). Python's json parses the text (at C speed: a 10,000-tensor header is read once
# per file); what serde_json refuses and Python's json takes is refused around it: NaN and Infinity,
# numbers past a 64-bit float (by serde_json's own reckoning), lone surrogate escapes, nesting of 128
# or more, duplicate fields, -0 and numbers with a fraction or an exponent where an integer is wanted.

_U64 = (1 << 64) - 1
_NESTING = 128  # serde_json's recursion limit: a container at this depth (the header itself is 1) is refused
# every dtype safetensors 0.8 parses (bits each), torch's or not: a name it does not know is a JSON
# error there, one torch cannot hold (F6) is refused only when a tensor of it is made
_PARSED_DTYPES = {"BOOL": 8, "F4": 4, "F6_E2M3": 6, "F6_E3M2": 6, "U8": 8, "I8": 8, "F8_E5M2": 8, "F8_E4M3": 8,
                  "F8_E8M0": 8, "F8_E4M3FNUZ": 8, "F8_E5M2FNUZ": 8, "I16": 16, "U16": 16, "F16": 16, "BF16": 16,
                  "I32": 32, "U32": 32, "F32": 32, "C64": 64, "F64": 64, "I64": 64, "U64": 64}
_FIELDS = ("dtype", "shape", "data_offsets")
_MISSING = object()
_POW10 = tuple(float(f"1e{i}") for i in range(309))  # serde_json's table
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")  # where none is, no string can hold a surrogate
_SURROGATE = re.compile("[\ud800-\udfff]")
_MINUS_ZERO = re.compile(rb"-0")  # (re's search: 0.3 ms on a 1 MB header, `in` 0.9 ms)


class _Refused(ValueError):
    """A rule of safetensors' that the header breaks (the message says which)."""


def _not_json(name: str):
    raise _Refused(f"the header is not valid JSON: {name} is not a JSON number (safetensors refuses it)")


def _float_literal(literal: str) -> float:
    if not _within_f64(literal):
        raise _Refused(f"the number {_short(literal)} is out of range (past the largest 64-bit float; "
                       "safetensors refuses it)")
    return float(literal)


def _int_literal(literal: str):
    """Where the header holds "-0": serde_json parses it as the float -0.0."""
    return -0.0 if literal == "-0" else int(literal)


_DECODER = json.JSONDecoder(object_pairs_hook=tuple, parse_float=_float_literal, parse_constant=_not_json)
_DECODER_MINUS_ZERO = json.JSONDecoder(object_pairs_hook=tuple, parse_float=_float_literal, parse_int=_int_literal,
                                       parse_constant=_not_json)


def _header_json(raw: bytes):
    """The header's JSON as serde_json reads it: an object is a tuple of its
    (key, value) pairs, every one of them (duplicates are for the reader to
    judge), an array a list; integers serde_json takes as integers are
    ints, every other number a float."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise _Refused(f"the header is not UTF-8 ({exc.reason} at byte {exc.start})") from None
    try:  # "-0" is rare: the int hook costs a call for each integer of the header
        parsed = (_DECODER_MINUS_ZERO if _MINUS_ZERO.search(raw) else _DECODER).decode(text)
    except RecursionError:
        raise _Refused(f"the header nests deeper than {_NESTING - 1} levels (safetensors' JSON parser refuses "
                       f"{_NESTING})") from None
    except _Refused:
        raise
    except ValueError as exc:
        raise _Refused(f"the header is not valid JSON: {exc}") from None
    if _SURROGATE_ESCAPE.search(raw):
        _refuse_lone_surrogates(parsed)
    return parsed


def _refuse_lone_surrogates(parsed) -> None:
    """Python's json keeps a \\ud800 with no pair as a lone surrogate;
    serde_json refuses it. (A pair is one character by then.)"""
    stack = [parsed]
    while stack:
        value = stack.pop()
        if type(value) is tuple:
            for key, item in value:
                if _SURROGATE.search(key):
                    raise _Refused(f"the key {_short(repr(key))} holds a lone surrogate escape (\\ud800-\\udfff "
                                   "with no pair; safetensors refuses it)")
                stack.append(item)
        elif type(value) is list:
            stack.extend(value)
        elif type(value) is str and _SURROGATE.search(value):
            raise _Refused(f"the string {_short(repr(value))} holds a lone surrogate escape (\\ud800-\\udfff "
                           "with no pair; safetensors refuses it)")


def _within_f64(literal: str) -> bool:
    """Whether serde_json parses the JSON number literal without "number out
    of range": its own steps (up to 19 digits kept as an integer, the rest
    counted in the exponent, then one multiplication by a power of ten),
    followed here one by one, since near the largest float its verdict is
    not that of a correctly rounded parse (1.7976931348623158e308 is out of
    range there)."""
    i, n = (1 if literal[0] == "-" else 0), len(literal)
    significand, exponent, dropping = 0, 0, False
    while i < n and "0" <= literal[i] <= "9":  # the integer part: past u64, each digit raises the exponent
        digit = ord(literal[i]) - 48
        if dropping or significand * 10 + digit > _U64:
            dropping = True
            exponent += 1
        else:
            significand = significand * 10 + digit
        i += 1
    if i < n and literal[i] == ".":
        i, dropping = i + 1, False
        while i < n and "0" <= literal[i] <= "9":  # past u64, the fraction's digits are dropped
            digit = ord(literal[i]) - 48
            if dropping or significand * 10 + digit > _U64:
                dropping = True
            else:
                significand, exponent = significand * 10 + digit, exponent - 1
            i += 1
    if i < n and literal[i] in "eE":
        i += 1
        negative = literal[i] == "-"
        i += literal[i] in "+-"
        digits = literal[i:].lstrip("0") or "0"
        value = int(digits) if len(digits) <= 10 else 1 << 31
        if value > (1 << 31) - 1:  # the exponent's own overflow: out of range unless it makes a zero
            return not (significand and not negative)
        exponent = max(-(1 << 31), min((1 << 31) - 1, exponent - value if negative else exponent + value))
    f = float(significand)
    while True:
        if abs(exponent) < len(_POW10):
            return exponent < 0 or f * _POW10[exponent] != float("inf")
        if f == 0.0:
            return True
        if exponent >= 0:
            return False
        f /= 1e308
        exponent += 308


def _short(text: str, limit: int = 60) -> str:
    return text if len(text) <= limit else text[:limit] + "..."


def _kind(value) -> str:
    """What a parsed JSON value is, with a glimpse of it, for messages."""
    if type(value) is tuple:
        return f"an object {_short(_shown(value))}"
    if type(value) is list:
        return f"an array {_short(_shown(value))}"
    if type(value) is str:
        return f"the string {_short(repr(value))}"
    if type(value) is int or type(value) is float:
        return f"the number {_short(_shown(value))}"
    return _shown(value)


def _shown(value) -> str:
    """A parsed JSON value written back, about as the header has it."""
    if type(value) is tuple:
        return "{" + ", ".join(f"{k!r}: {_shown(v)}" for k, v in value[:8]) + (", ..." if len(value) > 8 else "") + "}"
    if type(value) is list:
        return "[" + ", ".join(_shown(v) for v in value[:8]) + (", ..." if len(value) > 8 else "") + "]"
    if type(value) is float and value == 0 and str(value)[0] == "-":
        return "-0"
    if value is None or type(value) is bool:
        return {None: "null", True: "true", False: "false"}[value]
    return repr(value)


def _metadata_of(value) -> Optional[dict]:
    """__metadata__: null, or an object of strings (a key given twice: its last value)."""
    if value is None:
        return None
    if type(value) is not tuple:
        raise _Refused(f"__metadata__ must be an object of strings (or null), not {_kind(value)}")
    for key, item in value:
        if type(item) is not str:
            raise _Refused(f"__metadata__ must map strings to strings: {key!r} is {_kind(item)}")
    return dict(value)


def _tensor_fields(name: str, value) -> tuple:
    """(begin, end, name, dtype name, shape, elements) of a tensor's entry
    (its offsets first: the order safetensors checks them in): an object with
    dtype, shape and data_offsets each once (other fields ignored), or an
    array of the three (serde's other form of a struct); the dtype a
    string, or serde's other form of it, an object {"F32": null}."""
    if type(value) is tuple:
        if len(value) == 3 and value[0][0] == "dtype" and value[1][0] == "shape" and value[2][0] == "data_offsets":
            dtype, shape, offsets = value[0][1], value[1][1], value[2][1]  # as safetensors writes it
        else:
            found = {}
            for key, item in value:
                if key in _FIELDS:
                    if key in found:
                        raise _Refused(f"tensor {name!r}: duplicate field {key!r} (safetensors refuses it)")
                    found[key] = item
                elif type(item) is tuple or type(item) is list or type(item) is int:
                    _check_ignored(item, name, key)
            missing = [key for key in _FIELDS if key not in found]
            if missing:
                raise _Refused(f"tensor {name!r}: missing field {missing[0]!r}")
            dtype, shape, offsets = found["dtype"], found["shape"], found["data_offsets"]
    elif type(value) is list:
        if len(value) != 3:
            raise _Refused(f"tensor {name!r}: an array of its fields must have 3 (dtype, shape, data_offsets), "
                           f"not {len(value)}")
        dtype, shape, offsets = value
    else:
        raise _Refused(f"tensor {name!r}: expected an object of dtype, shape and data_offsets, got {_kind(value)}")
    if type(dtype) is not str:
        if not (type(dtype) is tuple and len(dtype) == 1 and dtype[0][1] is None):
            raise _Refused(f"tensor {name!r}: dtype must be a string, got {_kind(dtype)}")
        dtype = dtype[0][0]  # {"F32": null}
    if dtype not in _PARSED_DTYPES and dtype not in _dtype_table()[1]:
        raise _Refused(f"tensor {name!r}: unknown dtype {_short(repr(dtype))}")
    if type(shape) is not list:
        raise _Refused(f"tensor {name!r}: shape must be an array of integers, got {_kind(shape)}")
    elements = 1
    for d in shape:
        if type(d) is not int or d < 0 or d > _U64:
            raise _Refused(f"tensor {name!r}: bad shape {_short(_shown(shape))}: {_shown(d)} is not an integer from "
                           "0 to 2**64-1 (to safetensors, -0 and numbers with a fraction or an exponent are not)")
        if elements is not None:
            elements *= d
            if elements > _U64:  # safetensors multiplies in 64 bits, in order: a later 0 does not help
                elements = None  # refused once the tensor is known to be this name's last (_checked_entries)
    if type(offsets) is not list or len(offsets) != 2:
        raise _Refused(f"tensor {name!r}: data_offsets must be an array of 2 integers, got {_kind(offsets)}")
    begin, end = offsets
    for o in offsets:
        if type(o) is not int or o < 0 or o > _U64:
            raise _Refused(f"tensor {name!r}: bad data_offsets {_shown(offsets)}: {_shown(o)} is not an integer "
                           "from 0 to 2**64-1 (to safetensors, -0 and numbers with a fraction or an exponent are not)")
    return begin, end, name, dtype, shape, elements


def _check_ignored(value, name: str, key: str) -> None:
    """A field safetensors ignores is still parsed whole: nesting under the
    limit, integers within serde_json's range (a float past u64/i64)."""
    stack = [(value, 3)]  # the header is depth 1, the tensor's object 2
    while stack:
        item, depth = stack.pop()
        if type(item) is int:
            if (item > _U64 or item < -(1 << 63)) and not _within_f64(str(item)):
                raise _Refused(f"tensor {name!r}, field {key!r}: the number {_short(str(item))} is out of range "
                               "(past the largest 64-bit float; safetensors refuses it)")
            continue
        if type(item) is not tuple and type(item) is not list:
            continue
        if depth >= _NESTING:
            raise _Refused(f"tensor {name!r}, field {key!r}: the header nests deeper than {_NESTING - 1} levels "
                           f"(safetensors' JSON parser refuses {_NESTING})")
        stack.extend((v, depth + 1) for v in (item if type(item) is list else (v for _, v in item)))


def _checked_entries(fields: dict, data_size: int) -> dict:
    """{name: _Entry} in file order, from {name: _tensor_fields(...)},
    checked as safetensors checks them (Metadata::validate: in the order of
    their offsets, each beginning where the one before ends; bit counts
    within 64 bits, whole bytes, as many as the offsets give; together the
    whole data section), then as its torch side makes them."""
    _, dtypes, _ = _dtype_table()
    reached, entries, cannot = 0, {}, None
    for begin, end, name, dtype_name, shape, elements in sorted(fields.values()):  # names differ: no shapes compared
        if begin != reached or end < begin:
            what = ("ends before it begins" if end < begin else "leaves a hole before it" if begin > reached
                    else "overlaps the tensor before it")
            raise _Refused(f"tensor {name!r}: data_offsets [{begin}, {end}] {what} (the data before it ends at "
                           f"{reached})")
        reached = end
        if elements is None:
            raise _Refused(f"tensor {name!r}: shape {_short(_shown(shape))} overflows 64 bits counting its "
                           "elements (safetensors refuses it)")
        dtype = dtypes.get(dtype_name)
        bits = _PARSED_DTYPES.get(dtype_name) or dtype.itemsize * 8 // _PACKED.get(dtype_name, 1)
        if elements * bits != (end - begin) * 8 or elements * bits > _U64:
            if elements * bits > _U64:
                raise _Refused(f"tensor {name!r}: shape {_short(_shown(shape))} of {dtype_name} overflows 64 bits "
                               "counting its bits (safetensors refuses it)")
            if elements * bits % 8:
                raise _Refused(f"tensor {name!r}: shape {_shown(shape)} of {dtype_name} ({bits} bits each) does "
                               "not end on a byte")
            raise _Refused(f"tensor {name!r}: shape {_short(_shown(shape))} of {dtype_name} needs "
                           f"{elements * bits // 8} bytes, its data_offsets give {end - begin}")
        # what safetensors' parser takes and its torch side cannot make (kept for after the parser's checks)
        packed = _PACKED.get(dtype_name, 1)
        if dtype is None:
            cannot = cannot or f"tensor {name!r} has dtype {dtype_name}, which this torch cannot hold"
            continue
        if packed > 1:  # shape[-1] is there: a 0-d one has no whole byte (above)
            if shape[-1] % packed:
                cannot = cannot or (f"tensor {name!r}: {dtype_name} packs {packed} values a byte: its last "
                                    f"dimension must be divisible by {packed}, shape {_shown(shape)}")
                continue
            shape = shape[:-1] + [shape[-1] // packed]
        if not elements:  # (with elements, each dimension is below the file's size)
            if any(d >> 63 for d in shape):
                cannot = cannot or (f"tensor {name!r}: shape {_short(_shown(shape))} (in torch's elements) has a "
                                    "dimension of 2**63 or more, which torch cannot hold")
                continue
            try:  # as it is made (_empty): its strides must be within 64 bits
                _empty(tuple(shape), torch.uint8)
            except RuntimeError as exc:
                cannot = cannot or f"tensor {name!r}: torch cannot make shape {_short(_shown(shape))}: {exc}"
                continue
        entries[name] = _Entry(name, dtype, tuple(shape), begin, end)
    if reached != data_size:
        raise _Refused(f"the header's tensors end at byte {reached} of the data, but the file has {data_size} "
                       "bytes of data after the header: truncated or extended")
    if cannot:
        raise _Refused(cannot)
    return entries


def header_bytes(tensors: Dict[str, torch.Tensor], metadata: Optional[Dict[str, str]] = None,
                 align: int = 8) -> tuple:
    """(the file's first bytes: length and JSON header, padded with spaces,
    the tensors' names in file order), as safetensors writes them. align:
    the data section begins at a multiple of it (safetensors: 8)."""
    names, _, rank = _dtype_table()
    order = sorted(tensors, key=lambda k: (-rank[_name_of(names, tensors[k].dtype, k)], k))
    parts = []
    if metadata is not None:
        parts.append('"__metadata__":' + _json(metadata))
    offset = 0
    for k in order:
        t = tensors[k]
        dtype_name = names[t.dtype]
        shape = list(t.shape)
        packed = _PACKED.get(dtype_name, 1)
        if packed > 1:
            if not shape:
                raise ValueError(f"tensor {k!r}: a 0-d {t.dtype} tensor cannot be stored ({dtype_name} packs "
                                 f"{packed} values a byte along the last dimension)")
            shape[-1] *= packed
        nbytes = t.numel() * t.element_size()
        parts.append(f'{_json(k)}:{{"dtype":"{dtype_name}","shape":{_json(shape)},"data_offsets":[{offset},'
                     f'{offset + nbytes}]}}')
        offset += nbytes
    body = ("{" + ",".join(parts) + "}").encode("utf-8")
    padded = -(-(8 + len(body)) // align) * align - 8
    body += b" " * (padded - len(body))
    return struct.pack("<Q", len(body)) + body, order


def _json(value) -> str:
    # serde_json's compact form: no spaces, non-ASCII characters as they are
    return json.dumps(value, ensure_ascii=False, separators=(",", ":"))


def _name_of(names: dict, dtype, key: str) -> str:
    name = names.get(dtype)
    if name is None:
        raise ValueError(f"tensor {key!r} has dtype {dtype}, which safetensors cannot store")
    return name


# ---------------------------------------------------------------------------
# saving


def _check_for_save(tensors, metadata) -> None:
    """safetensors' own refusals, with its words (its checks where it is installed)."""
    try:
        from safetensors.torch import _evaluate_tensors_for_save
    except ImportError:
        _evaluate_tensors_for_save = _own_checks
    _evaluate_tensors_for_save(tensors)
    for k, v in tensors.items():
        if not v.is_contiguous():
            raise ValueError(
                f"You are trying to save a non contiguous tensor: `{k}` which is not allowed. It either means you"
                " are trying to save tensors which are reference of each other in which case it's recommended to"
                " save only the full tensors, and reslice at load time, or simply call `.contiguous()` on your"
                " tensor to pack it before saving.")
        if not isinstance(k, str):
            raise TypeError(f"tensor names must be strings, got {k!r}")
    if metadata is not None and not (isinstance(metadata, dict) and
                                     all(isinstance(a, str) and isinstance(b, str) for a, b in metadata.items())):
        raise TypeError(f"metadata must be a dict of strings to strings, got {metadata!r}")


def _own_checks(tensors) -> None:
    if not isinstance(tensors, dict):
        raise ValueError(f"Expected a dict of [str, torch.Tensor] but received {type(tensors)}")
    seen: dict = {}
    for k, v in tensors.items():
        if not isinstance(v, torch.Tensor):
            raise ValueError(f"Key `{k}` is invalid, expected torch.Tensor but received {type(v)}")
        if v.layout != torch.strided:
            raise ValueError(f"You are trying to save a sparse tensors: `{[k]}` which this library does not support.")
        if v.numel():
            seen.setdefault((v.device, v.untyped_storage().data_ptr()), []).append(k)
    failing = [names for names in seen.values() if len(names) > 1]
    if failing:
        raise RuntimeError(f"Some tensors share memory, this will lead to duplicate memory on disk and potential "
                           f"differences when loading them again: {failing}.")


CHECKSUMS_KEY = "fastpersist.crc32"  # the metadata key of per-tensor CRC-32s (a JSON object, a string)


def _crc_of(tensor) -> int:
    """CRC-32 (zlib's) of a contiguous tensor's bytes, on its own device."""
    from . import _engine

    if not tensor.numel():
        return 0
    if tensor.device.type == "cpu":
        return _engine.crc32(_engine.memory_at(tensor.data_ptr(), tensor.numel() * tensor.element_size()))
    from . import device_crc

    return device_crc.crc32(tensor.detach().reshape(-1).view(torch.uint8))


def save_file(tensors: Dict[str, torch.Tensor], filename, metadata: Optional[Dict[str, str]] = None, *,
              align: int = 8, checksums: bool = False, **options) -> None:
    """Saves tensors as a safetensors file at filename, as
    ``safetensors.torch.save_file`` does (the same bytes), atomically and
    durably: a temporary beside it, fsynced, renamed over it, the folder
    fsynced; on any failure the previous file is intact. GPU tensors are
    streamed through the engine's buffers (no host copy of the shard).

    align: where the data section begins (safetensors: 8; 4096 puts it on
    a page boundary, which every reader accepts). checksums: each tensor's
    CRC-32 kept in the metadata (key "fastpersist.crc32", a JSON string: every
    reader still loads the file; the file is then not safetensors' bytes),
    which ``load_file(..., verify=True)`` checks. ``options`` (see
    :class:`fastpersist.Options`) override the patched ones.
    Raises what safetensors raises for shared, non-contiguous and sparse
    tensors, ValueError for a dtype it cannot store or a bad align."""
    from . import device_io
    from .atomic_write import write_to_path

    _check_for_save(tensors, metadata)
    if align < 8 or align % 8:
        raise ValueError(f"align={align}: must be a multiple of 8")
    if checksums:
        sums = {k: f"{_crc_of(t):08x}" for k, t in tensors.items()}
        metadata = {**(metadata or {}), CHECKSUMS_KEY: json.dumps(sums, ensure_ascii=False, separators=(",", ":"),
                                                                  sort_keys=True)}
    head, order = header_bytes(tensors, metadata, align)
    total = len(head) + sum(tensors[k].numel() * tensors[k].element_size() for k in order)
    opts = current_options().replace(**options)

    def fill(writer) -> int:
        writer.write(head)
        copiers: dict = {}
        for k in order:
            t = tensors[k]
            nbytes = t.numel() * t.element_size()
            if not nbytes:
                continue
            if t.device.type == "cpu":
                writer.write_address(t.data_ptr(), nbytes)
            else:
                flat = t.detach().reshape(-1).view(torch.uint8) if t.dtype.itemsize else t
                device_io.write_storage(flat, writer, None, copiers)
        return total

    write_to_path(os.fspath(filename), opts, fill, expected_size=total)


def save(tensors: Dict[str, torch.Tensor], metadata: Optional[Dict[str, str]] = None) -> bytes:
    """The file's bytes, as ``safetensors.torch.save`` returns them."""
    _check_for_save(tensors, metadata)
    head, order = header_bytes(tensors, metadata)
    out = bytearray(head)
    for k in order:
        t = tensors[k]
        if t.numel():
            out += t.detach().cpu().reshape(-1).view(torch.uint8).numpy().tobytes()
    return bytes(out)


# ---------------------------------------------------------------------------
# loading


def _empty(shape: tuple, dtype: torch.dtype, device=None) -> torch.Tensor:
    """A tensor of no elements, made as safetensors makes it: a view of an
    empty one, whose strides stay within 64 bits where torch.empty's
    contiguous ones need not ([0, 2**40, 2**40])."""
    return torch.empty(0, dtype=dtype, device=device).view(shape)


def _tensor_at(buffer, entry: _Entry, data_start: int):
    """entry's tensor over its bytes of buffer (the whole file's), with a
    storage of its own (so that torch.save of one tensor, or a check for
    tensors sharing memory, sees its bytes, not the file's); a copy where
    its offset does not suit its dtype's alignment."""
    offset = data_start + entry.begin
    if not entry.nbytes:
        return _empty(entry.shape, entry.dtype)
    byte_view = torch.frombuffer(buffer, dtype=torch.uint8, count=entry.nbytes, offset=offset)
    if offset % entry.dtype.itemsize:
        byte_view = byte_view.clone()
    return byte_view.view(entry.dtype).view(entry.shape)


def load_file(filename, device="cpu", *, backend: Optional[str] = None, verify: bool = False) -> Dict[str, torch.Tensor]:
    """The file's tensors, as ``safetensors.torch.load_file`` returns them.
    On the CPU: read through the read pipeline into one allocation, the
    tensors views of it (freed when the last of them dies); a file in the
    page cache already is mapped by safetensors' own load_file, as
    safetensors maps every file (not with ``backend="pread"``). On a GPU
    (``device="cuda"``, ``"cuda:1"``, an int, a torch.device): each tensor
    allocated there and filled from the engine's buffers, no host copy of
    the file. Raises SafetensorsFileError for a file that is not a sound
    safetensors file (nothing is returned from it). ``backend``
    (safetensors' choice of mmap or pread) is otherwise ignored: the read
    pipeline reads.
    verify: check each tensor against the CRC-32 ``save_file(...,
    checksums=True)`` kept; SafetensorsFileError naming the first tensor
    that differs, or where the file keeps none. Other devices (``"mps"``,
    ``"xpu"``, ``"npu"``, ...) are loaded by safetensors' own load_file."""
    from . import device_io, load_memory, read_pipeline

    target = _device_of(device)
    if target is None:  # mps, xpu, npu, ...: safetensors' own
        original = _safetensors_own("load_file")
        if original is load_file:
            raise ValueError(f"fastpersist.safetensors loads to the CPU or a CUDA device, not {device!r}")
        out = original(filename, device=device, **({} if backend is None else {"backend": backend}))
        return _verified(out, _header_of(os.fspath(filename)), os.fspath(filename)) if verify else out
    path = os.fspath(filename)
    opts = current_options()
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        size = os.fstat(fd).st_size
        header = Header.read(fd, path, size)
        if target.type == "cpu" and backend in (None, "mmap") and _mapped_as_safetensors_maps(fd, size):
            # in the page cache already: mapped, as safetensors' own load_file maps every file (its
            # tensors are the file's cached pages; a copy costs faulting in as much fresh memory)
            out = _mapped_load_file(fd, path, header, size)
            if out is not None:
                return _verified(out, header, path) if verify else out
        if target.type == "cpu":
            # one image of the file (a kept one's memory where there is one), read by the pipeline
            memory, fresh = load_memory.image_memory(size)
            try:
                address = ctypes.addressof(ctypes.c_char.from_buffer(memory))
                read_pipeline.read_extents(fd, path, size, opts, [(address, 0, size)], False, fresh=fresh)
            except BaseException as exc:
                load_memory.give_back(memory)
                if isinstance(exc, EOFError):
                    raise SafetensorsFileError(f"{path}: the file ended before its {size} bytes were read (did "
                                               "it shrink while being read?)") from None
                raise
            buffer = load_memory.as_buffer(memory)
            out = {k: _tensor_at(buffer, e, header.data_start) for k, e in header.entries.items()}
            return _verified(out, header, path) if verify else out
        out = {k: torch.empty(e.shape, dtype=e.dtype, device=target) if e.nbytes else _empty(e.shape, e.dtype, target)
               for k, e in header.entries.items()}
        pieces = [device_io.Piece(header.data_start + e.begin, e.nbytes, device_io.byte_view(out[k].untyped_storage()))
                  for k, e in header.entries.items() if e.nbytes]
        try:
            read_pipeline.read_pieces(fd, path, size, opts, pieces)
        except EOFError:
            raise SafetensorsFileError(f"{path}: the file ended before its {size} bytes were read (did it shrink "
                                       "while being read?)") from None
        return _verified(out, header, path) if verify else out
    finally:
        if fd >= 0:
            os.close(fd)


def _mapped_as_safetensors_maps(fd: int, size: int) -> bool:
    """Whether a CPU load_file takes safetensors' own mapping of the file:
    where safetensors is installed and the read pipeline would read the
    file through the page cache because it is there already (not merely
    small). Copying cached pages into fresh memory ran at 0.4-0.9 GB/s here
    (0.5 GB, fresh processes) where mapping them took 0.01-0.14 s."""
    from . import read_pipeline

    try:
        _safetensors_own("load_file")
    except ValueError:
        return False
    return read_pipeline.is_cached(fd, size)


def _mapped_load_file(fd: int, path: str, header: Header, size: int) -> Optional[Dict[str, torch.Tensor]]:
    """What safetensors' own load_file returns for the file fd is open on
    (header and size: its header and size, read from fd): its tensors mapped by safetensors'
    own safe_open, called here rather than through its load_file, which
    looks safe_open up by a name the patch binds to fastpersist's. Opened
    through /proc/self/fd: the file the header was read from, even where a
    save has renamed another file over its name since. None where /proc is
    not there (the caller reads the file itself)."""
    opened_as = f"/proc/self/fd/{fd}"
    try:
        if not same_file(os.stat(opened_as), os.fstat(fd)):
            return None
    except OSError:
        return None
    with _safetensors_own("safe_open")(opened_as, framework="pt", device="cpu") as opened:
        names = list(opened.offset_keys())
        if set(names) != set(header.entries) or os.fstat(fd).st_size != size:
            raise SafetensorsFileError(f"{path}: the file changed while it was being loaded (written in place); "
                                       "load it again once its writer is done")
        return {name: opened.get_tensor(name) for name in names}


def _header_of(path: str) -> Header:
    with open(path, "rb") as f:
        return Header.read(f.fileno(), path, os.fstat(f.fileno()).st_size)


def _verified(tensors: dict, header: Header, path: str) -> dict:
    kept = (header.metadata or {}).get(CHECKSUMS_KEY)
    if kept is None:
        raise SafetensorsFileError(f"{path}: saved without checksums (save_file(..., checksums=True)); "
                                   "cannot verify it")
    try:
        sums = json.loads(kept)
    except ValueError:
        raise SafetensorsFileError(f"{path}: its {CHECKSUMS_KEY} metadata is not JSON") from None
    for name in header.entries:
        if name not in sums:
            raise SafetensorsFileError(f"{path}: no checksum kept for tensor {name!r}")
        tensor = tensors[name]
        if tensor.device.type not in ("cpu", "cuda"):  # loaded by safetensors to another device
            tensor = tensor.cpu()
        if f"{_crc_of(tensor):08x}" != sums[name]:
            raise SafetensorsFileError(f"{path}: tensor {name!r} fails its CRC-32 check: the file is corrupt")
    return tensors


def load(data: bytes) -> Dict[str, torch.Tensor]:
    """The tensors of a safetensors file's bytes, as ``safetensors.torch.load``."""
    data = bytes(data)
    if len(data) < 8:
        raise SafetensorsFileError(f"<bytes>: {len(data)} bytes, too short for a safetensors file")
    (n,) = struct.unpack("<Q", data[:8])
    if n > HEADER_LIMIT or 8 + n > len(data):
        raise SafetensorsFileError(f"<bytes>: a header of {n} bytes does not fit in {len(data)} bytes")
    header = Header.parse(data[8:8 + n], "<bytes>", len(data))
    buffer = bytearray(data)
    return {k: _tensor_at(buffer, e, header.data_start) for k, e in header.entries.items()}


def _device_of(device) -> Optional[torch.device]:
    """The device fastpersist loads to (the CPU or a CUDA device), or None
    where safetensors' own functions are to load: any other device (mps,
    xpu, npu, hpu, ...: safetensors knows how each is reached, and says
    what it refuses); an int where the machine's accelerator is not CUDA."""
    if isinstance(device, int) and not isinstance(device, bool):
        accelerator = getattr(getattr(torch, "accelerator", None), "current_accelerator", lambda: None)()
        if accelerator is not None and accelerator.type != "cuda":
            return None
        target = torch.device("cuda", device)
    else:
        try:
            target = torch.device(device)
        except (RuntimeError, TypeError, ValueError):
            return None  # a name torch does not parse: safetensors' own refusal
        if target.type not in ("cpu", "cuda"):
            return None
    if target.type == "cuda" and not torch.cuda.is_available():
        raise RuntimeError(f"device={device!r}: no CUDA device is usable here (torch.cuda.is_available() is False)")
    return target


def _safetensors_own(name: str):
    """safetensors' own load_file or safe_open, whatever the patch has bound
    to the names; ValueError where safetensors is not installed."""
    try:
        import safetensors
        import safetensors.torch as reference
    except ImportError:
        raise ValueError("fastpersist.safetensors loads to the CPU or a CUDA device; other devices are "
                         "safetensors' own, which is not installed") from None
    if name == "safe_open":
        return getattr(safetensors, "_fastpersist_original_safe_open", safetensors.safe_open)
    return getattr(reference, "_fastpersist_original_" + name, getattr(reference, name))


_TORCH_FRAMEWORKS = ("pt", "torch", "pytorch")


class safe_open:  # noqa: N801 - safetensors' name
    """A safetensors file opened for reading parts of it, as
    ``safetensors.safe_open``: ``keys()``, ``metadata()``, ``get_tensor(name)``,
    ``get_slice(name)``; a context manager. Only the header is read when
    opened; each tensor when asked for (the rows a slice of its first
    dimension needs, where that is all it needs). Other frameworks than
    torch ("np", "flax", ...) and other devices than the CPU and CUDA
    ("mps", "xpu", "npu", ...) are handed to safetensors' own safe_open;
    ``backend`` is accepted and ignored (the engine reads).

    On the CPU the file is read in chunks: runs of whole tensors of about
    CHUNK bytes (a larger tensor alone), each read at once, at most once,
    when a tensor of it is first asked for whole; the chunks after the one
    asked for last are read ahead on a thread, within a budget (AHEAD). A
    tensor asked for whole the first time is a view of its chunk with a
    storage of its own; the safe_open lets go of a chunk once each of its
    tensors has been handed out, so its memory lives as long as those
    tensors do, and no longer. Rows of a tensor (a slice), and a tensor
    asked for again, are copies, read from the file where their chunk is
    not held: a slice never reads the chunk around it. So no two tensors
    handed out share memory. safetensors' own safe_open differs there: with
    its default backend (a mapping of the file) a name asked for twice is
    one memory, views of the mapping (writing into one changes the other),
    and only backend="pread" copies. fastpersist copies because its chunks
    are memory of the process, let go of once handed out: holding each for
    a second ask would keep every tensor read until close(), where
    safetensors' mapping is page cache the kernel can take back; and a
    copy keeps one caller's in-place change out of another's tensor."""

    def __new__(cls, filename, framework: str = "pt", device="cpu", backend: Optional[str] = None):
        # numpy, flax, ...; devices other than the CPU and CUDA (mps, xpu, npu, ...): safetensors' own
        if framework not in _TORCH_FRAMEWORKS or _device_of(device) is None:
            original = _safetensors_own("safe_open")
            if original is cls:
                raise ValueError(f"fastpersist.safetensors.safe_open reads torch tensors to the CPU or a CUDA "
                                 f"device, not framework={framework!r}, device={device!r}")
            kwargs = {} if backend is None else {"backend": backend}
            return original(filename, framework=framework, device=device, **kwargs)
        return super().__new__(cls)

    def __init__(self, filename, framework: str = "pt", device="cpu", backend: Optional[str] = None):
        self.path = os.fspath(filename)
        self.device = _device_of(device)
        self._init_reading(READ_AHEAD)
        _open_files.add(self)
        self._fd = os.open(self.path, os.O_RDONLY | os.O_CLOEXEC)
        try:
            self._opened = os.fstat(self._fd)  # which file: a slice read after close() opens the name again
            self._size = self._opened.st_size
            self._header = Header.read(self._fd, self.path, self._size)
        except BaseException:
            os.close(self._fd)
            self._fd = -1  # closed: __del__ must not close the number again (another file may have it by then)
            raise

    def _init_reading(self, read_ahead: bool) -> None:
        self._lock = threading.Lock()  # transformers materializes a shard's tensors from several threads
        self._changed = threading.Condition(self._lock)  # a chunk's read ended, or the file was closed
        self._chunks: Optional[list] = None  # the file's _Chunks in order, made at the first tensor read
        self._chunk_of: Optional[dict] = None  # tensor name -> index of its chunk
        self._handed: set = set()  # names handed out whole, as views
        self._handed_bytes = 0  # their bytes
        self._held = 0  # bytes of chunks being read, or read and not yet wholly handed out
        self._unread = 0  # chunks unread (none: nothing to read ahead, found without a scan)
        self._last = 0  # the chunk a tensor was last asked for from
        self._read_ahead = read_ahead
        self.read_ahead_bytes = AHEAD  # at most this much read ahead and held (a caller may lower it)
        self._wanted: list = []  # chunks asked for, for the reader to read first
        self._reader: Optional[threading.Thread] = None  # reading chunks, while it runs
        self._closing = False
        # the reader thread's; its stop is set by close(): the reader's pass ends at its next piece or buffer
        self._reader_threads = HelperThreads(name="fastpersist-safetensors-reader")

    def __enter__(self) -> "safe_open":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        with self._lock:
            self._closing = True
            reader = self._reader
        # the reader's pass stops at its next piece (page cache) or buffer (engine), not at the end of a
        # run of chunks read ahead (up to AHEAD bytes); an interrupt meanwhile is raised once it has stopped
        self._reader_threads.stop.set()
        if reader is not threading.current_thread():
            self._reader_threads.wait()
        with self._lock:
            self._chunks, self._wanted = None, []  # the tensors handed out keep their own chunks alive
            self._held = 0
            if self._fd >= 0:
                os.close(self._fd)
                self._fd = -1
            self._changed.notify_all()  # threads waiting for a chunk see the file closed

    def __del__(self):
        try:
            self.close()
        except Exception:  # noqa: BLE001 - interpreter shutdown
            pass

    def keys(self) -> list:
        return sorted(self._header.entries)

    def offset_keys(self) -> list:
        return list(self._header.entries)

    def metadata(self) -> Optional[Dict[str, str]]:
        return self._header.metadata

    def _entry(self, name: str) -> _Entry:
        if self._fd < 0:
            raise SafetensorsFileError(f"{self.path}: File is closed")
        entry = self._header.entries.get(name)
        if entry is None:
            raise KeyError(f"File does not contain tensor {name}")
        return entry

    def get_tensor(self, name: str) -> torch.Tensor:
        entry = self._entry(name)
        return self._read(entry, 0, entry.shape[0] if entry.shape else 1)

    def get_tensors(self) -> Dict[str, torch.Tensor]:
        return {k: self.get_tensor(k) for k in self.offset_keys()}

    def get_slice(self, name: str) -> "_Slice":
        return _Slice(self, self._entry(name))

    def _reopened(self) -> "safe_open":
        """This file, open again (a slice indexed after its file was closed,
        as safetensors allows)."""
        again = safe_open.__new__(safe_open, self.path)
        again.path, again.device, again._header = self.path, self.device, self._header
        again._init_reading(False)  # it reads one slice and is closed
        _open_files.add(again)
        again._fd = os.open(self.path, os.O_RDONLY | os.O_CLOEXEC)
        if not same_file(os.fstat(again._fd), self._opened):
            os.close(again._fd)
            again._fd = -1
            raise SafetensorsFileError(f"{self.path}: the file was replaced after it was opened (a slice taken "
                                       "before close() reads the file it was taken from); open it again")
        again._opened, again._size = self._opened, self._size
        return again

    def _read(self, entry: _Entry, first: int, stop: int) -> torch.Tensor:
        """Rows [first, stop) of entry's first dimension (the whole tensor
        for a 0-d one), read from the file into a new tensor on the device."""
        from . import device_io, read_pipeline

        rows = entry.shape[0] if entry.shape else 1
        row_bytes = entry.nbytes // rows if rows else 0
        shape = (stop - first,) + tuple(entry.shape[1:]) if entry.shape else ()
        nbytes = (stop - first) * row_bytes
        if not nbytes:
            return _empty(shape, entry.dtype, self.device)
        offset = self._header.data_start + entry.begin + first * row_bytes
        opts = current_options()
        try:
            if self.device.type == "cpu":
                byte_view = self._cpu_bytes(entry, offset, nbytes, first == 0 and stop == rows, opts)
                if byte_view.data_ptr() % entry.dtype.itemsize == 0:
                    return byte_view.view(entry.dtype).view(shape)
                out = torch.empty(shape, dtype=entry.dtype)  # not at its dtype's alignment in memory
                out.reshape(-1).view(torch.uint8).copy_(byte_view)
                return out
            out = torch.empty(shape, dtype=entry.dtype, device=self.device)
            piece = device_io.Piece(offset, nbytes, device_io.byte_view(out.untyped_storage()))
            with self._descriptor() as fd:
                read_pipeline.read_pieces(fd, self.path, self._size, opts, [piece], offset=offset, nbytes=nbytes)
            return out
        except EOFError:
            raise SafetensorsFileError(f"{self.path}: the file ended inside tensor {entry.name!r}") from None

    @contextlib.contextmanager
    def _descriptor(self):
        """A descriptor of the file of its own, for a read outside the lock: a
        close() from another thread meanwhile cannot hand the number to
        another file under the read."""
        with self._lock:
            if self._fd < 0:
                raise SafetensorsFileError(f"{self.path}: File is closed")
            fd = os.dup(self._fd)
        try:
            yield fd
        finally:
            os.close(fd)

    def _cpu_bytes(self, entry: _Entry, offset: int, nbytes: int, whole: bool, opts) -> torch.Tensor:
        """The file's bytes [offset, offset + nbytes) of entry, as a uint8
        tensor that shares memory with no other tensor handed out: a view of
        the entry's chunk where the whole tensor is asked for the first time
        (read by the safe_open's reader thread: see _reader_loop); else a
        copy, from the chunk where it is read or being read, or else read
        from the file for itself."""
        with self._lock:
            while True:
                if self._fd < 0:
                    raise SafetensorsFileError(f"{self.path}: File is closed")
                if self._chunks is None:
                    self._chunks, self._chunk_of = _chunks_of(self._header)
                    self._unread = len(self._chunks)
                index = self._chunk_of[entry.name]
                chunk = self._chunks[index]
                view = whole and entry.name not in self._handed
                if view:
                    self._last = index
                if chunk.state == _Chunk.READING and chunk.arrived():
                    chunk.state = _Chunk.READ  # the reader's pass copied it and goes on past it
                if chunk.state == _Chunk.READ:
                    piece = self._hand_out(chunk, entry, offset, nbytes, view)
                    own_read = False
                    break
                if chunk.state == _Chunk.UNREAD and view and not chunk.failed:
                    if chunk not in self._wanted:
                        self._wanted.append(chunk)
                    # asked each time round: a reader whose pass failed has stopped, leaving chunks
                    # asked for meanwhile to the next one
                    waits = self._start_reader()
                elif chunk.state == _Chunk.READING:
                    self._start_reader()  # which finds a reader lost to a fork, and its chunks unread
                    waits = chunk.state == _Chunk.READING
                else:
                    waits = False
                if waits:
                    self._changed.wait(_POLL)  # woken when a pass ends; in between, progress is looked at
                    continue
                # rows, or a tensor asked for again, where the chunk is not held: its own bytes only;
                # or a chunk whose read by the reader failed, or with no reader thread to be had:
                # read here (meeting any error in this thread)
                own_read = True
                fd = os.dup(self._fd)  # read outside the lock: a close() meanwhile leaves it its file
                if view:
                    self._claim(chunk)
                break
        if not own_read:  # copied outside the lock; the piece keeps the chunk's memory alive meanwhile
            return piece if view else piece.clone()
        try:
            if view:
                try:
                    buffer = _read_span(fd, self.path, chunk.start, chunk.end - chunk.start, opts)
                except BaseException as exc:
                    with self._lock:
                        self._unclaim(chunk)
                    if not isinstance(exc, EOFError):
                        raise
                    view = False  # the file ends inside the chunk: maybe not inside this tensor
            if not view:
                return torch.frombuffer(_read_span(fd, self.path, offset, nbytes, opts), dtype=torch.uint8)
        finally:
            os.close(fd)
        with self._lock:
            chunk.buffer, chunk.state, chunk.failed = buffer, _Chunk.READ, False
            self._changed.notify_all()
            return self._hand_out(chunk, entry, offset, nbytes, True)

    def _claim(self, chunk: "_Chunk") -> None:
        """chunk is to be read (under the lock)."""
        chunk.state = _Chunk.READING
        self._held += chunk.end - chunk.start
        self._unread -= 1

    def _unclaim(self, chunk: "_Chunk") -> None:
        """chunk's read failed: unread again (under the lock)."""
        chunk.state, chunk.buffer, chunk.progress = _Chunk.UNREAD, None, None
        self._held -= chunk.end - chunk.start
        self._unread += 1
        self._changed.notify_all()

    def _hand_out(self, chunk: "_Chunk", entry: _Entry, offset: int, nbytes: int, view: bool) -> torch.Tensor:
        """A uint8 tensor over bytes [offset, offset + nbytes) of a chunk read
        (under the lock). view: the entry whole, handed out for the first
        time; the chunk is let go of once it was the last of its tensors."""
        piece = torch.frombuffer(chunk.buffer, dtype=torch.uint8, count=nbytes, offset=offset - chunk.start)
        if view:
            self._handed.add(entry.name)
            self._handed_bytes += entry.nbytes
            chunk.left -= entry.nbytes
            if chunk.left == 0:
                chunk.buffer, chunk.state = None, _Chunk.DONE
                self._held -= chunk.end - chunk.start
            self._start_reader()
        return piece

    def _start_reader(self) -> bool:
        """Starts the reader thread where it is not running and has a chunk to
        read (under the lock: it runs once the lock is let go of); whether
        one runs."""
        if self._reader is not None and not self._reader.is_alive():
            self._reader_gone()
        if self._reader is None and not self._closing and self._next_run(take=False):
            reader = self._reader_threads.start(self._reader_loop)
            if reader is None:  # no thread to be had: whoever waits for a chunk reads it itself
                return False
            self._reader = reader
        return self._reader is not None

    def _reader_gone(self, forked: bool = False) -> None:
        """The reader thread is not running, yet was not seen to stop: this is
        a forked child of the process it ran in (under the lock). Its pass is
        lost: its chunks are unread again, for whoever asks next. forked: in
        the child, before any other thread: the reads of consumer threads
        (chunks read with no progress) are lost too."""
        self._reader = None
        for chunk in self._chunks or ():
            if chunk.state != _Chunk.READING or (chunk.progress is None and not forked):
                continue
            if chunk.arrived():
                chunk.state, chunk.progress = _Chunk.READ, None
            else:
                chunk.failed = True  # read by whoever asks for it: not by a reader that may lose it again
                self._unclaim(chunk)

    def _budget(self) -> int:
        """Bytes the reader may hold, read or being read and not handed out:
        growing with the bytes handed out (a file opened for one tensor reads
        one chunk past it), up to AHEAD."""
        return min(self.read_ahead_bytes, CHUNK + 16 * self._handed_bytes)

    def _next_run(self, take: bool) -> list:
        """The chunks for the reader to read next in one pass (under the lock):
        the first chunk asked for and still unread, else the one to read
        ahead (_next_ahead), and the unread chunks after it in the file, as
        many as the budget leaves room for. take: the chunk asked for off the
        list; else only whether there is a run, the first chunk."""
        first = None
        while self._wanted and first is None:
            chunk = self._wanted[0]
            if chunk.state == _Chunk.UNREAD and not chunk.failed:
                first = chunk
                if not take:
                    return [first]
            self._wanted.pop(0)  # or read meanwhile, by a thread whose own read it became
        if first is None:
            first = self._next_ahead() if self._read_ahead else None
            if first is None or not take:
                return [] if first is None else [first]
        run, size = [first], first.end - first.start
        room = self._budget() - self._held
        for i in range(first.index + 1, len(self._chunks) if self._read_ahead else 0):
            chunk = self._chunks[i]
            if chunk.state != _Chunk.UNREAD or chunk.failed or size + chunk.end - chunk.start > room:
                break
            run.append(chunk)
            size += chunk.end - chunk.start
        return run

    def _next_ahead(self) -> Optional["_Chunk"]:
        """The chunk to read ahead next (under the lock): the first unread one
        after the chunk asked for last, going round to the file's start and
        skipping any larger than the budget (maybe only a slice of such a
        tensor is wanted); None where the budget is spent."""
        if not self._unread:  # every hand-out asks: near a large file's end, a scan of all its chunks
            return None
        budget = self._budget()
        chunks = self._chunks
        for i in range(self._last + 1, self._last + 1 + len(chunks)):
            chunk = chunks[i % len(chunks)]
            if chunk.state != _Chunk.UNREAD or chunk.failed or chunk.end - chunk.start > budget:
                continue
            return chunk if self._held + chunk.end - chunk.start <= budget else None
        return None

    def _reader_loop(self) -> None:
        """Reads runs of chunks, each in one pass of the engine (whole buffers
        in flight from start to end; a pass per chunk left the device idle
        between them). A chunk's tensors are handed out as soon as the pass
        has copied it (its progress), before the pass ends. Stops where
        nothing is asked for or left to read ahead, or where a pass fails
        (whoever waits for one of its chunks then reads it, and meets the
        error)."""
        while True:
            with self._lock:
                run = [] if self._closing or self._fd < 0 else self._next_run(take=True)
                if not run:
                    self._reader = None
                    return
                progress, fd = ctypes.c_uint64(0), -1
                for chunk in run:
                    self._claim(chunk)
                    chunk.progress = progress
                try:
                    for chunk in run:
                        chunk.buffer = _new_buffer(chunk.end - chunk.start)
                    buffers = [chunk.buffer for chunk in run]  # alive until the pass ends, whatever is let go of
                    fd = os.dup(self._fd)
                except BaseException:  # noqa: BLE001 - no memory, no descriptor: as a failed pass (below)
                    buffers = None
            failed = buffers is None
            try:
                if not failed:
                    _read_run(fd, self.path, [(ctypes.addressof(b), c.start, c.end - c.start)
                                              for b, c in zip(buffers, run)], progress, current_options(),
                              self._size, self._reader_threads.stop)
            except BaseException:  # noqa: BLE001 - met again by whoever reads the chunk itself (above)
                failed = True
            finally:
                if fd >= 0:
                    os.close(fd)
            with self._lock:
                for chunk in run:
                    if chunk.state == _Chunk.READING:
                        if failed and not chunk.arrived():
                            chunk.failed = True
                            self._unclaim(chunk)
                        else:
                            chunk.state = _Chunk.READ
                    chunk.progress = None
                self._changed.notify_all()
                if failed:
                    self._reader = None
                    return


# every safe_open alive, for a forked child to mend (below)
_open_files: "weakref.WeakSet[safe_open]" = weakref.WeakSet()


def _mend_after_fork() -> None:
    """In a forked child: each safe_open gets a new lock (the parent's may
    have been held by a thread the child does not have) and loses its
    reader and the reads of other threads, whose chunks are read again by
    whoever asks for them."""
    for opened in list(_open_files):
        opened._lock = threading.Lock()
        opened._changed = threading.Condition(opened._lock)
        opened._reader_threads = HelperThreads(name="fastpersist-safetensors-reader")  # the parent's ran there
        with opened._lock:
            opened._reader_gone(forked=True)


os.register_at_fork(after_in_child=_mend_after_fork)


class _Chunk:
    """Tensors that follow one another in a file, read at once: bytes
    [start, end) of the file, how many of them belong to tensors not yet
    handed out (left), the buffer while read or being read and not wholly
    handed out, the progress of the pass reading it, and whether the
    reader's read of it failed."""

    __slots__ = ("index", "start", "end", "left", "state", "buffer", "progress", "failed")
    UNREAD, READING, READ, DONE = range(4)

    def __init__(self, index: int, start: int, end: int):
        self.index, self.start, self.end, self.left = index, start, end, end - start
        self.state, self.buffer = _Chunk.UNREAD, None
        self.progress: Optional[ctypes.c_uint64] = None
        self.failed = False

    def arrived(self) -> bool:
        """Whether the pass reading it has copied all of it."""
        return self.progress is not None and self.progress.value >= self.end


def _chunks_of(header: Header) -> tuple:
    """([_Chunk], {name: index}): the file's tensors in order, cut into runs
    of at most CHUNK bytes (a larger tensor alone); empty tensors in none."""
    chunks: list = []
    index: dict = {}
    base = header.data_start
    for entry in sorted(header.entries.values(), key=lambda e: e.begin):
        if not entry.nbytes:
            continue
        start, end = base + entry.begin, base + entry.end
        if chunks and end - chunks[-1].start <= CHUNK:
            chunks[-1].end = chunks[-1].end + (end - start)
            chunks[-1].left = chunks[-1].end - chunks[-1].start
        else:
            chunks.append(_Chunk(len(chunks), start, end))
        index[entry.name] = len(chunks) - 1
    return chunks, index


CHUNK = 64 << 20  # safe_open hands out runs of whole tensors of about this size as they arrive
AHEAD = 2 << 30  # bytes safe_open reads ahead and holds until they are handed out, at most
_POLL = 0.001  # seconds between looks at a pass's progress, for a thread waiting for a chunk
READ_AHEAD = True  # the chunks after the one asked for last are read while its tensors are handed out
_SMALL_READ = 1 << 20  # below this, one pread through the page cache costs less than an engine's pass


def _new_buffer(nbytes: int):
    """New page-aligned memory of nbytes, as a buffer object (storages made
    over it keep it alive; unmapped when the last reference goes)."""
    import mmap

    memory = mmap.mmap(-1, -(-nbytes // mmap.PAGESIZE) * mmap.PAGESIZE)
    return (ctypes.c_ubyte * nbytes).from_buffer(memory)


def _through_page_cache(fd: int, offset: int, nbytes: int, file_size: int = 0, opts=None) -> bool:
    """Whether to read a span of the file through the page cache: a small
    span (cheaper than an engine's pass), or as the read pipeline judges
    (a file under its SMALL_FILE_BYTES, file_size where given, with no
    engine idle, or a span in the page cache already)."""
    from . import _engine, read_pipeline

    if nbytes < _SMALL_READ or (0 < file_size < read_pipeline.SMALL_FILE_BYTES and not _engine.has_idle(opts, nbytes)):
        return True
    return read_pipeline.is_cached(fd, nbytes, offset)


def _read_span(fd: int, path: str, offset: int, nbytes: int, opts):
    """nbytes of the file at offset in a new buffer (_new_buffer)."""
    owner = _new_buffer(nbytes)
    _read_into(fd, path, [(ctypes.addressof(owner), offset, nbytes)], ctypes.c_uint64(0), opts)
    return owner


def _read_run(fd: int, path: str, extents: list, progress: ctypes.c_uint64, opts, file_size: int = 0,
              stop: Optional[StopSignal] = None) -> None:
    """A pass of a safe_open's reader over a run of chunks (_read_into)."""
    _read_into(fd, path, extents, progress, opts, file_size, stop)


def _read_into(fd: int, path: str, extents: list, progress: ctypes.c_uint64, opts, file_size: int = 0,
               stop: Optional[StopSignal] = None) -> None:
    """(address, offset, nbytes) extents that follow one another in the file
    (of file_size bytes, where given), in new memory, read in one pass,
    progress set as they arrive (each extent's end, once it is in place);
    EOFError where the file ends first; ReadStopped once stop is set."""
    from . import read_pipeline
    from .fileio import prefaulting, reading_engine

    start, end = extents[0][1], extents[-1][1] + extents[-1][2]
    if _through_page_cache(fd, start, end - start, file_size, opts):
        # each extent (a chunk of whole tensors) by the pipeline's page-cache readers, in parallel,
        # populating its fresh pages as they go; its tensors handed out as it lands
        threads = read_pipeline.read_threads(opts)
        for extent in extents:
            read_pipeline.pread_extents(fd, path, [extent], False, threads=threads, populate=True, stop=stop)
            progress.value = extent[1] + extent[2]
        return
    # the buffers are fresh memory: helper threads fault it in ahead of the engine's copies (a 2.2 GB
    # file on a RAM-backed device: 1.13 s with them, 1.92 s without; medians of 6 fresh processes)
    with prefaulting(extents), reading_engine(path, opts, end - start, fd) as (engine, direct_fd):
        copied, _ = engine.read_extents(direct_fd, fd, extents, path, progress=progress,
                                        stop=None if stop is None else stop.word)
    if copied != end - start:
        raise EOFError(path)


class _Slice:
    """A tensor of an open file, read when indexed (``[...]``, ``[:]``, rows,
    any basic index safetensors takes); ``get_shape()``, ``get_dtype()``."""

    def __init__(self, opened: safe_open, entry: _Entry):
        self._file, self._entry = opened, entry

    def get_shape(self) -> list:
        shape = list(self._entry.shape)  # as the header says: a packed dtype's last dimension in values
        packed = _PACKED.get(self.get_dtype(), 1)
        if packed > 1 and shape:
            shape[-1] *= packed
        return shape

    def get_dtype(self) -> str:
        names, _, _ = _dtype_table()
        return names[self._entry.dtype]

    def __len__(self) -> int:
        if not self._entry.shape:
            raise TypeError("len() of a 0-d tensor")
        return self._entry.shape[0]

    def __getitem__(self, index):
        if self._file._fd >= 0:
            try:
                return self._read_rows(index)
            except SafetensorsFileError:
                if self._file._fd >= 0:
                    raise
        # the file was closed after this slice was taken (or while it was being read)
        with self._file._reopened() as again:
            return _Slice(again, self._entry)._read_rows(index)

    def _read_rows(self, index):
        shape = self._entry.shape
        parts = index if isinstance(index, tuple) else (index,)
        first = parts[0] if parts else Ellipsis
        if shape and isinstance(first, slice) and first.step in (None, 1):
            lo, hi, _ = first.indices(shape[0])
            hi = max(lo, hi)
            rows = self._file._read(self._entry, lo, hi)  # only the rows asked for
            rest = (slice(None),) + tuple(parts[1:])
            return rows[rest] if parts[1:] else rows
        whole = self._file._read(self._entry, 0, shape[0] if shape else 1)
        return whole[index]


# ---------------------------------------------------------------------------
# a sharded set, published index last


def save_sharded(state_dict: Dict[str, torch.Tensor], folder, *, max_shard_size="5GB",
                 metadata: Optional[Dict[str, str]] = None, filename_pattern: str = "model{suffix}.safetensors",
                 **options) -> list:
    """Saves state_dict as the shards and index transformers' ``save_pretrained``
    writes (split by ``huggingface_hub.split_torch_state_dict_into_shards``;
    ``model-00001-of-0000N.safetensors`` and ``model.safetensors.index.json``,
    or one ``model.safetensors`` where it fits in one shard), each shard atomic
    and durable, the index written last, atomically and durably, so that a
    crash leaves the folder's previous set or the new one, never a mix.

    Where a shard's name is a file the folder's current index still names, the
    new shard takes a name of its own (``model-<token>-00001-of-0000N...``)
    until the new index is published; the old set's shards are removed after.
    Returns the names of the files written, index last. ``metadata``: each
    shard's (transformers writes ``{"format": "pt"}``, the default here)."""
    import uuid

    from huggingface_hub import split_torch_state_dict_into_shards

    from .atomic_write import write_to_path

    folder = os.fspath(folder)
    metadata = {"format": "pt"} if metadata is None else metadata
    split = split_torch_state_dict_into_shards(state_dict, filename_pattern=filename_pattern,
                                               max_shard_size=max_shard_size)
    index_name = filename_pattern.format(suffix="") + ".index.json"
    index_path = os.path.join(folder, index_name)
    old = _indexed_files(index_path)
    if not split.is_sharded:
        (name, names), = split.filename_to_tensors.items()
        save_file({k: state_dict[k] for k in names}, os.path.join(folder, name), metadata, **options)
        written = [name]
    else:
        token = uuid.uuid4().hex[:8]
        renamed = {name: (name if name not in old else name.replace("-", f"-{token}-", 1))
                   for name in split.filename_to_tensors}
        try:
            for name, names in split.filename_to_tensors.items():
                save_file({k: state_dict[k] for k in names}, os.path.join(folder, renamed[name]), metadata,
                          **options)
            index = {"metadata": dict(split.metadata),
                     "weight_map": {k: renamed[v] for k, v in split.tensor_to_filename.items()}}
            data = (json.dumps(index, indent=2, sort_keys=True) + "\n").encode("utf-8")
            opts = current_options().replace(**options)
            write_to_path(index_path, opts, lambda writer: (writer.write(data), len(data))[1],
                          expected_size=len(data))
        except BaseException:
            for name in renamed.values():  # this attempt's shards: nothing names them
                try:
                    os.unlink(os.path.join(folder, name))
                except FileNotFoundError:
                    pass
            raise
        written = list(renamed.values()) + [index_name]
    if not split.is_sharded and os.path.exists(index_path):
        # one file now: the index naming the old shards goes first, then the shards (a crash between
        # the two leaves the new file and orphaned shards, never an index naming missing files)
        os.unlink(index_path)
    if split.is_sharded:
        old.add(filename_pattern.format(suffix=""))  # a single file of an earlier save, now superseded
    for name in sorted(old - set(written)):  # the previous set, once nothing names it
        try:
            os.unlink(os.path.join(folder, name))
        except FileNotFoundError:
            pass
    return written


def _indexed_files(index_path: str) -> set:
    """The shard files a safetensors index names (empty where there is none)."""
    try:
        with open(index_path, encoding="utf-8") as f:
            return set(json.load(f).get("weight_map", {}).values())
    except (OSError, ValueError, AttributeError):
        return set()
