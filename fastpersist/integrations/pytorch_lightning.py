"""fastpersist as Lightning's checkpoint I/O for the ``pytorch_lightning``
package (whose Trainer checks plugins against ``lightning_fabric``'s classes).

    from fastpersist.integrations.pytorch_lightning import AsyncFastPersistCheckpointIO
    trainer = pytorch_lightning.Trainer(plugins=[AsyncFastPersistCheckpointIO()])
"""
from ._checkpoint_io import for_fabric

FastPersistCheckpointIO, AsyncFastPersistCheckpointIO = for_fabric("lightning_fabric", __name__,
                                                                   "pytorch_lightning", "pytorch-lightning")

__all__ = ["AsyncFastPersistCheckpointIO", "FastPersistCheckpointIO"]
