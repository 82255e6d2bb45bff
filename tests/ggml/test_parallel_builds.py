"""Parallel CPU kernels: no two builds of a kernel that differ in ``parallel`` share a Numba cache entry
(cpu/builds.py: Numba keys its cache by function name, line, signature and bytecode, not by flags, so a shared
entry would give the parallel binders the one-thread code, or the reverse, whichever was compiled first); work
items taken from a shared counter (cpu/claims.py) each run once."""
from __future__ import annotations

import importlib
import pkgutil

from numba.core.registry import CPUDispatcher

from llampy.ggml.backends import cpu


def _dispatchers():
    for m in pkgutil.iter_modules(cpu.__path__):
        mod = importlib.import_module(f"{cpu.__name__}.{m.name}")
        for name, obj in vars(mod).items():
            if isinstance(obj, CPUDispatcher) and getattr(obj, "_cache", None) is not None \
                    and obj.py_func.__module__ == mod.__name__:
                yield f"{mod.__name__}.{name}", obj


def test_parallel_and_serial_builds_have_their_own_cache_entries():
    seen: dict[str, tuple[str, bool]] = {}
    clashes = []
    for name, d in _dispatchers():
        path = getattr(d._cache, "_cache_file", None)
        if path is None:
            continue
        par = bool(d.targetoptions.get("parallel"))
        key = path._index_path
        if key in seen and seen[key][1] != par:
            clashes.append((seen[key][0], name))
        seen.setdefault(key, (name, par))
    assert len(seen) > 50                   # the backend's kernels were found
    assert not clashes, clashes


def test_the_binders_pairs_are_distinct_builds():
    from llampy.ggml.backends.cpu import elementwise, rows, softmax
    for mod, name in [(elementwise, "binary_f32"), (softmax, "soft_max_rows"), (rows, "get_rows_plain"),
                      (rows, "get_rows_f16"), (rows, "set_rows_f16"), (rows, "set_rows_same"),
                      (rows, "cont_f32_f16")]:
        par, one = getattr(mod, name + "_par"), getattr(mod, name)
        assert par.targetoptions.get("parallel") and not one.targetoptions.get("parallel")
        assert par._cache._cache_file._index_path != one._cache._cache_file._index_path
        assert par.py_func.__code__ is one.py_func.__code__          # the same kernel


def test_claimed_items_each_run_once():
    """cpu/claims.py: workers taking items from the shared counter run every item exactly once."""
    import numpy as np
    from numba import njit, prange

    from llampy.ggml.backends.cpu.claims import claim, workers

    @njit(parallel=True)
    def run(n, hits, n_workers):
        counter = np.zeros(1, np.int64)
        for _ in prange(n_workers):
            while True:
                it = claim(counter)
                if it >= n:
                    break
                hits[it] += 1

    for n in (0, 1, 7, 1000):
        hits = np.zeros(n, np.int64)
        run(n, hits, workers(n))
        assert (hits == 1).all()
    assert workers(0) == 1 and workers(1) == 1
