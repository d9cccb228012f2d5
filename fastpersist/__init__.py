"""fastpersist: torch.save and torch.load at the speed of the storage device.

``import fastpersist`` patches ``torch.save`` and ``torch.load`` unless ``FASTPERSIST_AUTOPATCH=0``.
Files stay standard torch checkpoints that any ``torch.load`` reads.
"""
import os

from .async_save import SaveHandle, release_snapshot_memory, save_async
from .async_save import wait_for_all as wait_for_saves
from .load import IncompatibleKeys, load, load_into, release_load_memory
from .options import Options
from .patching import is_patched, patch, unpatch
from .release import wait_for_releases
from .save_api import save
from .torch_format import CheckpointError
from .writer import FastFileWriter

__version__ = "0.1.0"
__all__ = ["CheckpointError", "FastFileWriter", "IncompatibleKeys", "Options", "SaveHandle", "is_patched", "load",
           "load_into", "patch", "release_load_memory", "release_snapshot_memory", "save", "save_async", "unpatch", "wait_for_releases", "wait_for_saves",
           "__version__"]



def autopatch_enabled(environ=os.environ) -> bool:
    """Whether ``import fastpersist`` patches torch (FASTPERSIST_AUTOPATCH, on by default)."""
    return environ.get("FASTPERSIST_AUTOPATCH", "1").strip().lower() not in ("0", "false", "no", "off")


if autopatch_enabled():
    patch()
