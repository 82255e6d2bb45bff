"""The activation kernels against their one-value-at-a-time definitions (llampy/ggml/backends/cpu/act.py)."""
from __future__ import annotations

import numpy as np

from llampy.ggml.backends.cpu.act import geglu_rows, gelu_table


def _geglu_reference(g, u, table):
    """ggml_vec_geglu_f32 with GGML_GELU_FP16, value by value."""
    out = np.empty_like(g)
    for idx, x in np.ndenumerate(g):
        if x <= -10:
            out[idx] = 0.0
        elif x >= 10:
            out[idx] = x * u[idx]
        else:
            out[idx] = table[np.float32(x).astype(np.float16).view(np.uint16)] * u[idx]
    return out


def test_geglu_rows_matches_the_definition_bit_for_bit():
    rng = np.random.default_rng(3)
    g = (rng.standard_normal((6, 53)) * 6).astype(np.float32)       # 53: three vector steps and a scalar tail
    u = rng.standard_normal((6, 53)).astype(np.float32)
    g[0, :12] = [-10, 10, -10.0001, 9.9999, np.inf, -np.inf, np.nan, 0.0, -0.0, 1e-8, 65504, -65520]
    g[1, :8] = -20                                                    # zero, whatever u is (not -0.0 or NaN)
    u[1, :8] = [np.inf, -np.inf, np.nan, -0.0, -1, -2, 3, 0]
    g[2, 48:] = [-10, 10, -9.99, np.nan, 2.5]                        # the edge cases in the scalar tail too
    table = gelu_table()
    out = np.empty_like(g)
    geglu_rows(g, u, table, out)
    ref = _geglu_reference(g, u, table)
    assert np.array_equal(out.view(np.uint32), ref.view(np.uint32))


def test_glu_rows_on_all_threads_equal_the_serial_rows():
    """The prompt forms (rows on all threads) give the serial kernels' bits."""
    from llampy.ggml.backends.cpu.act import geglu_rows_par, swiglu_rows, swiglu_rows_par
    rng = np.random.default_rng(4)
    g = (rng.standard_normal((37, 83)) * 6).astype(np.float32)
    u = rng.standard_normal((37, 83)).astype(np.float32)
    table = gelu_table()
    for serial, par, extra in ((geglu_rows, geglu_rows_par, (table,)), (swiglu_rows, swiglu_rows_par, ())):
        a, b = np.empty_like(g), np.empty_like(g)
        serial(g, u, *extra, a)
        par(g, u, *extra, b)
        assert np.array_equal(a.view(np.uint32), b.view(np.uint32))
