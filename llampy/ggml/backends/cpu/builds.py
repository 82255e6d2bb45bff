"""A kernel's parallel build beside its one-thread build, each with a cache entry of its own.

Numba's cache files a compiled function under its module, qualified name and first line, and keys each entry by
signature, target and bytecode, not by the ``parallel`` flag: ``njit(parallel=True, cache=True)(f)`` and
``njit(cache=True)(f)`` of the same ``f`` share one entry, and whichever compiled first is what both load from then
on (a binder that picked the parallel build for a large tensor running the one-thread code, or a small tensor
paying for the thread team). ``parallel_build(f)`` compiles a copy of ``f`` named ``f.__name__ + "_par"``: the same
code, its own cache file.
"""
from __future__ import annotations

import types

from numba import njit


def parallel_build(fn, **flags):
    """``njit(parallel=True, cache=True, **flags)`` of a copy of fn under the name ``<name>_par``."""
    g = types.FunctionType(fn.__code__, fn.__globals__, fn.__name__ + "_par", fn.__defaults__, fn.__closure__)
    g.__qualname__ = fn.__qualname__ + "_par"
    g.__module__ = fn.__module__
    g.__doc__ = fn.__doc__
    return njit(parallel=True, cache=True, **flags)(g)
