"""RoPE's cos/sin tables are shared by the nodes of one batch and refilled only when the positions change
(llampy/ggml/backends/cpu/rope.py)."""
from __future__ import annotations

import numpy as np

from llampy.ggml.backends.cpu import rope as R


def _params(base):
    return {"n_dims": 16, "freq_base": base, "ext_factor": 0.0, "n_ctx_orig": 0, "beta_fast": 32.0,
            "beta_slow": 1.0, "freq_scale": 1.0, "attn_factor": 1.0, "mode": 2}


def _fresh(x, pos, p):
    R._TRIG.clear()
    out = R.rope(x, pos.copy(), p, None)
    R._TRIG.clear()
    return out


def test_tables_follow_the_positions_and_the_constants():
    rng = np.random.default_rng(0)
    x = rng.standard_normal((1, 8, 2, 16)).astype(np.float32)
    pos = np.arange(8, dtype=np.int32)
    want_a = _fresh(x, pos, _params(10000.0))
    want_b = _fresh(x, pos, _params(1e6))
    pos2 = pos + 100
    want_a2 = _fresh(x, pos2, _params(10000.0))

    out_a, out_b = np.empty_like(x), np.empty_like(x)
    run_a = R.bind(x, pos, _params(10000.0), None, out_a)      # same shape, two sets of constants (Gemma 3's
    run_b = R.bind(x, pos, _params(1e6), None, out_b)          # local and global layers)
    for _ in range(2):
        run_a()
        run_b()
        assert np.array_equal(out_a, want_a) and np.array_equal(out_b, want_b)
    pos[:] = pos2                                              # the next batch writes the same input buffer
    run_a()
    assert np.array_equal(out_a, want_a2)
    assert not np.array_equal(want_a2, want_a)
