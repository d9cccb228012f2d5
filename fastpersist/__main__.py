"""``python -m fastpersist ...``: the same as the ``fastpersist`` command."""
import sys

from .cli import main

sys.exit(main())
