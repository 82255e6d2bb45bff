"""The cpu backend (NumPy + Numba). Importing it registers it as "cpu"."""
import os

# Numba's OpenMP workers spin 300k rounds (several ms) after each parallel region before they sleep; the prompt
# attention then runs on the BLAS path's Python threads, and the spinning worker took half of their core (SmolLM2
# pp512: attention 182 -> 110 ms, pp 605 -> 665 tok/s with 10k rounds; decode unchanged: benchmarks/README.md,
# entry 30). Read by libgomp when Numba starts its pool, so it has to be set before the first kernel runs.
os.environ.setdefault("GOMP_SPINCOUNT", "10000")

from . import llvm_pages, nrt_cache, numba_copies  # noqa: E402

nrt_cache.install()     # before any kernel runs: Numba's runtime module from the cache (see nrt_cache.py)
llvm_pages.install()    # LLVM's code pages dropped from the resident set after each kernel load (llvm_pages.py)
numba_copies.install()  # two of Numba's quadratic IR copies made linear (numba_copies.py)

from ...backend import register_backend  # noqa: E402
from .backend import CPUBackend  # noqa: E402

register_backend("cpu", CPUBackend)

__all__ = ["CPUBackend"]
