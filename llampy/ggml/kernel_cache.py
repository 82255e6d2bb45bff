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
"""
from __future__ import annotations

import functools
import hashlib
import os

import numba
from numba.core.caching import FunctionCache
from numba.core.runtime import rtsys


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


def cached_njit(paths):
    """``numba.njit`` whose ``cache=True`` entries are keyed on the contents of ``paths`` too, and load without the
    compiler's registries (the module's docstring)."""
    paths = tuple(os.fspath(p) for p in paths)

    def njit(*args, **kw):
        def wrap(fn):
            opts = dict(kw)
            cache = opts.pop("cache", False)
            d = numba.njit(**opts)(fn)
            if cache:                   # what Dispatcher.enable_caching does, with the wider key
                d._cache = _SourcesCache(d.py_func, paths)
            return d
        if args and callable(args[0]):
            return wrap(args[0])
        return wrap
    return njit
