"""``cached_njit``: ``numba.njit`` whose on-disk cache is keyed on more source files, and whose cached kernels load
without the compiler's registries.

Two things differ from ``numba.njit(cache=True)``, both per dispatcher (its ``_cache``, as
``Dispatcher.enable_caching`` sets it; nothing process-wide):

- The index key gains a digest of the given source files. Numba keys a cached function on its own file's time stamp
  and its own bytecode only, while a kernel compiles in the helpers it calls and the globals it reads (tables,
  constants) from other modules: after a change there, a cache kept from before would run the old code.
- Loading a cached kernel starts Numba's runtime (NRT) only. Numba's ``FunctionCache.load_overload`` first calls
  ``target_context.refresh()``, which imports and installs every typing and lowering registry a compilation could
  need (NumPy's random generators, datetime, typed containers, cffi's parser...): the first kernel's load took
  0.25-0.35 s of CPU in a fresh process, now 0.06-0.11 s (SmolLM2 to Q4_0, whole command: 1.29 -> 1.03 s). A
  loaded kernel is machine code linked against the runtime's symbols and the C helpers Numba registers when it is
  imported; it uses no registry. When a kernel is not in the cache, Numba's compiler refreshes the contexts itself
  before compiling (``CompilerBase``), so a compilation still sees everything.
- An argument that is a plain ``numpy.ndarray`` is typed without Numba's check that it is no masked array: the
  dispatcher types each new kind of array (dtype, dimensions, layout) once, in Python, and Numba's check reads
  ``np.ma``, which imports numpy.ma (~0.04 s of CPU, the first time in a process). The type is the one Numba's
  ``typeof`` gives (an exact ndarray is no masked array); any other value goes to Numba's own typing.
"""
from __future__ import annotations

import functools
import hashlib
import os

import numba
import numpy as np
from numba.core import types
from numba.core.caching import FunctionCache
from numba.core.errors import NumbaNotImplementedError
from numba.core.runtime import rtsys
from numba.np.numpy_support import from_dtype, map_layout


@functools.lru_cache(maxsize=None)
def _digest(paths: tuple) -> str:
    h = hashlib.sha256()
    for p in paths:
        try:
            with open(p, "rb") as f:
                h.update(f.read())
        except OSError:                 # no source beside the bytecode: the path alone
            h.update(p.encode())
    return h.hexdigest()


class _SourcesCache(FunctionCache):
    """Numba's on-disk cache of one function, its index key extended by a digest of the given source files."""

    def __init__(self, py_func, paths: tuple):
        self._paths = paths
        super().__init__(py_func)

    def _index_key(self, sig, codegen):
        return super()._index_key(sig, codegen) + (_digest(self._paths),)

    def load_overload(self, sig, target_context):
        # FunctionCache.load_overload without its target_context.refresh(): of what that installs, a loaded
        # kernel needs the runtime only (its NRT_* symbols; a kernel that allocates crashes without them)
        rtsys.initialize(target_context)
        with self._guard_against_spurious_io_errors():
            return self._load_overload(sig, target_context)


def _typeof_pyval(dispatcher, val):
    """``Dispatcher.typeof_pyval`` (what the dispatcher calls to type an argument it has no type code for yet), for
    a plain ndarray without ``np.ma`` (the module's docstring)."""
    if type(val) is np.ndarray:
        try:
            tp = types.Array(from_dtype(val.dtype), val.ndim, map_layout(val), readonly=not val.flags.writeable)
        except NumbaNotImplementedError:
            pass
        else:
            dispatcher._types_active_call.add(tp)       # as typeof_pyval: kept alive until the call is done
            return tp
    return type(dispatcher).typeof_pyval(dispatcher, val)


def cached_njit(paths):
    """``numba.njit`` whose ``cache=True`` entries are keyed on the contents of ``paths`` too, load without the
    compiler's registries, and type plain arrays without numpy.ma (the module's docstring)."""
    paths = tuple(os.fspath(p) for p in paths)

    def njit(*args, **kw):
        def wrap(fn):
            opts = dict(kw)
            cache = opts.pop("cache", False)
            d = numba.njit(**opts)(fn)
            d.typeof_pyval = functools.partial(_typeof_pyval, d)
            if cache:                   # what Dispatcher.enable_caching does, with the wider key
                d._cache = _SourcesCache(d.py_func, paths)
            return d
        if args and callable(args[0]):
            return wrap(args[0])
        return wrap
    return njit
