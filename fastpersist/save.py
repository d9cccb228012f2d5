"""fastpersist.save: torch.save's format and behaviour, written through the
engine, durably and atomically."""
from __future__ import annotations

import errno
import logging
import os
import pickle
import secrets
import stat
from typing import Optional

from . import torch_format
from .options import Options
from .writer import FastFileWriter

log = logging.getLogger("fastpersist")

DEFAULT_PROTOCOL = 2  # torch.serialization.DEFAULT_PROTOCOL


def save(obj, f, pickle_module=pickle, pickle_protocol: int = DEFAULT_PROTOCOL,
         _use_new_zipfile_serialization: bool = True, _disable_byteorder_record: bool = False,
         **options) -> None:
    """Saves ``obj`` like ``torch.save(obj, f, ...)``, in the same format.

    When ``f`` is a path, the checkpoint is streamed through fastpersist's
    engine into a temporary file beside it, made durable (fsync) and renamed
    over ``f``: a failed save leaves any previous file untouched. Other
    targets (file objects, buffers) and ``_use_new_zipfile_serialization=False``
    go to the original ``torch.save``.

    Keyword options (see :class:`fastpersist.Options`) override those of
    ``fastpersist.patch()`` and the ``FASTPERSIST_*`` environment variables.
    """
    from .patching import current_options, original_save

    opts = current_options().replace(**options)
    reason = _not_accelerated_because(f, pickle_module, _use_new_zipfile_serialization)
    if reason:
        log.debug("fastpersist: torch.save to %r goes to the original torch.save: %s", f, reason)
        return original_save()(obj, f, pickle_module, pickle_protocol,
                               _use_new_zipfile_serialization, _disable_byteorder_record)

    import torch.serialization

    torch._C._log_api_usage_once("torch.save")
    torch.serialization._check_dill_version(pickle_module)
    save_to_path(obj, os.fspath(f), opts, pickle_module, pickle_protocol, _disable_byteorder_record)


def _not_accelerated_because(f, pickle_module, use_new_zipfile: bool) -> Optional[str]:
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


def save_to_path(obj, path: str, opts: Options, pickle_module=pickle, pickle_protocol: int = DEFAULT_PROTOCOL,
                 disable_byteorder_record: bool = False) -> int:
    """Writes obj as a torch checkpoint at path; returns its size in bytes."""
    archive = torch_format.archive_name_for(path)
    target = os.path.realpath(path)  # torch.save writes through symlinks
    folder = os.path.dirname(target)
    write_path = target
    if opts.atomic:
        write_path = os.path.join(folder, f".{os.path.basename(target)}.fastpersist-{secrets.token_hex(4)}.tmp")
    try:
        writer = FastFileWriter(write_path, truncate=not opts.atomic, exclusive=opts.atomic, options=opts)
    except OSError as exc:
        raise OSError(exc.errno, f"{exc.strerror} (fastpersist: creating {write_path})", path) from exc
    try:
        size = torch_format.save_records(obj, writer, archive, pickle_module, pickle_protocol,
                                         disable_byteorder_record)
        writer.close()  # waits for every write; fsyncs the file with opts.fsync
        if opts.atomic:
            _keep_mode_of(target, write_path)
            os.replace(write_path, target)
            if opts.fsync:
                _fsync_folder(folder)
    except BaseException as exc:
        writer.abort()
        if opts.atomic:
            _remove_quietly(write_path)
        if isinstance(exc, OSError) and exc.filename == write_path != path:
            # name the file the user asked for; the temporary one is gone
            raise OSError(exc.errno, f"{exc.strerror} (fastpersist: writing {write_path})", path) from exc
        raise
    return size


def _keep_mode_of(target: str, new_file: str) -> None:
    """torch.save truncates an existing file and so keeps its permissions; do the same."""
    try:
        mode = stat.S_IMODE(os.stat(target).st_mode)
    except FileNotFoundError:
        return
    os.chmod(new_file, mode)


def _fsync_folder(folder: str) -> None:
    fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    except OSError as exc:  # some filesystems cannot fsync a folder
        if exc.errno not in (errno.EINVAL, errno.ENOTSUP):
            raise
    finally:
        os.close(fd)


def _remove_quietly(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
