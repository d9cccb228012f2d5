"""fastpersist as Lightning's checkpoint I/O for the ``pytorch_lightning``
package (whose Trainer checks plugins against ``lightning_fabric``'s classes).

    from fastpersist.integrations.pytorch_lightning import AsyncFastPersistCheckpointIO
    trainer = pytorch_lightning.Trainer(plugins=[AsyncFastPersistCheckpointIO()])
"""
try:
    from lightning_fabric.plugins.io.checkpoint_io import CheckpointIO
    from lightning_fabric.plugins.io.torch_io import TorchCheckpointIO
    from lightning_fabric.utilities.cloud_io import _is_local_file_protocol
except ImportError as exc:  # pragma: no cover - said plainly to whoever imports this module
    raise ImportError("fastpersist.integrations.pytorch_lightning needs the `pytorch_lightning` package "
                      "(pip install 'fastpersist[pytorch-lightning]')") from exc

from ._checkpoint_io import build

FastPersistCheckpointIO, AsyncFastPersistCheckpointIO = build(CheckpointIO, TorchCheckpointIO,
                                                              _is_local_file_protocol, __name__)

__all__ = ["AsyncFastPersistCheckpointIO", "FastPersistCheckpointIO"]
