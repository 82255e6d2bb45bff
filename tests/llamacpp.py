"""Where the tests find llama.cpp's own build (scripts/llamacpp.sh: a venv with llama-cpp-python built natively from
its sdist), for the differential tests against ggml's quantizers and llama.cpp's tokenizers and samplers.

``make test`` builds it (cached per machine) and sets ``LLAMPY_LLAMACPP`` to its directory. Without it these tests
skip, except in CI (``CI`` set), where a missing build is a failure: a differential test that always skips there
protects nothing."""
from __future__ import annotations

import ctypes
import glob
import os
import subprocess

import pytest

from tests.paths import ROOT


def _venvs() -> list[str]:
    return [d for d in (os.environ.get("LLAMPY_LLAMACPP", ""), str(ROOT / "benchmarks" / ".llamacpp-venv")) if d]


def _lib(name: str, env: str) -> str | None:
    cands = [os.environ.get(env, "")]
    for d in _venvs():
        cands += glob.glob(os.path.join(d, "lib", "python3*", "site-packages", "llama_cpp", "lib", name))
    return next((c for c in cands if c and os.path.exists(c)), None)


def libllama() -> str | None:
    return _lib("libllama.so", "LLAMPY_LIBLLAMA")


def libggml_base() -> str | None:
    return _lib("libggml-base.so", "LLAMPY_LIBGGML")


class GGMLInitParams(ctypes.Structure):
    """ggml_init's argument."""
    _fields_ = [("mem_size", ctypes.c_size_t), ("mem_buffer", ctypes.c_void_p), ("no_alloc", ctypes.c_bool)]


def libggml_cpu(mode: int = ctypes.DEFAULT_MODE) -> tuple[ctypes.CDLL, ctypes.CDLL]:
    """ggml's base and CPU libraries of llama.cpp's build, loaded through ctypes (skip, or fail in CI, without)."""
    base = libggml_base()
    cpu = base and os.path.join(os.path.dirname(base), "libggml-cpu.so")
    if not cpu or not os.path.exists(cpu):
        missing("libggml-cpu.so")
    return ctypes.CDLL(base, mode=mode), ctypes.CDLL(cpu, mode=mode)


def libggml_graph() -> tuple[ctypes.CDLL, ctypes.CDLL]:
    """``libggml_cpu()`` with the signatures a one-node flash-attention graph needs (ggml_init, 4-D tensors, their
    data, ggml_flash_attn_ext and its sinks, a forward graph computed on the CPU) declared for ctypes."""
    b, c = libggml_cpu()
    P = ctypes.c_void_p
    b.ggml_init.restype, b.ggml_init.argtypes = P, [GGMLInitParams]
    b.ggml_new_tensor_4d.restype = P
    b.ggml_new_tensor_4d.argtypes = [P, ctypes.c_int] + [ctypes.c_int64] * 4
    b.ggml_get_data.restype, b.ggml_get_data.argtypes = P, [P]
    b.ggml_flash_attn_ext.restype = P
    b.ggml_flash_attn_ext.argtypes = [P, P, P, P, P, ctypes.c_float, ctypes.c_float, ctypes.c_float]
    b.ggml_flash_attn_ext_add_sinks.argtypes = [P, P]
    b.ggml_new_graph.restype, b.ggml_new_graph.argtypes = P, [P]
    b.ggml_build_forward_expand.argtypes = [P, P]
    b.ggml_free.argtypes = [P]
    c.ggml_cpu_init()
    c.ggml_graph_compute_with_ctx.argtypes = [P, P, ctypes.c_int]
    return b, c


def python() -> str | None:
    """A Python that imports llama_cpp."""
    cands = [os.environ.get("LLAMPY_LLAMACPP_PYTHON", "")] + [os.path.join(d, "bin", "python") for d in _venvs()]
    for c in cands:
        if c and os.path.exists(c) and subprocess.run([c, "-c", "import llama_cpp"], capture_output=True).returncode == 0:
            return c
    return None


def missing(what: str):
    """Skip (fail in CI) because llama.cpp's build lacks ``what``."""
    msg = f"llama.cpp's build not found ({what}): run `bash scripts/llamacpp.sh` and set LLAMPY_LLAMACPP to its output"
    if os.environ.get("CI"):
        pytest.fail(msg + " (CI must run the differential tests)")
    pytest.skip(msg)


def llama_quantize() -> str | None:
    """llama.cpp's llama-quantize (scripts/llamacpp.sh builds it beside the venv's python)."""
    cands = [os.environ.get("LLAMPY_LLAMA_QUANTIZE", "")] + [os.path.join(d, "bin", "llama-quantize") for d in _venvs()]
    return next((c for c in cands if c and os.access(c, os.X_OK)), None)
