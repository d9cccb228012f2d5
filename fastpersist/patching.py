"""Routes torch.save and torch.load (and safetensors' file functions)
through fastpersist: patch(), unpatch(), is_patched()."""
from __future__ import annotations

import functools
import os
import pickle
import sys
import threading
from typing import Optional

import torch
import torch.serialization

from . import options as _options
from ._torch_api import DEFAULT_PROTOCOL, original_load, original_save
from .options import current_options, from_environment

_lock = threading.RLock()
_original_save = original_save()
_original_load = original_load()

__all__ = ["current_options", "is_patched", "original_load", "original_save", "patch", "safetensors_patched",
           "unpatch"]


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


def patch(*, safetensors: Optional[bool] = None, **options) -> None:
    """Makes torch.save and torch.load (and their torch.serialization names)
    write and read through fastpersist; and, where safetensors is installed,
    ``safetensors.torch.save_file``, ``load_file`` and ``safe_open``
    (fastpersist.safetensors), wherever a module imported before this call
    bound them to its own names (as transformers and accelerate do: a name
    that contains the function's own, such as ``safe_save_file``).

    ``options`` (see :class:`fastpersist.Options`) become the defaults of
    every patched save and load; unset ones come from ``FASTPERSIST_*`` variables.
    ``safetensors``: route safetensors too (default: FASTPERSIST_SAFETENSORS, on).
    Calling it again replaces the options; it is harmless to call twice.

    Args:
        **options: :class:`fastpersist.Options` fields, the defaults of every
            patched ``torch.save`` and ``torch.load`` until the next ``patch``
            or ``unpatch``.

    Raises:
        ValueError: an option is unknown or out of range; nothing is patched.
    """
    opts = from_environment().replace(**options)  # raises on bad options before changing anything
    if safetensors is None:
        safetensors = os.environ.get("FASTPERSIST_SAFETENSORS", "1").strip().lower() not in ("0", "false", "no", "off")
    with _lock:
        _options.set_patched_options(opts)
        torch.save = _fast_save
        torch.serialization.save = _fast_save
        torch.load = _fast_load
        torch.serialization.load = _fast_load
        if safetensors:
            _route_safetensors()
        else:
            _restore_safetensors()


def unpatch() -> None:
    """Restores the original torch.save and torch.load (and safetensors'
    functions); harmless when not patched."""
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
        _restore_safetensors()


def is_patched() -> bool:
    """True while ``torch.save`` and ``torch.load`` (and their
    ``torch.serialization`` names) are fastpersist's."""
    return (torch.save is _fast_save and torch.serialization.save is _fast_save
            and torch.load is _fast_load and torch.serialization.load is _fast_load)


# ---------------------------------------------------------------------------
# safetensors

_bindings: list = []  # (module, name, original, replacement): every import of the functions found so far
_scanned: set = set()  # names of the modules already looked through
_routing = False


def _safetensors_replacements() -> dict:
    """{id(original): (original, replacement)}; {} without safetensors."""
    try:
        import safetensors
        import safetensors.torch as reference
    except ImportError:
        return {}
    from . import safetensors as fast

    pairs = [(getattr(reference, "_fastpersist_original_save_file", reference.save_file), fast.save_file),
             (getattr(reference, "_fastpersist_original_load_file", reference.load_file), fast.load_file),
             (getattr(safetensors, "_fastpersist_original_safe_open", safetensors.safe_open), fast.safe_open)]
    reference._fastpersist_original_save_file = pairs[0][0]
    reference._fastpersist_original_load_file = pairs[1][0]
    safetensors._fastpersist_original_safe_open = pairs[2][0]
    return {id(original): (original, replacement) for original, replacement in pairs}


# modules of safetensors that bind safe_open for another framework (or define it): theirs to keep
_SAFETENSORS_KEEP = ("safetensors._safetensors_rust", "safetensors.numpy", "safetensors.flax", "safetensors.tensorflow",
                     "safetensors.mlx", "safetensors.paddle")


def _find_bindings(pairs: dict) -> None:
    """Looks through the modules loaded since the last look for names bound
    to safetensors' functions or to fastpersist's (a module imported while
    patched holds the latter); each becomes one of _bindings. Modules
    looked through once are not looked through again: patch() and
    unpatch() in a loop cost a dict lookup per module, not a scan."""
    for module_name, module in list(sys.modules.items()):
        if module_name in _scanned:
            continue
        _scanned.add(module_name)
        names = getattr(module, "__dict__", None)
        if not isinstance(names, dict) or not isinstance(module_name, str) or \
                module_name.startswith("fastpersist") or module_name in _SAFETENSORS_KEEP:
            continue
        for name, value in list(names.items()):
            found = pairs.get(id(value))
            if found is not None and (value is found[0] or value is found[1]) and _is_a_binding_of(name, found[0]):
                _bindings.append((module, name, found[0], found[1]))


def _is_a_binding_of(name: str, original) -> bool:
    """Whether a module attribute holding original is an import of it
    (``safe_open``, ``safe_save_file``, ``safe_load_file``), not a variable
    that keeps the original on purpose (``ORIGINAL_SAVE_FILE``,
    safetensors' ``_fastpersist_original_*``)."""
    return original.__name__ in name and not name.startswith("_fastpersist_original_")


def _rebind_safetensors(to_fastpersist: bool) -> bool:
    """Every known binding of safetensors' functions set to fastpersist's
    (or back to the originals); False where safetensors is not installed."""
    replacements = _safetensors_replacements()
    if not replacements:
        return False
    pairs = dict(replacements)  # id of either function -> (original, replacement)
    pairs.update({id(new): (old, new) for old, new in replacements.values()})
    _find_bindings(pairs)
    for module, name, original, replacement in _bindings:
        current, wanted = (original, replacement) if to_fastpersist else (replacement, original)
        if module.__dict__.get(name) is current:
            module.__dict__[name] = wanted
    return True


def _route_safetensors() -> None:
    """Rebinds safetensors' save_file, load_file and safe_open to
    fastpersist's in every loaded module that holds them, safetensors'
    own modules among them (modules imported later take them from there)."""
    global _routing
    _routing = _rebind_safetensors(True) or _routing


def _restore_safetensors() -> None:
    """Puts the originals back wherever fastpersist's are bound, modules
    imported after patch() included."""
    global _routing
    if _routing:
        _routing = False
        _rebind_safetensors(False)


def safetensors_patched() -> bool:
    """Whether safetensors' file functions go through fastpersist."""
    return _routing
