"""Routes torch.save and torch.load through fastpersist: patch(), unpatch(), is_patched()."""
from __future__ import annotations

import functools
import pickle
import threading
from typing import Callable, Optional

import torch
import torch.serialization

from .options import Options, from_environment

_lock = threading.RLock()
# With the source patch (patches/) applied, torch.serialization.save itself
# calls fastpersist and keeps torch's own body as _fastpersist_vanilla_save.
_original_save: Callable = getattr(torch.serialization, "_fastpersist_vanilla_save", torch.serialization.save)
if getattr(_original_save, "__fastpersist__", False):  # module re-import: keep the true original
    _original_save = _original_save.__wrapped__
_original_load: Callable = torch.serialization.load
if getattr(_original_load, "__fastpersist__", False):
    _original_load = _original_load.__wrapped__
_patched_options: Optional[Options] = None


def original_save() -> Callable:
    """torch.save as it was before fastpersist patched it."""
    return _original_save


def original_load() -> Callable:
    """torch.load as it was before fastpersist patched it."""
    return _original_load


def current_options() -> Options:
    """Options of the last patch(), else the environment's."""
    return _patched_options if _patched_options is not None else from_environment()


@functools.wraps(_original_save)
def _fast_save(obj, f, pickle_module=pickle, pickle_protocol=torch.serialization.DEFAULT_PROTOCOL,
               _use_new_zipfile_serialization=True, _disable_byteorder_record=False):
    from .save import save

    return save(obj, f, pickle_module, pickle_protocol, _use_new_zipfile_serialization, _disable_byteorder_record)


_fast_save.__fastpersist__ = True


@functools.wraps(_original_load)
def _fast_load(f, map_location=None, pickle_module=None, *, weights_only=None, mmap=None, **pickle_load_args):
    from .load import load

    return load(f, map_location, pickle_module, weights_only=weights_only, mmap=mmap, **pickle_load_args)


_fast_load.__fastpersist__ = True


def patch(**options) -> None:
    """Makes torch.save and torch.load (and their torch.serialization names)
    write and read through fastpersist.

    ``options`` (see :class:`fastpersist.Options`) become the defaults of
    every patched save and load; unset ones come from ``FASTPERSIST_*`` variables.
    Calling it again replaces the options; it is harmless to call twice.
    """
    global _patched_options
    opts = from_environment().replace(**options)  # raises on bad options before changing anything
    with _lock:
        _patched_options = opts
        torch.save = _fast_save
        torch.serialization.save = _fast_save
        torch.load = _fast_load
        torch.serialization.load = _fast_load


def unpatch() -> None:
    """Restores the original torch.save and torch.load; harmless when not patched."""
    global _patched_options
    with _lock:
        _patched_options = None
        if torch.save is _fast_save:
            torch.save = _original_save
        if torch.serialization.save is _fast_save:
            torch.serialization.save = _original_save
        if torch.load is _fast_load:
            torch.load = _original_load
        if torch.serialization.load is _fast_load:
            torch.serialization.load = _original_load


def is_patched() -> bool:
    return (torch.save is _fast_save and torch.serialization.save is _fast_save
            and torch.load is _fast_load and torch.serialization.load is _fast_load)
