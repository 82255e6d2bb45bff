"""RMS_NORM_MUL four rows at a time (llampy/ggml/backends/cpu/norm.py) gives every row the bits of ggml's one-row
loop: squares rounded to float32, summed in double in order, the scale in float32."""
from __future__ import annotations

import math

import numpy as np
import pytest

from llampy.ggml.backends.cpu import norm


def _row_by_row(x, w, eps):
    out = np.empty_like(x)
    for r in range(x.shape[0]):
        s = 0.0
        for v in x[r]:
            s += float(np.float32(v * v))
        mean = np.float32(s / x.shape[1])
        scale = np.float32(1.0) / np.float32(math.sqrt(np.float32(mean + eps)))
        out[r] = (x[r] * scale).astype(np.float32) * w[r % w.shape[0]]
    return out


@pytest.mark.parametrize("rows", [1, 3, 4, 5, 8, 11])
@pytest.mark.parametrize("w_rows", [1, "all"])
def test_rms_norm_mul_rows_match_the_one_row_loop(rows, w_rows):
    rng = np.random.default_rng(rows)
    n = 40
    x = (rng.standard_normal((rows, n)) * 10.0 ** rng.integers(-4, 5, (rows, n))).astype(np.float32)
    w = rng.standard_normal((rows if w_rows == "all" else 1, n)).astype(np.float32)
    eps = np.float32(1e-6)
    want = _row_by_row(x, w, eps)
    for fn in (norm.rms_norm_mul_rows, norm.rms_norm_mul_rows_par):
        out = np.empty_like(x)
        fn(x, w, eps, out)
        assert np.array_equal(out.view(np.uint32), want.view(np.uint32)), fn.__name__
