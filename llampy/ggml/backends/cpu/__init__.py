"""The cpu backend (NumPy + Numba). Importing it registers it as "cpu"."""
from . import nrt_cache

nrt_cache.install()     # before any kernel runs: Numba's runtime module from the cache (see nrt_cache.py)

from ...backend import register_backend  # noqa: E402
from .backend import CPUBackend  # noqa: E402

register_backend("cpu", CPUBackend)

__all__ = ["CPUBackend"]
