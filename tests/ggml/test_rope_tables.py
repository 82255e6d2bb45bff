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


def _rotate_one_by_one(x, cos, sin, n_dims, neox):
    """ggml's rotation per pair: fma(x0, cos, -(x1 * sin)) and fma(x0, sin, x1 * cos), the products of x1 rounded
    to float32; the fma's exact sum through float64 (the product of two floats is exact there)."""
    out = x.copy()
    half = n_dims // 2
    for j in range(half):
        i0, i1 = (j, j + half) if neox else (2 * j, 2 * j + 1)
        c, s = cos[:, j][None, :, None].astype(np.float64), sin[:, j][None, :, None].astype(np.float64)
        x0, x1 = x[..., i0].astype(np.float64), x[..., i1]
        out[..., i0] = (x0 * c - (x1 * sin[:, j][None, :, None]).astype(np.float32)).astype(np.float32)
        out[..., i1] = (x0 * s + (x1 * cos[:, j][None, :, None]).astype(np.float32)).astype(np.float32)
    return out


def test_neox_halves_sixteen_lanes_at_a_time_keep_the_bits():
    # NEOX pairs (j, j + n_dims/2) go sixteen per step (simd v16_fma), the rest and the normal mode one by one
    rng = np.random.default_rng(3)
    for hd, n_dims, neox in ((256, 256, True), (64, 40, True), (64, 64, False)):
        x = (rng.standard_normal((1, 9, 3, hd)) * 10.0 ** rng.uniform(-3, 3, (1, 9, 3, hd))).astype(np.float32)
        ang = rng.uniform(0, 100, (9, n_dims // 2))
        cos, sin = np.cos(ang).astype(np.float32), np.sin(ang).astype(np.float32)
        want = _rotate_one_by_one(x, cos, sin, n_dims, neox)
        for apply in (R.rope_apply, R.rope_apply_1):
            out = np.empty_like(x)
            apply(x, out, cos, sin, n_dims, neox)
            assert np.array_equal(out.view(np.uint32), want.view(np.uint32)), (hd, n_dims, neox)


def test_theta_scale_is_powf_of_a_float_exponent():
    # ggml: theta_scale = powf(freq_base, -2.0f/n_dims); with 24 rotated values -2/24 is not exact in float, and
    # powf of the float exponent differs from pow of the double one by an ulp, which position 1000 makes visible
    p = dict(_params(10000.0), n_dims=24)
    ts = np.float32(10000.0) ** np.float32(np.float32(-2.0) / np.float32(24))
    x = np.zeros((1, 1, 1, 24), np.float32)
    x[..., 1] = 1.0                                            # NEOX pair (1, 13): out = (cos, sin) of pair 1
    out = _fresh(x, np.array([1000], np.int32), p)
    theta = np.float32(np.float32(1000.0) * ts)
    assert abs(out[0, 0, 0, 1] - np.cos(np.float64(theta))) < 1e-6
    assert abs(out[0, 0, 0, 13] - np.sin(np.float64(theta))) < 1e-6
