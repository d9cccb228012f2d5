"""Which pickles the fast unpickling paths may hand to CPython's C unpickler.

torch.load(weights_only=True) interprets a checkpoint's pickle with torch's
own unpickler (torch/_weights_only_unpickler.py, read against torch 2.13),
which implements a few opcodes and acts only on the objects it allows.
CPython's C unpickler, restricted to the same few globals, is 3x faster but
executes more: BUILD sets attributes on any object (a function's
__defaults__, for the whole process), SETITEM writes into tensors, a huge
memo index allocates gigabytes, opcodes torch never implemented load.

``admits(pickled)`` is one linear pass over the pickle (in C: the engine's
fp_pickle_scan, ~0.2 us a tensor where this module's Python form,
``admits_here``, takes ~10) that follows each
value's kind (what built it) the way torch's unpickler would, and answers
True only where the pickle is a state dict as torch.save writes it: the
opcodes torch implements, globals among ``GLOBALS`` below, BUILD only of a
new OrderedDict's attributes from a dict, once (see UNBUILT_ORDERED_DICT),
SETITEM(S) only into dicts and
OrderedDicts with keys that are plain values, APPEND(S) only onto lists,
calls only with the arguments torch.save writes (so that no call reads a
tensor's data while the file is still being read into it), memo indices
that come in order. On such a pickle both unpicklers run the same calls on
the same objects: the same result, or the same exception. Anything else
(False) goes to torch's unpickler, which decides and words its refusal:
the scan never refuses a file, it only keeps the fast path from running.
"""
from __future__ import annotations

import collections
import itertools
import pickle
import struct

import torch

from . import _engine

# The kind of each value on the stack: what made it. Plain values are 0 so
# that max() over a tuple's items says whether all are plain.
PLAIN = 0            # int, float, str, bytes, bool, None
PLAIN_TUPLE = 1      # a non-empty tuple of plain values (sizes, strides)
EMPTY_TUPLE = 2
TUPLE = 3            # any other tuple
LIST = 4
DICT = 5
ORDERED_DICT = 6     # an OrderedDict that BUILD may not touch: one already BUILT, or a memo's reference
TENSOR = 7           # _rebuild_tensor_v2's
PARAMETER = 8        # _rebuild_parameter's
STORAGE = 9          # persistent_load's
STORAGE_ID = 10      # ("storage", <storage class>, key, location, numel)
TENSOR_ARGS = 11     # _rebuild_tensor_v2's six arguments as torch.save writes them
PARAMETER_ARGS = 12  # _rebuild_parameter's three
ORDERED_DICT_CLASS = 13
REBUILD_TENSOR = 14
REBUILD_PARAMETER = 15
STORAGE_CLASS = 16
# collections.OrderedDict() as REDUCE made it, and the only reference to it:
# never BUILT, so its __dict__ is empty (nothing else writes there). BUILD
# takes it once and leaves an ORDERED_DICT; PUT memoizes an ORDERED_DICT, so
# no GET brings it back buildable. CPython's BUILD looks __setstate__ up on
# the instance (a first BUILD's state could set one, and a second BUILD
# would call it: the OrderedDict class, whose call drops the state) where
# torch's updates __dict__; on an object BUILT once they agree.
UNBUILT_ORDERED_DICT = 17
_ORDERED_DICTS = (ORDERED_DICT, UNBUILT_ORDERED_DICT)

# GLOBAL's two lines, exactly as they must appear (torch's NAME_MAPPING and
# IMPORT_MAPPING leave these names as they are). TypedStorage and
# UntypedStorage are left out: torch's unpickler resolves them to classes,
# torch's _load to a StorageType, so the two paths would differ.
GLOBALS = {
    b"collections\nOrderedDict\n": ORDERED_DICT_CLASS,
    b"torch._utils\n_rebuild_tensor_v2\n": REBUILD_TENSOR,
    b"torch._utils\n_rebuild_parameter\n": REBUILD_PARAMETER,
}
for _cls in torch._storage_classes:
    if _cls not in (torch.storage.TypedStorage, torch.storage.UntypedStorage):
        GLOBALS[f"{_cls.__module__}\n{_cls.__name__}\n".encode()] = STORAGE_CLASS

_SIZES = (PLAIN_TUPLE, EMPTY_TUPLE)
# what TUPLE makes of items of these kinds (other than all-plain ones)
_TUPLES = {(PLAIN, STORAGE_CLASS, PLAIN, PLAIN, PLAIN): STORAGE_ID}
_TUPLES.update(((TENSOR, PLAIN, hooks), PARAMETER_ARGS) for hooks in _ORDERED_DICTS)
_TUPLES.update(((STORAGE, PLAIN, size, stride, PLAIN, hooks), TENSOR_ARGS)
               for size, stride, hooks in itertools.product(_SIZES, _SIZES, _ORDERED_DICTS))
# REDUCE: (the callable's kind, its arguments' kind) -> the result's kind.
# _rebuild_tensor_v2's seventh argument (neg/conj bits) is left to torch: it
# would call into C++ with a dict whose values could be tensors.
_CALLS = {(ORDERED_DICT_CLASS, EMPTY_TUPLE): UNBUILT_ORDERED_DICT,
          (REBUILD_TENSOR, TENSOR_ARGS): TENSOR,
          (REBUILD_PARAMETER, PARAMETER_ARGS): PARAMETER}

# CPython's BUILD calls __setstate__ where the object has one; torch's
# updates __dict__. They agree on an OrderedDict only while it has none: its
# class here (a new one's __dict__ is empty, and UNBUILT_ORDERED_DICT keeps
# BUILD to new ones).
_BUILD_ORDERED_DICT = not hasattr(collections.OrderedDict(), "__setstate__")


def _tuple_kind(items: list) -> int:
    if not items:
        return EMPTY_TUPLE
    if max(items) == PLAIN:
        return PLAIN_TUPLE
    return _TUPLES.get(tuple(items), TUPLE)


_BINPUT, _BINGET, _BINUNICODE, _MARK = pickle.BINPUT[0], pickle.BINGET[0], pickle.BINUNICODE[0], pickle.MARK[0]
_BININT1, _BININT2, _BININT, _LONG1 = pickle.BININT1[0], pickle.BININT2[0], pickle.BININT[0], pickle.LONG1[0]
_TUPLE, _TUPLE1, _TUPLE2, _TUPLE3 = pickle.TUPLE[0], pickle.TUPLE1[0], pickle.TUPLE2[0], pickle.TUPLE3[0]
_REDUCE, _BINPERSID, _GLOBAL, _BUILD = pickle.REDUCE[0], pickle.BINPERSID[0], pickle.GLOBAL[0], pickle.BUILD[0]
_NEWFALSE, _NEWTRUE, _NONE, _BINFLOAT = pickle.NEWFALSE[0], pickle.NEWTRUE[0], pickle.NONE[0], pickle.BINFLOAT[0]
_EMPTY_TUPLE, _EMPTY_LIST, _EMPTY_DICT = pickle.EMPTY_TUPLE[0], pickle.EMPTY_LIST[0], pickle.EMPTY_DICT[0]
_SETITEM, _SETITEMS, _APPEND, _APPENDS = pickle.SETITEM[0], pickle.SETITEMS[0], pickle.APPEND[0], pickle.APPENDS[0]
_LONG_BINPUT, _LONG_BINGET, _SHORT_BINSTRING = pickle.LONG_BINPUT[0], pickle.LONG_BINGET[0], pickle.SHORT_BINSTRING[0]
_STOP = pickle.STOP[0]
_PLAIN_OPS = {_BININT1: 1, _BININT2: 2, _BININT: 4, _BINFLOAT: 8, _NEWFALSE: 0, _NEWTRUE: 0, _NONE: 0}
_u32 = struct.Struct("<I").unpack_from


# GLOBALS as fp_pickle_scan takes them: [kind, length, name] each
_GLOBALS_TABLE = b"".join(bytes((kind, len(name))) + name for name, kind in GLOBALS.items())


def admits(pickled) -> bool:
    """True where the C unpickler may unpickle ``pickled`` in torch's place
    (see the module's note); never raises but MemoryError. The engine's C
    scan, which tests/test_state_pickle.py holds to admits_here's decisions;
    for a small pickle in a process that has not loaded the engine, the
    Python form (what loading the engine's module would cost scans ~70
    tensors)."""
    if len(pickled) < SMALL_PICKLE and not _engine.loaded():
        return admits_here(pickled)
    return _engine.pickle_scan(pickled, _GLOBALS_TABLE, _BUILD_ORDERED_DICT)


SMALL_PICKLE = 8 << 10  # ~70 tensors of a state dict


def admits_here(pickled: bytes) -> bool:
    """admits in Python: the rules as written above, decision for decision."""
    try:
        return _admits(pickled)
    except (IndexError, ValueError, struct.error):  # a stack or the data ran out: torch's unpickler decides
        return False


def _admits(data: bytes) -> bool:
    if data[:2] != b"\x80\x02":  # torch saves protocol 2, and warns on others: let it
        return False
    end = len(data)
    pos = 2
    stack: list = []   # the kinds on the stack above the last MARK (torch's unpickler sees no further)
    marks: list = []   # the stacks below each open MARK
    memo: list = []    # the kind stored at each memo index
    push = stack.append
    while pos < end:
        op = data[pos]
        pos += 1
        # the most frequent opcodes first (a state dict: 35 per tensor, a quarter of them PUTs)
        if op == _LONG_BINPUT or op == _BINPUT:
            if op == _LONG_BINPUT:
                index = _u32(data, pos)[0]
                pos += 4
            else:
                index = data[pos]
                pos += 1
            # torch.save numbers its memo entries 0, 1, 2...: a later index
            # would make the C unpickler grow its memo to it (GBs for 2**28)
            kind = stack[-1]
            if kind == UNBUILT_ORDERED_DICT:  # a second reference: never BUILT through
                kind = ORDERED_DICT
            if index == len(memo):
                memo.append(kind)
            elif index < len(memo):
                memo[index] = kind
            else:
                return False
        elif op == _BININT1:
            pos += 1
            push(PLAIN)
        elif op == _BINGET:
            push(memo[data[pos]])
            pos += 1
        elif op == _LONG_BINGET:
            push(memo[_u32(data, pos)[0]])
            pos += 4
        elif op == _BINUNICODE:
            pos += 4 + _u32(data, pos)[0]
            if pos > end:
                return False
            push(PLAIN)
        elif op == _MARK:
            marks.append(stack)
            stack = []
            push = stack.append
        elif op in _PLAIN_OPS:
            pos += _PLAIN_OPS[op]
            push(PLAIN)
        elif op == _TUPLE:
            items = stack
            stack = marks.pop()
            push = stack.append
            push(_tuple_kind(items))
        elif op == _TUPLE1 or op == _TUPLE2 or op == _TUPLE3:
            n = op - _TUPLE1 + 1
            if len(stack) < n:
                return False
            items = stack[-n:]
            del stack[-n:]
            push(_tuple_kind(items))
        elif op == _REDUCE:
            args = stack.pop()
            kind = _CALLS.get((stack[-1], args))
            if kind is None:
                return False
            stack[-1] = kind
        elif op == _EMPTY_TUPLE:
            push(EMPTY_TUPLE)
        elif op == _BINPERSID:
            if stack[-1] != STORAGE_ID:
                return False
            stack[-1] = STORAGE
        elif op == _GLOBAL:
            first = data.index(b"\n", pos)
            second = data.index(b"\n", first + 1) + 1
            kind = GLOBALS.get(data[pos:second])
            if kind is None:
                return False
            pos = second
            push(kind)
        elif op == _SETITEMS:
            items = stack
            stack = marks.pop()
            push = stack.append
            if stack[-1] not in (DICT, ORDERED_DICT, UNBUILT_ORDERED_DICT) or len(items) % 2:
                return False
            if items and max(items[0::2]) != PLAIN:  # keys: comparing plain values reads no tensor
                return False
        elif op == _SETITEM:
            if len(stack) < 3 or stack[-3] not in (DICT, ORDERED_DICT, UNBUILT_ORDERED_DICT) or stack[-2] != PLAIN:
                return False
            del stack[-2:]
        elif op == _EMPTY_DICT:
            push(DICT)
        elif op == _EMPTY_LIST:
            push(LIST)
        elif op == _APPEND:
            if len(stack) < 2 or stack[-2] != LIST:
                return False
            stack.pop()
        elif op == _APPENDS:
            stack = marks.pop()
            push = stack.append
            if stack[-1] != LIST:
                return False
        elif op == _BUILD:
            if not (_BUILD_ORDERED_DICT and len(stack) >= 2 and stack[-2] == UNBUILT_ORDERED_DICT
                    and stack[-1] == DICT):
                return False
            stack.pop()
            stack[-1] = ORDERED_DICT
        elif op == _SHORT_BINSTRING or op == _LONG1:
            pos += 1 + data[pos]
            if pos > end:
                return False
            push(PLAIN)
        elif op == _STOP:
            return bool(stack) and not marks
        else:  # an opcode torch's unpickler does not implement, or NEWOBJ, EMPTY_SET, PROTO again: torch's
            return False
    return False
