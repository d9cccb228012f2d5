"""fastpersist inside the frameworks that checkpoint for their users.

Each integration is a module of its own, imported only when asked for, and
needs its framework installed (an optional extra, e.g. ``fastpersist[lightning]``):

- ``fastpersist.integrations.lightning``: CheckpointIO plugins for ``lightning``
- ``fastpersist.integrations.pytorch_lightning``: the same for ``pytorch_lightning``
"""
