"""Process tuning: everything llampy does to the process beyond its own objects, in one place.

Importing llampy changes nothing process-wide. The entry points — the ``llampy`` command, the server, and
``Llama()`` unless it is given ``tune_process=False`` — call ``install()``, which applies each of these once:

- libgomp's spin count. Numba's OpenMP workers spin 300k rounds (several ms) after each parallel region before they
  sleep; the Python and BLAS threads that run between regions then lose half a core to them (SmolLM2 pp512: prompt
  attention 182 -> 110 ms with 10k rounds; benchmarks/README.md, entries 30 and 52). libgomp reads
  ``GOMP_SPINCOUNT`` once, when Numba starts its pool, so this must run before the first parallel kernel; a value
  the user set wins.
- numpy's OpenBLAS single-threaded. The cpu backend calls it from its own threads (one product per thread); its own
  threads spin after each product and stalled the Numba kernels that followed.
- Three patches to Numba's internals (``backends/cpu/{nrt_cache,llvm_pages,numba_copies}.py``, each with its module
  doc and test): Numba's runtime module loaded from the cache instead of compiled in each process, LLVM's code pages
  dropped from the resident set after each kernel load, and two of Numba's quadratic IR copies made linear (cold
  compiles ~45% faster). They were written against the Numba versions in ``NUMBA_TESTED``; outside that range
  ``install()`` raises ``TuningError`` naming the version rather than patch what it does not know.
- Graphs kept out of the garbage collector's reach: a context's persistent graphs hold most of the process's Python
  objects, and full collections walking them took 70-140 ms in the middle of a decode step. Once installed, each new
  graph is moved into the collector's permanent generation (``gc.freeze``, through ``after_graph_built``).

``installed()`` says whether it ran. Nothing here can be undone; a process that does not want it never calls it.

Apart from ``install()``, for ``llampy quantize`` alone: ``keep_freed_arrays()`` raises glibc's malloc thresholds for
its own process, ``start_up_gc`` pauses the garbage collector while NumPy, Numba and the kernels load, and
``lean_numba()`` imports Numba without what the quantize kernels never use, its runtime module from the cache (see
their docs).
"""
from __future__ import annotations

import gc
import os
import sys

NUMBA_TESTED = ((0, 68), (0, 69))     # [lowest, highest) major.minor the patches were tested against
SPIN_COUNT = 10000

_installed = False


class TuningError(RuntimeError):
    pass


def _numba_version() -> tuple[int, int]:
    import numba
    major, minor = numba.__version__.split(".")[:2]
    return int(major), int(minor)


def check_numba() -> None:
    """Raise TuningError if the installed Numba is outside the range the patches were tested against."""
    import numba
    lo, hi = NUMBA_TESTED
    if not lo <= _numba_version() < hi:
        raise TuningError(f"llampy's process tuning patches Numba internals tested with numba "
                          f">={lo[0]}.{lo[1]},<{hi[0]}.{hi[1]}; this is numba {numba.__version__}. Install a "
                          f"numba in that range, or run without the tuning (Llama(..., tune_process=False))")


def install() -> None:
    """Apply the process tuning (see the module doc). Idempotent; call it before the first kernel runs."""
    global _installed
    if _installed:
        return
    check_numba()
    os.environ.setdefault("GOMP_SPINCOUNT", str(SPIN_COUNT))
    from .ggml.backends.cpu import blas, llvm_pages, nrt_cache, numba_copies
    nrt_cache.install()       # before any kernel runs
    llvm_pages.install()
    numba_copies.install()
    blas.set_threads(1)
    _installed = True


def size_numba_pool(n_threads: int | None) -> None:
    """Ask for Numba's thread pool to be n_threads wide (NUMBA_NUM_THREADS, unless the user set it), for an entry
    point that runs before Numba starts. Numba rereads the variable at every compile and refuses a value that
    differs from its running pool's, so once Numba is imported (a command called in a process that already ran
    kernels) this leaves the variable alone; ``numba.set_num_threads`` still narrows the work."""
    if n_threads and "numba" not in sys.modules:
        os.environ.setdefault("NUMBA_NUM_THREADS", str(int(n_threads)))


_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3      # glibc's mallopt parameters


def keep_freed_arrays() -> bool:
    """For a command that makes and frees arrays of a few MiB over and over (``llampy quantize``: NumPy's
    temporaries for every chunk of 256K values): glibc maps an allocation above its mmap threshold afresh and gives
    freed memory back past its trim threshold, so each chunk's temporaries were faulted in again (Q2_0 rows, 8 M
    values, one thread: 172 ms, 43 ms with the thresholds raised). Raises both (32 MiB, glibc's largest mapping
    threshold, and 256 MiB); returns whether the C library took them (False off glibc). Process-wide: only the
    quantize command calls it."""
    try:
        import ctypes
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return False
    return bool(mallopt(_M_MMAP_THRESHOLD, 32 << 20)) and bool(mallopt(_M_TRIM_THRESHOLD, 256 << 20))


class start_up_gc:
    """The quantize command's garbage collector: paused from the command's start (before NumPy loads) until
    ``resume()``, after the first tensor is written, when NumPy's, Numba's and the kernels' objects are made; those
    are then frozen (the collections that follow do not traverse them again). Without the pause, the collections
    that the start-up's allocations set off traversed the growing heap again and again: ~0.08 s of CPU over ~160
    collections in a SmolLM2-135M to Q4_0 run of ~0.95 s.

    ``program``: the command is the process's own (``llampy quantize`` from a shell), which ends after it: every
    object is frozen at the end, so that the interpreter's shutdown does not collect them all once more (its
    collections and the teardown they drive took 0.17-0.19 s of CPU after such a run, 0.025 s with the objects
    frozen; the command closes its files itself). Otherwise (the command run in another program's process, as the
    tests do) the collector's previous state comes back at the end, nothing left frozen, also when the command
    fails or its arguments are bad."""
    active = None

    def __init__(self, program: bool = False):
        self.program = program

    def __enter__(self):
        self.paused = gc.isenabled()
        self.frozen = False
        if self.paused:
            gc.disable()
            start_up_gc.active = self
        return self

    def resume(self) -> None:
        if self.paused:
            self.paused = False
            self.frozen = gc.get_freeze_count() == 0      # (another program's frozen objects stay as they are)
            if self.frozen:
                gc.freeze()
            gc.enable()

    def __exit__(self, *exc):
        if start_up_gc.active is self:
            start_up_gc.active = None
        if self.program:
            gc.freeze()
        elif self.frozen:
            gc.unfreeze()
        if self.paused:
            gc.enable()
        return False


def lean_numba():
    """For ``llampy quantize``'s own process, before anything imported Numba (else Numba is returned as it is):
    Numba imported and started without what its start-up spends on things the quantize kernels never use.

    - PyYAML, which numba.core.config imports only to read a ``.numba_config.yaml`` in the working directory: not
      imported where there is none (~5-15 ms).
    - The ``numba_extensions`` entry points of the installed packages, which Numba's first call of any kernel looks
      up (``entrypoints.init_all``: importlib.metadata reads every distribution's entry points, 17-33 ms of CPU on
      a loaded host): not run; the kernels are llampy's own and use no extension's types.
    - Numba's runtime module (NRT), compiled by LLVM at the first kernel call of every process (~25-50 ms): loaded
      from the cache instead (``backends/cpu/nrt_cache``, as ``install()`` does, within ``NUMBA_TESTED``; its file
      loaded alone, as importing the cpu backend's package would cost 0.4 s).

    Returns the numba module."""
    if "numba" in sys.modules:
        import numba
        return numba
    no_yaml = "yaml" not in sys.modules and not os.path.isfile(".numba_config.yaml")
    if no_yaml:
        sys.modules["yaml"] = None      # (an import of it raises ImportError: numba.core.config's _HAVE_YAML)
    try:
        import numba
        from numba.core import entrypoints
    finally:
        if no_yaml and sys.modules.get("yaml", 0) is None:
            del sys.modules["yaml"]
    entrypoints._already_initialized = True
    lo, hi = NUMBA_TESTED
    if lo <= _numba_version() < hi:
        name = __name__.rpartition(".")[0] + ".ggml.backends.cpu.nrt_cache"
        mod = sys.modules.get(name)
        if mod is None:
            import importlib.util
            path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "ggml", "backends", "cpu", "nrt_cache.py")
            spec = importlib.util.spec_from_file_location(name, path)
            mod = importlib.util.module_from_spec(spec)
            sys.modules[name] = mod     # (the backend's package, if it is imported later, finds it installed)
            spec.loader.exec_module(mod)
        mod.install()
    return numba


def resume_start_up_gc() -> None:
    """``start_up_gc``'s resume, for the command's progress callback (nothing when no pause is active)."""
    if start_up_gc.active is not None:
        start_up_gc.active.resume()


def installed() -> bool:
    return _installed


def after_graph_built() -> None:
    """Called by a context when it keeps a new graph: freeze the heap's objects out of full collections, when the
    tuning is installed (a library user's collector is left alone)."""
    if _installed:
        gc.freeze()
