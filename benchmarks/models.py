"""The model registry lives in fastpersist.bench.models (``fastpersist bench``
uses it after a plain pip install); the scripts here keep importing it as
``models``."""
from fastpersist.bench.models import *  # noqa: F401,F403
from fastpersist.bench.models import __all__  # noqa: F401
