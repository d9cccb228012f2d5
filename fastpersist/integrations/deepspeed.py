"""A DeepSpeed CheckpointEngine backed by fastpersist.

DeepSpeed's own TorchCheckpointEngine calls ``torch.save(path,
_use_new_zipfile_serialization=...)``; the patch routes that already where
the zip format is asked for, but a commit there means nothing: the files
are neither fsynced nor known to be complete. Here every file is written
by ``fastpersist.save`` (atomic, durable), and ``commit(tag)`` returns
only once every file of the tag is durable.

Install it on an initialised engine, before its first save::

    engine, *_ = deepspeed.initialize(...)
    engine.checkpoint_engine = FastPersistCheckpointEngine(asynchronous=True)

``asynchronous=True`` saves with ``fastpersist.save_async``: each file's
tensors are copied before ``save`` returns, training goes on while they are
written, and DeepSpeed commits the tag (then writes ``latest``) at the next
optimizer step, waiting only for what is still being written. A failed
write is raised by that commit.
"""
from __future__ import annotations

import os
from typing import Optional

from deepspeed.runtime.checkpoint_engine.checkpoint_engine import CheckpointCommitInfo, CheckpointEngine

from ..async_save import SaveHandle, save_async, wait_for_saves_to
from ..load import load
from ..options import Options
from ..save_api import save

ENGINE_NAME = "FastPersistCheckpointEngine"


class FastPersistCheckpointEngine(CheckpointEngine):
    """Saves and loads DeepSpeed checkpoints through fastpersist; keyword
    options are fastpersist's (``engine``, ``fsync``, ...)."""

    def __init__(self, config_params=None, *, asynchronous: bool = False, **options):
        super().__init__(config_params)
        self.name = ENGINE_NAME
        self.asynchronous = asynchronous
        Options().replace(**options)  # a bad option is named now, not at the first save
        self.options = options
        self._commit_info: Optional[CheckpointCommitInfo] = None
        self._pending: list[SaveHandle] = []

    def create(self, info: CheckpointCommitInfo) -> None:
        if self._commit_info is not None:  # a tag still uncommitted: it lands first
            self.commit(self._commit_info)
        self._commit_info = info

    def save(self, state_dict, path: str) -> None:
        if self.asynchronous:
            self._pending.append(save_async(state_dict, path, **self.options))
        else:
            save(state_dict, path, **self.options)

    def load(self, path: str, map_location=None):
        wait_for_saves_to(path)
        return load(path, map_location=map_location, weights_only=False)

    def commit(self, info: CheckpointCommitInfo) -> bool:
        """Returns once every file saved for the tag is durable; raises the first failure."""
        pending, self._pending = self._pending, []
        self._commit_info = None
        error = None
        for handle in pending:
            try:
                handle.wait()
            except BaseException as exc:  # noqa: BLE001 - every save is waited for, the first error raised
                error = error or exc
        if error is not None:
            raise error
        return True

    def is_decoupled(self) -> bool:
        # DeepSpeed then commits at the next step instead of inside save_checkpoint
        return self.asynchronous

    def get_commit_info(self):
        return self._commit_info

    def cleanup(self) -> None:
        if self._commit_info is not None or self._pending:
            self.commit(self._commit_info)
