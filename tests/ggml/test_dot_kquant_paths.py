"""The tiled k-quant kernels (cpu/dot_kquant.py) on every instruction path of cpu/simd.py: in a fresh process with a
lesser path forced (``LLAMPY_SIMD=avx2``: maddubs + madd without vpdpwssd; ``generic``: target-neutral IR) and a
fresh Numba cache, each kernel must give this process's results bit for bit."""
from __future__ import annotations

import pytest

from tests.ggml.helpers import paths_agree

SCRIPT = r'''
import sys
import numpy as np
from llampy.ggml.quants_k import quantize_q4_k, quantize_q5_k, quantize_q6_k
from llampy.ggml.types import GGMLType as T
from llampy.ggml.backends.cpu import dot_kquant
from llampy.ggml.backends.cpu.act_quant import act_split
from llampy.ggml.backends.cpu.dot_q32 import F16_TABLE

def run():
    rng = np.random.default_rng(11)
    res = {}
    w32 = rng.standard_normal((16, 512)).astype(np.float32)
    for name, q in (("q4_k", quantize_q4_k), ("q5_k", quantize_q5_k), ("q6_k", quantize_q6_k)):
        w = np.asarray(q(w32)).reshape(16, -1)
        for n in (1, 3, 4, 9):
            s = act_split((rng.standard_normal((n, 512)) * 4).astype(np.float32), T.Q8_K)
            out = np.empty((n, 16), np.float32)
            getattr(dot_kquant, "mv_" + name)(w, s.xq, s.xd, s.xs, out, F16_TABLE)
            res[f"{name}_{n}"] = out
            if name == "q4_k":
                out = np.empty((n, 16), np.float32)
                dot_kquant.mv_q4_k_x8(w, s.xq, s.xd, s.xs, out, F16_TABLE, n - n % 4 if n >= 4 else 0)
                res[f"q4_k_x8_{n}"] = out
    return res

if __name__ == "__main__":
    np.savez(sys.argv[1], **run())
'''


@pytest.mark.slow
@pytest.mark.parametrize("path", ["avx2", "generic"])
def test_dot_kquant_paths_agree(path, tmp_path):
    paths_agree(SCRIPT, path, tmp_path)
