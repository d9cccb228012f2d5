"""Python's cyclic garbage collector held off while fastpersist builds many
objects that cannot form cycles worth collecting (a checkpoint's index
entries, tensors, the dicts that hold them).

Each collection of the oldest generation walks every object the process
holds (all of torch's, after its import), and allocating ~6 objects per
tensor sets one off every few thousand tensors: a 10,000-tensor load took
49 us a tensor with the collector on and 22 with it held off here. The
collections are not lost, only not run in the middle: the objects made are
counted as usual once it is back on.

Only code of fastpersist's own runs while it is held off (never a caller's
__reduce__ or __setstate__, which could make garbage in cycles). Pauses
nest and may overlap across threads: the collector comes back on when the
last one ends, and only if it was on when the first began (a caller who
turned it off keeps it off).
"""
from __future__ import annotations

import contextlib
import gc
import os
import threading

_lock = threading.Lock()
_depth = 0
_was_enabled = False


@contextlib.contextmanager
def paused():
    global _depth, _was_enabled
    with _lock:
        if _depth == 0:
            _was_enabled = gc.isenabled()
            gc.disable()
        _depth += 1
    try:
        yield
    finally:
        with _lock:
            _depth -= 1
            if _depth == 0 and _was_enabled:
                gc.enable()


def _after_fork_in_child() -> None:
    # the pausing thread is not in the child: its pause would never end there
    global _depth, _lock
    _lock = threading.Lock()
    if _depth:
        _depth = 0
        if _was_enabled:
            gc.enable()


os.register_at_fork(after_in_child=_after_fork_in_child)
