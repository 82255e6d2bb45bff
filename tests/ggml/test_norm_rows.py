"""RMS_NORM_MUL sixteen and four rows at a time (llampy/ggml/backends/cpu/norm.py) gives every row the bits of ggml's one-row
loop: squares rounded to float32, summed in double in order, the scale in float32."""
from __future__ import annotations

import math

import numpy as np
import pytest

from llampy.ggml.backends.cpu import norm


def _row_by_row(x, w, eps, add=None):
    out = np.empty_like(x)
    for r in range(x.shape[0]):
        s = 0.0
        for v in x[r]:
            s += float(np.float32(v * v))
        mean = np.float32(s / x.shape[1])
        scale = np.float32(1.0) / np.float32(math.sqrt(np.float32(mean + eps)))
        out[r] = (x[r] * scale).astype(np.float32) * w[r % w.shape[0]]
        if add is not None:
            out[r] += add[r]
    return out


@pytest.mark.parametrize("rows,n", [(1, 40), (3, 40), (4, 40), (5, 40), (8, 40), (11, 40), (16, 40), (37, 44),
                                    (32, 8), (17, 5)])
@pytest.mark.parametrize("w_rows", [1, "all"])
def test_rms_norm_mul_rows_match_the_one_row_loop(rows, n, w_rows):
    # 16 rows and more: two vectors of eight rows' sums (d8_add_squares); n % 8: the chains' leftover columns
    rng = np.random.default_rng(rows)
    x = (rng.standard_normal((rows, n)) * 10.0 ** rng.integers(-4, 5, (rows, n))).astype(np.float32)
    w = rng.standard_normal((rows if w_rows == "all" else 1, n)).astype(np.float32)
    eps = np.float32(1e-6)
    want = _row_by_row(x, w, eps)
    add = rng.standard_normal((rows, n)).astype(np.float32)
    want_add = _row_by_row(x, w, eps, add)
    for fn in (norm.rms_norm_mul_rows, norm.rms_norm_mul_rows_par):
        out = np.empty_like(x)
        fn(x, w, eps, out, np.zeros((1, 0), np.float32))
        assert np.array_equal(out.view(np.uint32), want.view(np.uint32)), fn.__name__
        fn(x, w, eps, out, add)          # with the residual add fused in (Gemma's post-norms)
        assert np.array_equal(out.view(np.uint32), want_add.view(np.uint32)), fn.__name__
