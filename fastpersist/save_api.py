"""``fastpersist.save`` as users call it (and the patched ``torch.save``):
the top of the save stack. It routes each call to the layer that does the
work — one process's atomic save (fastpersist.save, the module), a group's
partitioned save (fastpersist.distributed) or the original ``torch.save`` —
and lets earlier ``save_async`` calls to the same file land first, so the
newer checkpoint is the one that stays."""
from __future__ import annotations

import importlib
import logging
import os
import pickle

from . import _torch_api
from .async_save import wait_for_saves_to
from .distributed import save_partitioned
from .options import current_options

log = logging.getLogger("fastpersist")

# the module, looked up at call time (tests replace its functions); the
# package's attribute "save" is this file's function
_single = importlib.import_module(".save", __package__)


def save(obj, f, pickle_module=pickle, pickle_protocol: int = _torch_api.DEFAULT_PROTOCOL,
         _use_new_zipfile_serialization: bool = True, _disable_byteorder_record: bool = False,
         *, group=None, **options) -> None:
    """Saves ``obj`` like ``torch.save(obj, f, ...)``, in the same format.

    When ``f`` is a path, the checkpoint is streamed through fastpersist's
    engine into a temporary file beside it, made durable (fsync) and renamed
    over ``f``: a failed save leaves any previous file untouched. When ``f``
    is a file object (a ``BytesIO``, an open file, anything with ``write``),
    the same bytes torch.save would write there are planned by fastpersist
    (its pickle writer for plain data) and written through ``f.write`` from
    where ``f`` stands, then ``f.flush()``, as torch.save does: no engine, and
    the stream's durability stays the caller's. ``_use_new_zipfile_serialization=False``
    goes to the original ``torch.save``.

    ``group`` (a torch.distributed process group, or ``torch.distributed.group.WORLD``):
    every rank of it calls save with the same state, and each writes a
    disjoint, balanced share of the one file (see fastpersist.distributed);
    a failure on any rank fails the save on every rank.

    Keyword options (see :class:`fastpersist.Options`) override those of
    ``fastpersist.patch()`` and the ``FASTPERSIST_*`` environment variables.

    Args:
        obj: what to save: a state dict, a checkpoint dict, any object
            ``torch.save`` takes. Tensors on a GPU are streamed from the device.
        f: the destination: a ``str`` or ``os.PathLike`` path (through the
            engine), or a file object (through its ``write``).
        pickle_module: as ``torch.save``'s; one without a ``Pickler`` goes to
            the original ``torch.save``.
        pickle_protocol: as ``torch.save``'s.
        _use_new_zipfile_serialization: as ``torch.save``'s; ``False`` goes to
            the original ``torch.save``.
        _disable_byteorder_record: as ``torch.save``'s.
        group: a ``torch.distributed`` process group whose ranks all save the
            same state into the one file, or None.
        **options: :class:`fastpersist.Options` fields for this call
            (``engine``, ``buffer_size``, ``fsync``, ``atomic``, ...).

    Raises:
        ValueError: an option is unknown or out of range, or a setting of
            torch's the format cannot honour (``storage_alignment`` > 65536).
        OSError: the write failed; carries errno, the destination path, the
            engine, the operation and the file offset. The previous file is
            untouched (with ``atomic``, the default) and no temporary is left.
        TypeError: ``group`` was given with a target that is not a path.
        fastpersist.distributed.PartitionedSaveError: with ``group``, a step
            failed on some rank; raised on every rank
            (:class:`~fastpersist.distributed.ReplicaMismatchError` when the
            ranks' tensors differ).
        Exception: whatever torch's pickling of ``obj`` raises, unchanged.

    Guarantees: the file is byte for byte what ``torch.save`` writes but the
    random serialization id; with the defaults, the destination names the old
    or the new complete checkpoint at every instant, and the new one is
    durable (file and folder fsynced) when ``save`` returns.
    """
    opts = current_options().replace(**options)
    reason = _single.not_accelerated_because(f, pickle_module, _use_new_zipfile_serialization)
    if group is not None:
        # A refusal on one rank still goes through the ranks' exchange: every rank fails, none hangs.
        refusal = TypeError(f"fastpersist.save(group=...) writes checkpoints to paths; {f!r}: {reason}") \
            if reason else None
        path = os.fspath(f) if isinstance(f, (str, os.PathLike)) else repr(f)
        if refusal is None:
            wait_for_saves_to(path)
        save_partitioned(obj, path, group, opts, pickle_module, pickle_protocol, _disable_byteorder_record, refusal)
        return
    if reason and not isinstance(f, (str, os.PathLike)):
        stream_reason = _single.stream_not_accelerated_because(f, pickle_module, _use_new_zipfile_serialization)
        if stream_reason is None:
            _single.save_to_stream(obj, f, pickle_module, pickle_protocol, _disable_byteorder_record)
            return
        reason = stream_reason
    if reason:
        log.debug("fastpersist: torch.save to %r goes to the original torch.save: %s", f, reason)
        return _torch_api.original_save()(obj, f, pickle_module, pickle_protocol,
                                          _use_new_zipfile_serialization, _disable_byteorder_record)
    path = os.fspath(f)
    wait_for_saves_to(path)  # an earlier save_async to this file lands first, never over this one
    _single.save_to_path(obj, path, opts, pickle_module, pickle_protocol, _disable_byteorder_record)
