"""llampy: the llama.cpp system in Python."""
import os

__version__ = "0.1.0"

# Numba's OpenMP workers spin 300k rounds (several ms) after each parallel region before they sleep; the prompt
# attention then runs on the BLAS path's Python threads, and the spinning worker took half of their core (SmolLM2
# pp512: attention 182 -> 110 ms, pp 605 -> 665 tok/s with 10k rounds; decode unchanged: benchmarks/README.md,
# entry 30). libgomp reads it when Numba starts its pool (the first kernel, or numba.set_num_threads), so it is set
# here, on the package's import, before any entry point can touch Numba: set in the cpu backend's own import, it
# came too late for `llampy bench`, which sets Numba's thread count first (pp512 ~20% slower; entry 52).
os.environ.setdefault("GOMP_SPINCOUNT", "10000")


def __getattr__(name):
    # lazy, so that `import llampy` stays cheap and the ggml layer can be used alone
    if name == "Llama":
        from .llama.api import Llama
        return Llama
    raise AttributeError(name)
