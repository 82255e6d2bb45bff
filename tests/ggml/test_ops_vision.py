"""The vision encoders' ops against direct NumPy formulas (the table in test_ops.py compares the cpu backend with
the reference; this checks the reference itself)."""
from __future__ import annotations

import numpy as np

from llampy.ggml import ops
from llampy.ggml.backend import backend_init
from llampy.ggml.types import GGMLType as T

from .helpers import leaf, run

CPU = backend_init("cpu")
REF = backend_init("reference")
F32, F16 = T.F32, T.F16


def test_reference_conv_2d_and_pool_against_numpy():
    """The reference's convolution is the F16-rounded input correlated with the kernel, and its average pool the
    window mean: checked against direct NumPy formulas."""
    rng = np.random.default_rng(12)
    img = rng.standard_normal((1, 3, 8, 12)).astype(np.float32)        # (N, C, H, W)
    ker = rng.standard_normal((5, 3, 4, 4)).astype(np.float32)         # (OC, C, KH, KW)
    (c,) = run(REF, ops.conv_2d(leaf(CPU, F16, ker.shape, ker), leaf(CPU, F32, img.shape, img), 4, 4, 0, 0))
    x16 = img.astype(np.float16).astype(np.float64)
    k16 = ker.astype(np.float16).astype(np.float64)
    want = np.einsum("nchpwq,ocpq->nohw", x16.reshape(1, 3, 2, 4, 3, 4), k16)
    np.testing.assert_allclose(c, want, rtol=1e-5, atol=1e-5)
    (p,) = run(REF, ops.pool_2d(leaf(CPU, F32, img.shape, img), ops.POOL_AVG, 2, 2, 2, 2))
    np.testing.assert_allclose(p, img.reshape(1, 3, 4, 2, 6, 2).mean(axis=(3, 5)), rtol=0, atol=1e-6)


def _mrope_formula(x, rows, sections, n_dims, mode, base):
    """ggml_rope_multi written directly (float64 angles): pair j of section r = the row of j % sum(sections)
    turns by rows[r] * base^(-2 k / n_dims), k = j (MROPE) or j's index within its section (VISION)."""
    n_rot = n_dims if mode == ops.ROPE_TYPE_MROPE else 2 * n_dims
    half = n_rot // 2
    starts = np.cumsum([0] + list(sections))
    out = x.astype(np.float64).copy()
    for j in range(half):
        sector = j % sum(sections)
        r = min(int(np.searchsorted(starts, sector, side="right")) - 1, 3)
        k = j - starts[r] if mode == ops.ROPE_TYPE_VISION else j
        ang = rows[r].astype(np.float64) * base ** (-2.0 * k / n_dims)
        c, s = np.cos(ang)[None, :, None], np.sin(ang)[None, :, None]
        x0, x1 = x[..., j].astype(np.float64), x[..., j + half].astype(np.float64)
        out[..., j], out[..., j + half] = x0 * c - x1 * s, x0 * s + x1 * c
    return out


def test_rope_multi_mrope_and_vision():
    """M-RoPE (qwen2-VL's language model: rows t, h, w, e over sections of the NeoX halves) and the encoder's 2-D
    rope (rows y, x, y, x; each section's angle restarting): the reference against the formula, the cpu backend
    against the reference (its rotation in ggml's fused multiply-adds, the reference's in float64)."""
    rng = np.random.default_rng(3)
    nt, nh, hd = 6, 3, 16
    x = rng.standard_normal((1, nt, nh, hd)).astype(np.float32)
    rows = rng.integers(0, 40, (4, nt)).astype(np.int32)
    for mode, n_dims, sections in ((ops.ROPE_TYPE_MROPE, 12, (2, 2, 2, 0)), (ops.ROPE_TYPE_VISION, hd // 2, (4,) * 4)):
        outs = []
        for be in (REF, CPU):
            a = leaf(CPU, F32, x.shape, x)
            pos = leaf(CPU, T.I32, (4 * nt,), rows.reshape(-1))
            outs += run(be, ops.rope_multi(a, pos, None, n_dims, sections, mode, 32768, 10000.0, 1.0, 0.0, 1.0,
                                           32.0, 1.0))
        np.testing.assert_allclose(outs[0], _mrope_formula(x, rows, sections, n_dims, mode, 10000.0), rtol=0,
                                   atol=2e-5)
        np.testing.assert_allclose(outs[1], outs[0], rtol=0, atol=1e-6)     # the cpu's fma order vs float64
