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
