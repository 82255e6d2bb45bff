"""Edge cases where the cpu backend must do what ggml-cpu does, pinned twice: against the reference backend and
against values worked out by hand from ggml's code (x86 build).

- Q8_0 / Q8_1 stores (SET_ROWS, CPY): type_traits_cpu[].from_float is arch/x86/quants.c quantize_row_q8_0/q8_1:
  ``id = 127 / amax``, ``_mm256_round_ps(x * id, _MM_ROUND_NEAREST)``: halves to even.
- Split GLU: ggml_glu_split always records swapped = 0 and the kernels read ``swapped`` only without src1.
- CLAMP: ops.cpp ``MAX(MIN(x, max), min)`` with ggml's ``MIN(a, b) = a < b ? a : b``, ``MAX(a, b) = a > b ? a : b``.
- ARGMAX: vec.h ggml_vec_argmax_f32: ``max = -INFINITY; idx = 0; for i: max = MAX(max, x[i]); if (max == x[i])
  idx = i;``.
"""
from __future__ import annotations

import numpy as np
import pytest

from llampy.ggml import ops
from llampy.ggml.backend import backend_init
from llampy.ggml.types import GGMLType as T

from .helpers import leaf, run

CPU = backend_init("cpu")
REF = backend_init("reference")
NAN, INF = np.nan, np.inf


def _both(build):
    """build(B) on the cpu and on the reference backend, each result as rows [ne1 * ne2 * ne3, ne0 or row bytes];
    B(type, np_shape, value) places a leaf."""
    outs = []
    for be in (CPU, REF):
        out = run(be, build(lambda ty, shape, value, be=be: leaf(be, ty, shape, value)))[0]
        outs.append(out.reshape(-1, out.shape[-1]))
    return outs


# ------------------------------------------------------------------------------------------------ Q8_0 / Q8_1 stores
_HALVES = np.zeros(32, np.float32)
_HALVES[:5] = [127.0, 0.5, 2.5, -0.5, 1.5]       # amax 127: d = 1, id = 1, so q = round(x) exactly at the halves
_Q_EVEN = [127, 0, 2, 0, 2]                        # _MM_ROUND_NEAREST; roundf (half away from zero) gives 1, 3, -1, 2


def _q8_0_block(qs, d=1.0):
    return np.concatenate([np.array([d], "<f2").view(np.uint8), np.array(qs, np.int8).view(np.uint8)])


def _q8_1_block(qs, d=1.0):
    s = np.float32(d) * np.float32(np.sum(qs))
    return np.concatenate([np.array([d, s], "<f2").view(np.uint8), np.array(qs, np.int8).view(np.uint8)])


def _qs(head):
    q = np.zeros(32, np.int8)
    q[:len(head)] = head
    return q


def test_set_rows_q8_0_rounds_halves_to_even():
    rows = np.stack([_HALVES, -_HALVES, 0.25 * _HALVES])      # the last: amax 31.75, id = 127/31.75 = 4: exact again
    cpu, ref = _both(lambda B: ops.set_rows(B(T.Q8_0, (4, 32), np.zeros((4, 32))), B(T.F32, (3, 32), rows),
                                            B(T.I64, (3,), np.array([2, 0, 3]))))
    want = np.zeros((4, 34), np.uint8)
    want[1] = _q8_0_block(np.zeros(32), 0.0)                   # the row nobody wrote: zeros as placed
    want[2] = _q8_0_block(_qs(_Q_EVEN))
    want[0] = _q8_0_block(-_qs(_Q_EVEN))
    want[3] = _q8_0_block(_qs(_Q_EVEN), np.float32(31.75) / np.float32(127))
    np.testing.assert_array_equal(ref, want)
    np.testing.assert_array_equal(cpu, want)


@pytest.mark.parametrize("qt", [T.Q8_0, T.Q8_1], ids=["q8_0", "q8_1"])
def test_cpy_to_q8_rounds_halves_to_even(qt):
    x = np.stack([_HALVES, np.roll(_HALVES, 7)])
    cpu, ref = _both(lambda B: ops.cpy(B(T.F32, (2, 32), x), B(qt, (2, 32), np.zeros((2, 32)))))
    block = _q8_0_block if qt == T.Q8_0 else _q8_1_block
    want = np.stack([block(_qs(_Q_EVEN)), block(np.roll(_qs(_Q_EVEN), 7))])
    np.testing.assert_array_equal(ref, want)
    np.testing.assert_array_equal(cpu, want)


def test_q8_0_store_scales_by_127_over_amax():
    """x86 multiplies by id = 127/amax (423.3333 for amax 0.3); the reference C code by 1/d, d = amax/127
    (423.33334): these three values land just below a half with the first and just above it with the second."""
    x = np.zeros((1, 32), np.float32)
    x[0, :4] = [0.3, 0.06732283532619476, 0.14527559280395508, 0.2799212634563446]
    cpu, ref = _both(lambda B: ops.cpy(B(T.F32, (1, 32), x), B(T.Q8_0, (1, 32), np.zeros((1, 32)))))
    want = _q8_0_block(_qs([127, 28, 61, 118]), np.float32(0.3) / np.float32(127))[None]
    np.testing.assert_array_equal(ref, want)
    np.testing.assert_array_equal(cpu, want)


# ------------------------------------------------------------------------------------------------ split GLU, swapped
def test_glu_split_form_takes_no_swapped():
    """ggml_glu_split has no swapped argument (ggml_glu_impl(ctx, a, b, op, false)): the builder refuses it."""
    a = leaf(CPU, T.F32, (2, 8), np.ones((2, 8)))
    for glu in (ops.swiglu, ops.geglu):
        with pytest.raises(ValueError, match="swapped"):
            glu(a, a, True)
        assert glu(a, a).op_params["swapped"] is False
        assert glu(leaf(CPU, T.F32, (2, 8)), None, True).op_params["swapped"] is True


@pytest.mark.parametrize("op", ["swiglu", "geglu"])
@pytest.mark.parametrize("n", [8, 40])         # 40 rows: the cpu's own GLU path past its fused threshold too
def test_glu_split_ignores_a_recorded_swapped(op, n):
    """A split node whose op_params say swapped (a graph built around the builder) is act(a) * b: ops.cpp reads
    swapped only ``if (!src1)``."""
    g = np.linspace(-3, 3, n * 16, dtype=np.float32).reshape(n, 16)
    u = np.linspace(2, -1, n * 16, dtype=np.float32).reshape(n, 16)

    def build(B):
        out = getattr(ops, op)(B(T.F32, (n, 16), g), B(T.F32, (n, 16), u))
        out.op_params["swapped"] = True
        return out
    cpu, ref = _both(build)
    g64, u64 = g.astype(np.float64), u.astype(np.float64)
    if op == "swiglu":
        want = g64 / (1 + np.exp(-g64)) * u64
    else:
        want = 0.5 * g64 * (1 + np.tanh(np.sqrt(2 / np.pi) * (g64 + 0.044715 * g64 ** 3))) * u64
    np.testing.assert_allclose(ref, want, rtol=0, atol=2e-3)  # GEGLU goes through ggml's F16 table
    np.testing.assert_allclose(cpu, ref, rtol=0, atol=1e-6)


# ------------------------------------------------------------------------------------------------ CLAMP
def test_clamp_nan_and_crossed_bounds():
    x = np.array([[NAN, -NAN, INF, -INF, 0.5, -2.0, 3.0, -0.0]], np.float32)
    cpu, ref = _both(lambda B: ops.clamp(B(T.F32, (1, 8), x), -1.0, 1.0))
    # MIN(NaN, 1) = 1 (NaN < 1 is false), then MAX(1, -1) = 1
    want = np.array([[1.0, 1.0, 1.0, -1.0, 0.5, -1.0, 1.0, -0.0]], np.float32)
    np.testing.assert_array_equal(ref, want)
    np.testing.assert_array_equal(cpu, want)
    # min > max: MAX(MIN(x, max), min) is min for every x, NaN included (np.clip would give max)
    cpu, ref = _both(lambda B: ops.clamp(B(T.F32, (1, 8), x), 2.0, -2.0))
    np.testing.assert_array_equal(ref, np.full((1, 8), 2.0, np.float32))
    np.testing.assert_array_equal(cpu, np.full((1, 8), 2.0, np.float32))


# ------------------------------------------------------------------------------------------------ ARGMAX
ARGMAX_ROWS = [
    ([1.0, 3.0, 2.0, 3.0, 0.0, 3.0, -1.0, 2.0], 5),          # equal maxima: the last
    ([-INF] * 8, 7),                                          # all -inf: MAX(-inf, -inf) == x[i] every step
    ([NAN] * 8, 0),                                           # all NaN: never equal, idx stays 0
    ([5.0, NAN, 1.0, 0.0, -3.0, 0.5, -1.0, -2.0], 2),         # after a NaN max restarts from the next value
    ([NAN, 2.0, 1.0, 2.0, 0.0, -1.0, -2.0, -3.0], 3),         # ... so a leading NaN is skipped
    ([1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, NAN], 6),            # a trailing NaN: the max before it stays
    ([INF, 0.0, INF, NAN, -INF, -INF, -INF, -INF], 7),        # after the NaN only -inf: the last of them
    ([0.0, -0.0, 0.0, -0.0, -1.0, -1.0, -1.0, -1.0], 3),      # 0.0 == -0.0
]


def test_argmax_ties_nan_and_minus_inf():
    x = np.array([r for r, _ in ARGMAX_ROWS], np.float32)
    want = np.array([[i for _, i in ARGMAX_ROWS]], np.int32)
    cpu, ref = _both(lambda B: ops.argmax(B(T.F32, x.shape, x)))
    np.testing.assert_array_equal(ref, want)
    np.testing.assert_array_equal(cpu, want)


def test_argmax_random_rows_of_edge_values():
    """Rows drawn from NaN, ±inf, ±0 and a few ties: the cpu's vectorised form against the reference's step by
    step transliteration of ggml_vec_argmax_f32."""
    alphabet = np.array([NAN, -INF, INF, 0.0, -0.0, 1.0, 2.0, -1.0], np.float32)
    x = alphabet[np.random.default_rng(3).integers(0, len(alphabet), (300, 9))]
    x[:40, :] = np.where(np.isnan(x[:40]), -INF, x[:40])[:, ::-1]        # some rows without NaN
    x[40:60] = np.where(np.random.default_rng(4).random((20, 9)) < 0.8, NAN, -INF)   # mostly NaN
    cpu, ref = _both(lambda B: ops.argmax(B(T.F32, x.shape, x)))
    np.testing.assert_array_equal(cpu, ref)
