"""fastpersist as Lightning's checkpoint I/O (the ``lightning`` package).

    from fastpersist.integrations.lightning import FastPersistCheckpointIO, AsyncFastPersistCheckpointIO
    trainer = lightning.Trainer(plugins=[AsyncFastPersistCheckpointIO()])

For ``pytorch_lightning`` use ``fastpersist.integrations.pytorch_lightning``.
"""
from ._checkpoint_io import for_fabric

FastPersistCheckpointIO, AsyncFastPersistCheckpointIO = for_fabric("lightning.fabric", __name__, "lightning",
                                                                   "lightning")

__all__ = ["AsyncFastPersistCheckpointIO", "FastPersistCheckpointIO"]
