"""The cpu backend (NumPy + Numba). Importing it registers it as "cpu"."""
from . import llvm_pages, nrt_cache, numba_copies

nrt_cache.install()     # before any kernel runs: Numba's runtime module from the cache (see nrt_cache.py)
llvm_pages.install()    # LLVM's code pages dropped from the resident set after each kernel load (llvm_pages.py)
numba_copies.install()  # two of Numba's quadratic IR copies made linear (numba_copies.py)

from ...backend import register_backend  # noqa: E402
from .backend import CPUBackend  # noqa: E402

register_backend("cpu", CPUBackend)

__all__ = ["CPUBackend"]
