"""The error every format's loads raise for a broken file: format-neutral,
so that torch checkpoints, safetensors files and DCP data files share it."""


class CheckpointError(RuntimeError):
    """A checkpoint file is truncated, corrupt or not what it claims to be.

    A RuntimeError, like the errors torch.load raises for broken archives,
    so code that catches those keeps working."""


__all__ = ["CheckpointError"]
