"""One process's checkpoint at a path: torch.save's format and behaviour,
written through the engine, durably and atomically (a locked temporary
renamed over the file), or in place where no temporary can stand in for it.
The public ``fastpersist.save``, which also dispatches group saves and
waits for earlier asynchronous ones, is in save_api, above this."""
from __future__ import annotations

import logging
import os
import pickle
from typing import Optional

from . import _torch_api, torch_format
from .atomic_write import write_to_path
from .options import Options

log = logging.getLogger("fastpersist")

DEFAULT_PROTOCOL = _torch_api.DEFAULT_PROTOCOL


def not_accelerated_because(f, pickle_module, use_new_zipfile: bool) -> Optional[str]:
    """Why a torch.save call must go to the original, or None."""
    if not use_new_zipfile:
        return "the legacy format was asked for"
    if not isinstance(f, (str, os.PathLike)):
        return "the target is not a path"
    path = os.fspath(f)
    if not isinstance(path, str):
        return "the path is not a str"
    if not torch_format.archive_name_for(path):
        return "torch refuses this file name"
    parent = os.path.dirname(path)
    if parent and not os.path.isdir(parent):
        return "the parent folder does not exist"  # torch raises its own error
    if os.path.isdir(path):
        return "the path is a folder"
    if not hasattr(pickle_module, "Pickler"):
        return "the pickle module has no Pickler"
    return None


def stream_not_accelerated_because(f, pickle_module, use_new_zipfile: bool) -> Optional[str]:
    """Why a torch.save call to a file object must go to the original, or None."""
    if not use_new_zipfile:
        return "the legacy format was asked for"
    if not callable(getattr(f, "write", None)):
        return "the target has no callable write()"  # torch raises its own error
    if not hasattr(pickle_module, "Pickler"):
        return "the pickle module has no Pickler"
    if not _torch_api.stream_save_applies():
        return "torch's skip_data or a fake-tensor mode is in effect"
    return None


def save_to_stream(obj, f, pickle_module=pickle, pickle_protocol: int = DEFAULT_PROTOCOL,
                   disable_byteorder_record: bool = False) -> int:
    """Writes obj as a torch checkpoint into the file object f, from where
    it stands, through ``f.write`` (no engine: the stream is the caller's),
    then flushes it as torch.save does; returns the bytes written. The
    pickle and the records are planned before the first write."""
    plan = torch_format.CheckpointPlan.for_stream(obj, pickle_module, pickle_protocol, disable_byteorder_record)
    size = torch_format.write_plan(plan, torch_format.StreamSink(f))
    flush = getattr(f, "flush", None)
    if callable(flush):
        flush()
    return size


def save_to_path(obj, path: str, opts: Options, pickle_module=pickle, pickle_protocol: int = DEFAULT_PROTOCOL,
                 disable_byteorder_record: bool = False) -> int:
    """Writes obj as a torch checkpoint at path; returns its size in bytes."""
    plan = torch_format.CheckpointPlan.for_path(obj, path, pickle_module, pickle_protocol,
                                                disable_byteorder_record)
    return write_plan_to_path(plan, path, opts)


def write_plan_to_path(plan: torch_format.CheckpointPlan, path: str, opts: Options,
                       target: Optional[str] = None) -> int:
    """Writes a planned checkpoint at path (errors name it), atomically and
    durably as opts say; returns its size in bytes. target: path resolved
    already (save_async resolves it when called, not when written)."""
    return write_to_path(path, opts, lambda writer: torch_format.write_plan(plan, writer), target, plan.size)


