"""The SIMD layer's instruction paths (VNNI, AVX2, target-neutral IR; cpu/simd.py) give the same numbers: each
kernel built on it runs in a fresh process with a lesser path forced (``LLAMPY_SIMD``) and a fresh Numba cache, and
its results must equal this process's bit for bit."""
from __future__ import annotations

import pytest

from tests.ggml.helpers import paths_agree

SCRIPT = r'''
import sys
import numpy as np
from llampy.ggml import quants
from llampy.ggml.types import GGMLType as T
from llampy.ggml.backends.cpu import dot_q32, dot_kquant_tiled, act, attention
from llampy.ggml.backends.cpu.act_quant import act_split
from llampy.ggml.backends.cpu.numpy_ops import alibi_slopes

def run():
    rng = np.random.default_rng(5)
    res = {}
    w32 = rng.standard_normal((37, 96)).astype(np.float32)   # 37: two sixteen-row groups of the AVX-512 tiles + 5
    for name, vdt in (("q4_0", T.Q8_0), ("q4_1", T.Q8_1), ("q5_0", T.Q8_0), ("q5_1", T.Q8_1), ("q8_0", T.Q8_0)):
        w = np.asarray(getattr(quants, "quantize_" + name)(w32)).reshape(37, -1)
        for n in (1, 3, 9, 17):           # 17: a sixteen-row prompt tile, then the rest
            x = (rng.standard_normal((n, 96)) * 4).astype(np.float32)
            s = act_split(x, vdt)
            out = np.empty((n, 37), np.float32)
            getattr(dot_q32, "mv_" + name)(w, s.xq, s.xd, s.xs, out, dot_q32.F16_TABLE)
            res[f"{name}_{n}"] = out
    wk = np.asarray(quants.quantize(rng.standard_normal((16, 512)).astype(np.float32), T.Q6_K), np.uint8)
    s = act_split((rng.standard_normal((9, 512)) * 4).astype(np.float32), T.Q8_K)
    out = np.empty((9, 16), np.float32)
    dot_kquant_tiled.mm_k_tiled(wk.reshape(16, -1), dot_kquant_tiled.KINDS["Q6_K"], s.xq, s.xd, s.xs, out, dot_q32.F16_TABLE)
    res["q6_k_tiled"] = out
    g = (rng.standard_normal((2, 40)) * 20).astype(np.float32)
    u = rng.standard_normal((2, 40)).astype(np.float32)
    o = np.empty_like(g)
    act.swiglu_rows(g, u, o)
    res["swiglu"] = o
    q = rng.standard_normal((1, 4, 2, 64)).astype(np.float32)
    k = rng.standard_normal((1, 2, 50, 64)).astype(np.float16).view(np.uint16)
    v = rng.standard_normal((1, 2, 50, 64)).astype(np.float16).view(np.uint16)
    m = np.zeros((1, 1, 2, 50), np.float32)
    m[..., 40:] = -np.inf
    fo = np.empty((1, 2, 4, 64), np.float32)
    attention._fa_vec16(q, k, v, m, fo, np.float32(0.125), np.float32(0.0), alibi_slopes(4, 0.0, np.float32))
    res["fa"] = fo
    return res

if __name__ == "__main__":
    np.savez(sys.argv[1], **run())
'''


@pytest.mark.slow
@pytest.mark.parametrize("path", ["avx2", "generic"])
def test_simd_paths_agree(path, tmp_path):
    paths_agree(SCRIPT, path, tmp_path)
