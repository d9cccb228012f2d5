"""The Lightning CheckpointIO plugins, built on whichever Lightning package
provides the base classes (``lightning`` or ``pytorch_lightning``, whose
Trainers check isinstance against their own).

Lightning's own TorchCheckpointIO writes each checkpoint into a BytesIO and
then the bytes through fsspec, and loads from an fsspec file object: the
patched ``torch.save``/``torch.load`` never see a path, so they cannot help.
These plugins hand local paths to fastpersist (remote URLs still go to
Lightning's plugin, unchanged).
"""
from __future__ import annotations

import importlib
import os
import shutil
import threading
from typing import Any, Optional

from ..async_save import SaveHandle, save_async
from ..load import load
from ..options import Options
from ..save_api import save


def _local(path) -> str:
    """A local path as a file name (Lightning's local protocol also takes file:// URLs)."""
    path = os.fspath(path)
    return path[len("file://"):] if path.startswith("file://") else path


def build(CheckpointIO, TorchCheckpointIO, is_local, module: str) -> tuple:
    """(FastPersistCheckpointIO, AsyncFastPersistCheckpointIO) subclassing
    CheckpointIO, named as attributes of `module` (so that they pickle)."""

    class FastPersistCheckpointIO(CheckpointIO):
        """Saves with ``fastpersist.save`` (atomic, durable, through the
        engine) and loads with ``fastpersist.load``; keyword options are
        fastpersist's (``engine``, ``fsync``, ...). Remote paths go to
        Lightning's TorchCheckpointIO."""

        def __init__(self, **options: Any):
            super().__init__()
            Options().replace(**options)  # a bad option is refused here, not at the first save
            self.options = options
            self._remote = TorchCheckpointIO()

        def save_checkpoint(self, checkpoint: dict, path, storage_options: Optional[Any] = None) -> None:
            if storage_options is not None:
                raise TypeError(f"`Trainer.save_checkpoint(..., storage_options=...)` is not supported by "
                                f"{type(self).__name__}")
            if not is_local(path):
                return self._remote.save_checkpoint(checkpoint, path)
            path = _local(path)
            folder = os.path.dirname(path)
            if folder:
                os.makedirs(folder, exist_ok=True)
            self._save(checkpoint, path)

        def _save(self, checkpoint: dict, path: str) -> None:
            save(checkpoint, path, **self.options)

        def load_checkpoint(self, path, map_location: Optional[Any] = "cpu",
                            weights_only: Optional[bool] = None) -> dict:
            """map_location: to the CPU by default, as Lightning's TorchCheckpointIO loads."""
            if not is_local(path):
                return self._remote.load_checkpoint(path, map_location=map_location, weights_only=weights_only)
            path = _local(path)
            if not os.path.exists(path):
                raise FileNotFoundError(f"Checkpoint file not found: {path}")
            return load(path, map_location=map_location, weights_only=weights_only)

        def remove_checkpoint(self, path) -> None:
            if not is_local(path):
                return self._remote.remove_checkpoint(path)
            path = _local(path)
            if os.path.isdir(path) and not os.path.islink(path):
                shutil.rmtree(path)
            elif os.path.lexists(path):
                os.unlink(path)

    class AsyncFastPersistCheckpointIO(FastPersistCheckpointIO):
        """Saves with ``fastpersist.save_async``: the checkpoint's tensors are
        copied before ``save_checkpoint`` returns (training may change them
        at once) and written in the background. A failed background save is
        raised by the next call of this plugin, and by ``teardown``, which
        Lightning calls at the end of fit and which waits for every save.
        Loading or removing a path waits for the saves to it first."""

        def __init__(self, **options: Any):
            super().__init__(**options)
            self._lock = threading.Lock()
            self._pending: list[SaveHandle] = []

        def __getstate__(self) -> dict:  # a spawned worker gets the settings, not this process's saves
            state = dict(self.__dict__)
            del state["_lock"]
            state["_pending"] = []
            return state

        def __setstate__(self, state: dict) -> None:
            self.__dict__.update(state)
            self._lock = threading.Lock()

        def _save(self, checkpoint: dict, path: str) -> None:
            self._raise_failures()
            handle = save_async(checkpoint, path, **self.options)
            with self._lock:
                self._pending.append(handle)

        def _raise_failures(self, wait: bool = False, path: Optional[str] = None) -> None:
            """Waits for the pending saves (all, or those to path) where asked;
            drops the finished ones and raises the first failure among them."""
            with self._lock:
                handles = list(self._pending)
            target = os.path.realpath(path) if path is not None else None
            error = None
            for handle in handles:
                waited = wait and (target is None or os.path.realpath(handle.path) == target)
                if not (waited or handle.done()):
                    continue
                try:
                    handle.wait()
                except BaseException as exc:  # noqa: BLE001 - the first one is raised below
                    error = error or exc
                with self._lock:
                    if handle in self._pending:
                        self._pending.remove(handle)
            if error is not None:
                raise error

        def load_checkpoint(self, path, map_location: Optional[Any] = "cpu",
                            weights_only: Optional[bool] = None) -> dict:
            if is_local(path):
                self._raise_failures(wait=True, path=_local(path))
            return super().load_checkpoint(path, map_location=map_location, weights_only=weights_only)

        def remove_checkpoint(self, path) -> None:
            if is_local(path):
                self._raise_failures(wait=True, path=_local(path))
            super().remove_checkpoint(path)

        def teardown(self) -> None:
            self._raise_failures(wait=True)
            super().teardown()

    for cls in (FastPersistCheckpointIO, AsyncFastPersistCheckpointIO):
        cls.__module__, cls.__qualname__ = module, cls.__name__
    return FastPersistCheckpointIO, AsyncFastPersistCheckpointIO


def for_fabric(fabric: str, module: str, package: str, extra: str) -> tuple:
    """The plugins on the base classes of `fabric` (``lightning.fabric``, or
    ``lightning_fabric`` for pytorch_lightning), named in `module`."""
    try:
        checkpoint_io = importlib.import_module(f"{fabric}.plugins.io.checkpoint_io")
        torch_io = importlib.import_module(f"{fabric}.plugins.io.torch_io")
        cloud_io = importlib.import_module(f"{fabric}.utilities.cloud_io")
    except ImportError as exc:
        raise ImportError(f"{module} needs the `{package}` package (pip install 'fastpersist[{extra}]')") from exc
    return build(checkpoint_io.CheckpointIO, torch_io.TorchCheckpointIO, cloud_io._is_local_file_protocol, module)
