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

import numpy as np
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
    """``libggml_cpu()`` with the signatures a one-node flash-attention or matrix-product graph needs (ggml_init,
    2-D and 4-D tensors, their data, ggml_flash_attn_ext and its sinks, ggml_mul_mat, a forward graph computed on the
    CPU) declared for ctypes."""
    b, c = libggml_cpu()
    P = ctypes.c_void_p
    b.ggml_init.restype, b.ggml_init.argtypes = P, [GGMLInitParams]
    b.ggml_new_tensor_4d.restype = P
    b.ggml_new_tensor_4d.argtypes = [P, ctypes.c_int] + [ctypes.c_int64] * 4
    b.ggml_get_data.restype, b.ggml_get_data.argtypes = P, [P]
    b.ggml_flash_attn_ext.restype = P
    b.ggml_flash_attn_ext.argtypes = [P, P, P, P, P, ctypes.c_float, ctypes.c_float, ctypes.c_float]
    b.ggml_flash_attn_ext_add_sinks.argtypes = [P, P]
    b.ggml_new_tensor_2d.restype = P
    b.ggml_new_tensor_2d.argtypes = [P, ctypes.c_int, ctypes.c_int64, ctypes.c_int64]
    b.ggml_mul_mat.restype, b.ggml_mul_mat.argtypes = P, [P, P, P]
    b.ggml_new_graph.restype, b.ggml_new_graph.argtypes = P, [P]
    b.ggml_build_forward_expand.argtypes = [P, P]
    b.ggml_free.argtypes = [P]
    c.ggml_cpu_init()
    c.ggml_graph_compute_with_ctx.argtypes = [P, P, ctypes.c_int]
    return b, c


def ggml_flash_attn(lib, q, k, v, mask, scale, max_bias=0.0, softcap=0.0, sinks=None, k_type=1, v_type=None):
    """ggml_flash_attn_ext as one-node graph on llama.cpp's CPU (``lib``: ``libggml_graph()``), 2 threads: q (1,
    n_head, n_q, d) float32; k / v (1, n_head_kv, n_kv, d|dv) in ggml types k_type / v_type (default: k's; F16 = 1,
    BF16 = 30 as raw bits, F32 = 0); mask F16 bits (1, 1, n_q, n_kv) or None; sinks float32 (n_head,) or None.
    The result (1, n_q, n_head, dv) float32."""
    b, c = lib
    ctx = b.ggml_init(GGMLInitParams(256 << 20, None, False))

    def tensor(typ, arr):
        t = b.ggml_new_tensor_4d(ctx, typ, *reversed(arr.shape))
        ctypes.memmove(b.ggml_get_data(t), np.ascontiguousarray(arr).ctypes.data, arr.nbytes)
        return t

    try:
        vt = k_type if v_type is None else v_type
        out = b.ggml_flash_attn_ext(ctx, tensor(0, q), tensor(k_type, k), tensor(vt, v),
                                    None if mask is None else tensor(1, mask), scale, max_bias, softcap)
        if sinks is not None:
            b.ggml_flash_attn_ext_add_sinks(out, tensor(0, sinks.reshape(1, 1, 1, -1)))
        gf = b.ggml_new_graph(ctx)
        b.ggml_build_forward_expand(gf, out)
        assert c.ggml_graph_compute_with_ctx(ctx, gf, 2) == 0
        res = np.empty((1, q.shape[2], q.shape[1], v.shape[3]), np.float32)
        ctypes.memmove(res.ctypes.data, b.ggml_get_data(out), res.nbytes)
        return res
    finally:
        b.ggml_free(ctx)


def ggml_mul_mat(lib, w, wtype, k, x, n_threads=2):
    """ggml_mul_mat as a one-node graph on llama.cpp's CPU (``lib``: ``libggml_graph()``): w the weight's GGUF rows
    (uint8 [rows, row_bytes] of ggml type ``wtype``, k values each, in a plain context: not repacked), x float32
    [n, k]. The result float32 [n, rows] (ggml rounds x to the weight's dot type itself)."""
    b, c = lib
    n, rows = x.shape[0], w.shape[0]
    ctx = b.ggml_init(GGMLInitParams((16 << 20) + w.nbytes + 4 * x.nbytes + 4 * n * rows, None, False))
    try:
        tw = b.ggml_new_tensor_2d(ctx, int(wtype), k, rows)
        ctypes.memmove(b.ggml_get_data(tw), np.ascontiguousarray(w).ctypes.data, w.nbytes)
        tx = b.ggml_new_tensor_2d(ctx, 0, k, n)
        ctypes.memmove(b.ggml_get_data(tx), np.ascontiguousarray(x, np.float32).ctypes.data, 4 * n * k)
        out = b.ggml_mul_mat(ctx, tw, tx)
        gf = b.ggml_new_graph(ctx)
        b.ggml_build_forward_expand(gf, out)
        assert c.ggml_graph_compute_with_ctx(ctx, gf, n_threads) == 0
        res = np.empty((n, rows), np.float32)
        ctypes.memmove(res.ctypes.data, b.ggml_get_data(out), res.nbytes)
        return res
    finally:
        b.ggml_free(ctx)


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
