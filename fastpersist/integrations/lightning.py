"""fastpersist as Lightning's checkpoint I/O (the ``lightning`` package).

    from fastpersist.integrations.lightning import FastPersistCheckpointIO, AsyncFastPersistCheckpointIO
    trainer = lightning.Trainer(plugins=[AsyncFastPersistCheckpointIO()])

For ``pytorch_lightning`` use ``fastpersist.integrations.pytorch_lightning``.
"""
try:
    from lightning.fabric.plugins.io.checkpoint_io import CheckpointIO
    from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO
    from lightning.fabric.utilities.cloud_io import _is_local_file_protocol
except ImportError as exc:  # pragma: no cover - said plainly to whoever imports this module
    raise ImportError("fastpersist.integrations.lightning needs the `lightning` package "
                      "(pip install 'fastpersist[lightning]')") from exc

from ._checkpoint_io import build

FastPersistCheckpointIO, AsyncFastPersistCheckpointIO = build(CheckpointIO, TorchCheckpointIO,
                                                              _is_local_file_protocol, __name__)

__all__ = ["AsyncFastPersistCheckpointIO", "FastPersistCheckpointIO"]
