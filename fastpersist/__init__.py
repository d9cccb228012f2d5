"""fastpersist: torch.save and torch.load at the speed of the storage device.

``import fastpersist`` patches ``torch.save`` unless ``FASTPERSIST_AUTOPATCH=0``.
Files stay standard torch checkpoints that any ``torch.load`` reads.
"""
import os

from .options import Options
from .patching import is_patched, patch, unpatch
from .save import save
from .writer import FastFileWriter

__version__ = "0.1.0"
__all__ = ["FastFileWriter", "Options", "is_patched", "patch", "save", "unpatch", "__version__"]

if os.environ.get("FASTPERSIST_AUTOPATCH", "1").strip().lower() not in ("0", "false", "no", "off"):
    patch()
