"""Routes torch.save and torch.load through fastpersist: patch(), unpatch(), is_patched()."""
from __future__ import annotations

import functools
import pickle
import threading

import torch
import torch.serialization

from . import options as _options
from ._torch_api import DEFAULT_PROTOCOL, original_load, original_save
from .options import current_options, from_environment

_lock = threading.RLock()
_original_save = original_save()
_original_load = original_load()

__all__ = ["current_options", "is_patched", "original_load", "original_save", "patch", "unpatch"]


@functools.wraps(_original_save)
def _fast_save(obj, f, pickle_module=pickle, pickle_protocol=DEFAULT_PROTOCOL,
               _use_new_zipfile_serialization=True, _disable_byteorder_record=False):
    from .save_api import save

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

    Args:
        **options: :class:`fastpersist.Options` fields, the defaults of every
            patched ``torch.save`` and ``torch.load`` until the next ``patch``
            or ``unpatch``.

    Raises:
        ValueError: an option is unknown or out of range; nothing is patched.
    """
    opts = from_environment().replace(**options)  # raises on bad options before changing anything
    with _lock:
        _options.set_patched_options(opts)
        torch.save = _fast_save
        torch.serialization.save = _fast_save
        torch.load = _fast_load
        torch.serialization.load = _fast_load


def unpatch() -> None:
    """Restores the original torch.save and torch.load; harmless when not patched."""
    with _lock:
        _options.set_patched_options(None)
        if torch.save is _fast_save:
            torch.save = _original_save
        if torch.serialization.save is _fast_save:
            torch.serialization.save = _original_save
        if torch.load is _fast_load:
            torch.load = _original_load
        if torch.serialization.load is _fast_load:
            torch.serialization.load = _original_load


def is_patched() -> bool:
    """True while ``torch.save`` and ``torch.load`` (and their
    ``torch.serialization`` names) are fastpersist's."""
    return (torch.save is _fast_save and torch.serialization.save is _fast_save
            and torch.load is _fast_load and torch.serialization.load is _fast_load)
