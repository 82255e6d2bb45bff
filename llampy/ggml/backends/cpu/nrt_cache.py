"""Numba's runtime library (NRT), cached on disk like the kernels.

Numba compiles a small LLVM module of NRT helpers (atomic reference counts, ``NRT_MemInfo_data_fast``...) the first
time a process calls any jitted function, even one loaded from the cache. That compilation runs LLVM's whole
optimisation pipeline and code generator once, and the code pages of libllvmlite it touches stay resident: about
20 MiB of the process's peak RSS (SmolLM2 bench: 314 -> 295 MiB). The kernels themselves come from Numba's cache
as object code and touch little of LLVM, so caching this one module too removes most of that.

``install()`` wraps ``nrtdynmod.compile_nrt_functions``: the first process compiles the module as Numba does, with
object caching on, and saves it with Numba's own serialisation (the form ``cache=True`` uses); later ones load it.
The key is Numba's and llvmlite's versions and the codegen's target (triple, CPU, features), so the machine code is
the one this Numba would compile here. Any failure falls back to Numba's own compilation.
"""
from __future__ import annotations

import os
import pickle
import tempfile

_installed = False


def _cache_path() -> str:
    import numba
    base = numba.config.CACHE_DIR or os.path.join(os.path.dirname(__file__), "__pycache__")
    return os.path.join(base, f"numba_nrt-{numba.__version__}.nbo")


def install() -> None:
    """Before the first call into a jitted function: make Numba's runtime initialisation use the cache."""
    global _installed
    if _installed:
        return
    try:
        import llvmlite
        import numba
        from numba.core.runtime import nrtdynmod
    except ImportError:
        return
    compile_nrt = nrtdynmod.compile_nrt_functions

    def compile_nrt_functions(ctx):
        try:
            codegen = ctx.codegen()
            key = (numba.__version__, llvmlite.__version__, codegen.magic_tuple())
            path = _cache_path()
            try:
                with open(path, "rb") as f:
                    saved_key, state = pickle.load(f)
                if saved_key == key:
                    return codegen.unserialize_library(state)
            except (OSError, EOFError, pickle.UnpicklingError, ValueError, TypeError):
                pass
            ir_mod, library = nrtdynmod.create_nrt_module(ctx)
            library.enable_object_caching()
            library.add_ir_module(ir_mod)
            library.finalize()
            try:
                os.makedirs(os.path.dirname(path), exist_ok=True)
                fd, tmp = tempfile.mkstemp(dir=os.path.dirname(path), suffix=".tmp")
                with os.fdopen(fd, "wb") as f:
                    pickle.dump((key, library.serialize_using_object_code()), f)
                os.chmod(tmp, 0o644)
                os.replace(tmp, path)
            except OSError:
                pass
            return library
        except Exception:       # a Numba whose internals differ: its own path
            return compile_nrt(ctx)

    nrtdynmod.compile_nrt_functions = compile_nrt_functions
    _installed = True
