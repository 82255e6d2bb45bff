"""The cpu backend's matrix products (llampy/ggml/backends/cpu/{matmul,dot_q32,dot_kquant_scalar,act_quant}.py).

Oracles: gguf-py (``gguf.quants``) for the block formats and the Q8_0 activation bytes; NumPy transliterations of
ggml's ``quantize_row_q8_1`` (x86) and ``quantize_row_q8_K_ref``; a float64 product of gguf-py's dequantized
weights and x rounded through the dot type; and, for Q8_0, Q4_0 and Q4_1, a NumPy transliteration of ggml's AVX2
``ggml_vec_dot`` lane order (the integer path must match it bit for bit), and for Q4_0's rows % 8 == 0 of the
repacked gemv / gemm chain llama.cpp runs on them instead.
"""
from __future__ import annotations

import functools

import numpy as np
import pytest

import gguf.quants as gq
from gguf import GGMLQuantizationType as G

from llampy.ggml import quants as lq
from llampy.ggml.backends.cpu import matmul as mm
from llampy.ggml.backends.cpu.act_quant import act_split, quantize_act
from llampy.ggml.backends.cpu.direct import resolve_calls
from llampy.ggml.types import GGMLType as T, TYPE_TRAITS

BLOCK_TYPES = [T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q8_0, T.Q4_K, T.Q5_K, T.Q6_K]
K_QUANTS = {T.Q4_K, T.Q5_K, T.Q6_K}


# ------------------------------------------------------------------------------------------------ oracles

def f16(v):
    return np.asarray(v, np.float32).astype(np.float16).astype(np.float32)


def ref_q8_x86(x):
    """ggml x86 quantize_row_q8_0/q8_1: (q int8 [n, k], d F16 values [n, nb], s F16 values [n, nb])."""
    n, k = x.shape
    b = x.reshape(n, k // 32, 32)
    amax = np.abs(b).max(axis=2)
    d = (amax / np.float32(127)).astype(np.float32)
    with np.errstate(divide="ignore"):
        idv = np.where(amax != 0, np.float32(127) / amax, np.float32(0)).astype(np.float32)
    q = np.rint((b * idv[:, :, None]).astype(np.float32)).astype(np.int8)
    s = f16(d * q.astype(np.int32).sum(axis=2).astype(np.float32))
    return q.reshape(n, k), f16(d), s


def ref_q8_k(x):
    """ggml quantize_row_q8_K_ref, block by block in plain Python/NumPy: bytes [n, nb * 292]."""
    n, k = x.shape
    out = np.zeros((n, k // 256, 292), np.uint8)
    for i in range(n):
        for b in range(k // 256):
            v = x[i, b * 256:(b + 1) * 256]
            j = int(np.argmax(np.abs(v)))           # first of the largest magnitudes, as the C loop's '>'
            if v[j] == 0:
                continue
            iscale = np.float32(np.float32(-127.0) / v[j])
            q = np.minimum(127, np.rint((iscale * v).astype(np.float32))).astype(np.int8)
            out[i, b, 0:4] = np.array([np.float32(1.0) / iscale], np.float32).view(np.uint8)
            out[i, b, 4:260] = q.view(np.uint8)
            out[i, b, 260:292] = q.reshape(16, 16).astype(np.int16).sum(axis=1).astype(np.int16).view(np.uint8)
    return out.reshape(n, -1)


def x_rounded(x, vdt):
    """x through the dot type and back, from the oracles above: float64 [n, k] (and Q8_1's s per block)."""
    n, k = x.shape
    if vdt == T.Q8_K:
        b = ref_q8_k(x).reshape(n, k // 256, 292)
        d = b[:, :, 0:4].copy().view(np.float32)
        q = b[:, :, 4:260].copy().view(np.int8).astype(np.float64)
        return (q * d).reshape(n, k), None
    q, d, s = ref_q8_x86(x)
    xr = q.reshape(n, k // 32, 32).astype(np.float64) * d[:, :, None]
    return xr.reshape(n, k), (s if vdt == T.Q8_1 else None)


# quant bytes of each type (the rest are scales and mins): zeroing them leaves each element's offset term
QUANT_BYTES = {T.Q4_1: [(4, 20)], T.Q5_1: [(4, 24)], T.Q4_K: [(16, 144)], T.Q5_K: [(16, 176)],
               T.Q6_K: [(0, 192)]}


def magnitudes(wq, wtype, wd):
    """Per element, the size of the terms ggml's arithmetic adds (not just of the weight): Q4_1/Q5_1 add
    d*q and m separately, Q4_K/Q5_K d*sc*q and dmin*m, Q6_K d*sc*q and d*sc*32 (through the block sums), so a
    float32 result carries the rounding of those larger terms when they cancel."""
    if wtype not in QUANT_BYTES:
        return np.abs(wd)
    rows, k = wd.shape
    b = np.ascontiguousarray(wq).reshape(rows, -1, TYPE_TRAITS[wtype].type_size).copy()
    for lo, hi in QUANT_BYTES[wtype]:
        b[:, :, lo:hi] = 0
    off = gq.dequantize(b.reshape(rows, -1), G(int(wtype))).reshape(rows, k).astype(np.float64)
    return np.abs(wd - off) + np.abs(off)


def oracle(wq, wtype, x):
    """float64 products as llama.cpp defines them: x rounded through the dot type; Q4_1/Q5_1 add m_w * s_x.
    Also the scale of the terms summed, for tolerances."""
    rows, k = wq.shape[0], x.shape[1]
    wd = gq.dequantize(np.ascontiguousarray(wq), G(int(wtype))).reshape(rows, k).astype(np.float64)
    xr, s = x_rounded(x, TYPE_TRAITS[wtype].vec_dot_type)
    res = xr @ wd.T
    if s is not None:
        bs = TYPE_TRAITS[wtype].type_size
        mins = np.ascontiguousarray(wq).reshape(rows, k // 32, bs)[:, :, 2:4].copy().view(np.float16)[:, :, 0]
        res += (s - xr.reshape(x.shape[0], k // 32, 32).sum(axis=2)) @ mins.astype(np.float64).T
    scale = np.abs(xr) @ magnitudes(wq, wtype, wd).T + 1e-30
    return res, scale


def quantize_w(w, t):
    if t in K_QUANTS:    # gguf-py has no k-quant quantizer; llampy's is bit-identical to libggml (test_quants)
        return lq.quantize(w, t)
    return gq.quantize(w, G(int(t)))


def check(out, wq, wtype, x, tol=3e-6):
    ref, scale = oracle(wq, wtype, x)
    err = np.abs(out.astype(np.float64) - ref) / scale
    assert err.max() < tol, (wtype.name, err.max())


# ------------------------------------------------------------------------------------------------ activations

def act_data(rng, n, k):
    x = (rng.standard_normal((n, k)) * np.exp(rng.standard_normal((n, 1)) * 2)).astype(np.float32)
    x[0, :32] = 0                       # an all-zero block
    x[-1, 40] = 3e4                     # an outlier, as SmolLM2's residual stream carries
    return x


def test_quantize_act_q8_0_equals_gguf_py():
    x = act_data(np.random.default_rng(1), 7, 512)
    assert np.array_equal(quantize_act(x, T.Q8_0), gq.quantize(x, G.Q8_0))


def test_quantize_act_q8_1_equals_x86_transliteration():
    x = act_data(np.random.default_rng(2), 5, 256)
    q, d, s = ref_q8_x86(x)
    got = quantize_act(x, T.Q8_1).reshape(5, 8, 36)
    assert np.array_equal(got[:, :, 0:2].copy().view(np.float16)[:, :, 0], d.astype(np.float16))
    assert np.array_equal(got[:, :, 2:4].copy().view(np.float16)[:, :, 0], s.astype(np.float16))
    assert np.array_equal(got[:, :, 4:].copy().view(np.int8).reshape(5, 256), q)


def test_quantize_act_q8_k_equals_ref_transliteration():
    x = act_data(np.random.default_rng(3), 4, 768)
    x[1, 256:512] = 0
    x[2, 10], x[2, 11] = 50.0, -50.0    # equal magnitudes: the first one sets the scale
    assert np.array_equal(quantize_act(x, T.Q8_K), ref_q8_k(x))
    assert np.array_equal(quantize_act(x, T.Q8_K), lq.quantize(x, T.Q8_K))


# ------------------------------------------------------------------------------------------------ products

@pytest.mark.parametrize("wtype", BLOCK_TYPES, ids=lambda t: t.name)
def test_mul_mat_block_types_both_paths(wtype):
    rng = np.random.default_rng(int(wtype))
    k = 512
    rows = 37                                   # odd, not a multiple of the row chunk or of 8
    wq = quantize_w(rng.standard_normal((rows, k)).astype(np.float32), wtype)
    for n in (1, 3, 17, 64, 300):
        x = act_data(rng, n, k)
        exact = np.empty((n, rows), np.float32)
        mm.mul_mat(wq, wtype, x, exact, 1 << 30)
        check(exact, wq, wtype, x)
        blas = np.empty((n, rows), np.float32)
        mm.mul_mat(wq, wtype, x, blas, 0)
        check(blas, wq, wtype, x)
        default = np.empty((n, rows), np.float32)
        mm.mul_mat(wq, wtype, x, default)
        assert np.array_equal(default, exact if n <= mm.DECODE_MAX_ROWS else blas)


@pytest.mark.parametrize("wtype", [T.Q4_1, T.Q8_0, T.Q4_K, T.Q6_K], ids=lambda t: t.name)
def test_mul_mat_strided_views(wtype):
    """w rows inside a wider buffer, x and out as row-strided views: same results as contiguous arrays."""
    rng = np.random.default_rng(7)
    k, rows, n = 512, 24, 5
    wq = quantize_w(rng.standard_normal((rows, k)).astype(np.float32), wtype)
    wide = np.zeros((rows, wq.shape[1] + 40), np.uint8)
    wide[:, 16:16 + wq.shape[1]] = wq
    wv = wide[:, 16:16 + wq.shape[1]]
    x = act_data(rng, n, k)
    xwide = np.zeros((n, k + 64), np.float32)
    xwide[:, 32:32 + k] = x
    xv = xwide[:, 32:32 + k]
    for limit in (1 << 30, 0):
        ref = np.empty((n, rows), np.float32)
        mm.mul_mat(wq, wtype, x, ref, limit)
        owide = np.full((n, rows + 9), np.nan, np.float32)
        ov = owide[:, 4:4 + rows]
        mm.mul_mat(wv, wtype, xv, ov, limit)
        assert np.array_equal(ov, ref)
        assert np.isnan(owide[:, :4]).all() and np.isnan(owide[:, 4 + rows:]).all()


def q4_0_values(blk):
    """Q4_0 blocks [rows, nb, 18] -> their values q - 8 [rows, nb, 32] (low nibbles, then high ones)."""
    nib = blk[:, :, 2:].astype(np.int64)
    return np.concatenate([nib & 15, nib >> 4], axis=2) - 8


def vec_dot_avx2(wq, wtype, x):
    """ggml_vec_dot_{q8_0_q8_0, q4_0_q8_0, q4_1_q8_1} as the x86 build computes it, in NumPy over all rows at once:
    lanes of four products, acc = fma(d_w * d_x, lane, acc) per block (float64 product + sum, rounded once),
    hsum_float_8, then + summs for Q4_1 (summs = fma(m, s, summs))."""
    rows, k = wq.shape[0], x.shape[1]
    nb = k // 32
    q, d, s = ref_q8_x86(x)
    bs = TYPE_TRAITS[wtype].type_size
    blk = np.ascontiguousarray(wq).reshape(rows, nb, bs)
    dw = blk[:, :, 0:2].copy().view(np.float16)[:, :, 0].astype(np.float32)
    if wtype == T.Q8_0:
        vals = blk[:, :, 2:].copy().view(np.int8).astype(np.int64)
    elif wtype == T.Q4_0:
        vals = q4_0_values(blk)
    else:
        nib = blk[:, :, 4:].astype(np.int64)
        vals = np.concatenate([nib & 15, nib >> 4], axis=2)
        mw = blk[:, :, 2:4].copy().view(np.float16)[:, :, 0].astype(np.float32)
    out = np.empty((x.shape[0], rows), np.float32)
    for i in range(x.shape[0]):
        lanes = (vals * q[i].reshape(nb, 32).astype(np.int64)).reshape(rows, nb, 8, 4).sum(axis=3)
        acc = np.zeros((rows, 8), np.float32)
        summs = np.zeros(rows, np.float32)
        for b in range(nb):
            dd = (dw[:, b] * d[i, b]).astype(np.float32)
            acc = (dd[:, None].astype(np.float64) * lanes[:, b].astype(np.float32) + acc).astype(np.float32)
            if wtype == T.Q4_1:
                summs = (mw[:, b].astype(np.float64) * s[i, b] + summs).astype(np.float32)
        a = acc
        out[i] = ((a[:, 4] + a[:, 0]) + (a[:, 6] + a[:, 2])) + ((a[:, 5] + a[:, 1]) + (a[:, 7] + a[:, 3]))
        if wtype == T.Q4_1:
            out[i] += summs
    return out


@pytest.mark.parametrize("wtype", [T.Q8_0, T.Q4_0, T.Q4_1], ids=lambda t: t.name)
def test_integer_path_is_bit_identical_to_ggml_lane_order(wtype):
    rng = np.random.default_rng(11)
    k, rows = 576, 29
    wq = quantize_w(rng.standard_normal((rows, k)).astype(np.float32), wtype)
    for n in (3, 11):        # 11: the eight-activation tile and the smaller ones
        x = act_data(rng, n, k)
        out = np.empty((n, rows), np.float32)
        mm.mul_mat(wq, wtype, x, out, 1 << 30)
        assert np.array_equal(out, vec_dot_avx2(wq, wtype, x))


@pytest.mark.parametrize("wtype", [T.Q8_0, T.Q4_1], ids=lambda t: t.name)
def test_prompt_tiles_over_long_rows(wtype):
    """Rows longer than the eight-row tiles' span (dot_q32.KSPAN blocks, the accumulators and the min term left in a
    buffer between spans; more activation rows than a decode step's whole-row tiles take, WHOLE_ROWS_MAX_N), eight
    activation rows after the sixteen-row tiles and a last chunk of weight rows short of ROW_CHUNK: still ggml's
    lane order, bit for bit."""
    from llampy.ggml.backends.cpu import dot_q32, dot_whole
    rng = np.random.default_rng(14)
    k, rows, n = 32 * (2 * dot_q32.KSPAN + 2), dot_q32.ROW_CHUNK + 5, dot_whole.WHOLE_ROWS_MAX_N + 8
    wq = quantize_w(rng.standard_normal((rows, k)).astype(np.float32), wtype)
    x = act_data(rng, n, k)
    out = np.empty((n, rows), np.float32)
    mm.mul_mat(wq, wtype, x, out, 1 << 30)
    assert np.array_equal(out, vec_dot_avx2(wq, wtype, x))


def repacked_chain_q4_0(wq, x):
    """ggml_gemv/gemm_q4_0_8x8_q8_0 (the x86 build's kernels for the Q4_0 rows it repacks) in NumPy: per pair and
    block the exact integer sum, ``acc = fma(f32(isum), d_w * d_x, acc)`` in block order (float64 product + sum,
    rounded once)."""
    rows, k = wq.shape[0], x.shape[1]
    nb = k // 32
    q, d, _ = ref_q8_x86(x)
    blk = np.ascontiguousarray(wq).reshape(rows, nb, 18)
    dw = blk[:, :, 0:2].copy().view(np.float16)[:, :, 0].astype(np.float32)
    isum = np.einsum("rbj,ibj->irb", q4_0_values(blk), q.reshape(-1, nb, 32).astype(np.int64))
    acc = np.zeros((x.shape[0], rows), np.float32)
    for b in range(nb):
        dd = (dw[None, :, b] * d[:, None, b]).astype(np.float32)
        acc = (isum[:, :, b].astype(np.float32).astype(np.float64) * dd + acc).astype(np.float32)
    return acc


def test_q4_0_repacked_rows_take_the_repacked_chain():
    """Q4_0 weights with rows % 8 == 0, which llama.cpp repacks on x86 (AVX2 and AVX-512 builds): every batch size
    (decode kernel and prompt tiles) gives the repacked chain's bits; the same rows where llama.cpp keeps them as
    they are (``repacked=False``: a view of the KV cache) give ``ggml_vec_dot_q4_0_q8_0``'s."""
    rng = np.random.default_rng(14)
    k, rows = 576, 32
    wq = quantize_w(rng.standard_normal((rows, k)).astype(np.float32), T.Q4_0)
    for n in (1, 3, 19):
        x = act_data(rng, n, k)
        out = np.empty((n, rows), np.float32)
        mm.mul_mat(wq, T.Q4_0, x, out, 1 << 30)
        assert np.array_equal(out, repacked_chain_q4_0(wq, x)), n
        mm.mul_mat(wq, T.Q4_0, x, out, 1 << 30, repacked=False)
        assert np.array_equal(out, vec_dot_avx2(wq, T.Q4_0, x)), n


@pytest.mark.parametrize("wtype", [T.Q4_0, T.Q4_1, T.Q8_0, T.Q4_K, T.Q5_K, T.Q6_K, T.Q2_K, T.F16],
                         ids=lambda t: t.name)
def test_bound_decode_products_equal_mul_mat(wtype):
    """A plan's bound product of a decoded token (``bind_mul_mat``: Q4_0's repacked decode kernel, the block table's
    (Q2_K) and the 32-value formats' decode form rounding x themselves, F16's rounding and product, the k-quants'
    decode kernel called directly) gives ``mul_mat``'s bits,
    also where it reuses the rounding of x that the plan's previous product of the same x left in the shared buffers
    (``reuse``), and so do the calls a plan makes in its place once the kernels are compiled (``direct``: the
    kernels' entry points with the arguments bound), which a limit below the batch's rows leaves out. Q4_1 and Q8_0
    at 8 and 13 rows (a server's decode steps): the whole-row kernel's call bound with its chunk counter, run twice."""
    rng = np.random.default_rng(15)
    k, rows = 512, (32 if wtype == T.Q4_0 else 37)     # Q4_0: the rows llama.cpp repacks
    quant = (lambda w: lq.quantize(w, wtype)) if wtype == T.Q2_K else (lambda w: quantize_w(w, wtype))
    wa, wb = (quant(rng.standard_normal((rows, k)).astype(np.float32)) for _ in range(2))
    for n in ((1, 3, 8, 13) if wtype in (T.Q4_1, T.Q8_0) else (1, 3)):
        x = act_data(rng, n, k)
        ref_a, ref_b = np.empty((n, rows), np.float32), np.empty((n, rows), np.float32)
        mm.mul_mat(wa, wtype, x, ref_a)
        mm.mul_mat(wb, wtype, x, ref_b)
        out_a, out_b = np.full((n, rows), np.nan, np.float32), np.full((n, rows), np.nan, np.float32)
        mm.act_scratch(n, k, wtype).xq[...] = 0      # nothing left from the references' rounding
        run_a = mm.bind_mul_mat(wa, wtype, x, out_a, lambda: None)
        run_b = mm.bind_mul_mat(wb, wtype, x, out_b, lambda: None, reuse=True)
        run_a()
        run_b()
        assert np.array_equal(out_a, ref_a) and np.array_equal(out_b, ref_b), n
        # what the plan runs instead once the kernels are compiled: the same calls on their entry points
        fast = resolve_calls([run_a, run_b])
        assert all(isinstance(c, functools.partial) for c in fast), fast
        for _ in range(2):
            out_a[...] = out_b[...] = np.nan
            mm.act_scratch(n, k, wtype).xq[...] = 0
            for c in fast:
                c()
            assert np.array_equal(out_a, ref_a) and np.array_equal(out_b, ref_b), n
        # bound under a row limit below n: the checked call alone
        assert getattr(mm.bind_mul_mat(wa, wtype, x, out_a, lambda: n - 1), "direct", None) is None


def test_mul_mat_float_types():
    rng = np.random.default_rng(5)
    k, rows, n = 96, 13, 4
    w = rng.standard_normal((rows, k)).astype(np.float32)
    x = rng.standard_normal((n, k)).astype(np.float32)
    out = np.empty((n, rows), np.float32)
    mm.mul_mat(w, T.F32, x, out)
    np.testing.assert_allclose(out, x.astype(np.float64) @ w.T.astype(np.float64), rtol=1e-5, atol=1e-5)
    # F16: x rounded to F16, as ggml's vec_dot_type for F16
    w16 = w.astype(np.float16)
    mm.mul_mat(w16, T.F16, x, out)
    ref = f16(x).astype(np.float64) @ w16.astype(np.float64).T
    np.testing.assert_allclose(out, ref, rtol=1e-5, atol=1e-5)
    # BF16 (raw bits): both rounded to BF16 (round to nearest even)
    wb = gq.quantize(w, G.BF16).view(np.uint16).reshape(rows, k)
    mm.mul_mat(wb, T.BF16, x, out)
    xb = gq.dequantize(gq.quantize(x, G.BF16), G.BF16).astype(np.float64)
    wbf = gq.dequantize(wb.view(np.uint8), G.BF16).reshape(rows, k).astype(np.float64)
    np.testing.assert_allclose(out, xb @ wbf.T, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("wtype", [T.NVFP4], ids=lambda t: t.name)   # TQ*, MXFP4: dot_blocks now
def test_mul_mat_other_types_fall_back(wtype):
    """Types without kernels: dequantized weights times x through the dot type."""
    assert wtype not in mm.SUPPORTED_DIRECT
    rng = np.random.default_rng(9)
    k, rows, n = 256, 11, 2
    wq = lq.quantize(rng.standard_normal((rows, k)).astype(np.float32), wtype)
    x = act_data(rng, n, k)
    out = np.empty((n, rows), np.float32)
    mm.mul_mat(wq, wtype, x, out)
    check(out, wq, wtype, x)


def test_scratch_reuse_and_shape_check():
    rng = np.random.default_rng(4)
    wq = gq.quantize(rng.standard_normal((8, 64)).astype(np.float32), G.Q8_0)
    x1, x2 = act_data(rng, 1, 64), act_data(rng, 1, 64)
    o1, o2 = np.empty((1, 8), np.float32), np.empty((1, 8), np.float32)
    mm.mul_mat(wq, T.Q8_0, x1, o1)
    s = act_split(x2, T.Q8_0)
    mm.mul_mat(wq, T.Q8_0, x2, o2, scratch=s)
    check(o1, wq, T.Q8_0, x1)
    check(o2, wq, T.Q8_0, x2)
    with pytest.raises(ValueError):
        mm.mul_mat(wq, T.Q8_0, x1, np.empty((1, 7), np.float32))


# ------------------------------------------------------------------------------------------------ real weights

def gguf_py_tensors(path, names):
    from gguf import GGUFReader
    r = GGUFReader(path)
    out = {}
    for t in r.tensors:
        if t.name in names:
            wt = T(int(t.tensor_type))
            k = int(t.shape[0])
            rows = int(np.prod(t.shape[1:]))
            row_bytes = k // TYPE_TRAITS[wt].blck_size * TYPE_TRAITS[wt].type_size
            raw = np.fromfile(path, np.uint8, count=rows * row_bytes, offset=int(t.data_offset))
            out[t.name] = (raw.reshape(rows, row_bytes), wt, k)
    return out


def check_real(w, wt, k, rng, n_list=(1, 5)):
    for n in n_list:
        x = act_data(rng, n, k)
        for limit in (1 << 30, 0):
            out = np.empty((n, w.shape[0]), np.float32)
            mm.mul_mat(w, wt, x, out, limit)
            check(out, w, wt, x)


def test_real_smollm2_q4_1_and_q8_0(smollm2_path):
    ts = gguf_py_tensors(smollm2_path, {"blk.0.ffn_down.weight", "token_embd.weight"})
    rng = np.random.default_rng(0)
    w, wt, k = ts["blk.0.ffn_down.weight"]
    assert wt == T.Q4_1 and w.shape == (576, 960)
    check_real(w, wt, k, rng)
    w, wt, k = ts["token_embd.weight"]
    assert wt == T.Q8_0 and w.shape == (49152, 612)
    check_real(w[::16], wt, k, rng, n_list=(2,))      # every 16th row: a strided view of the real matrix


@pytest.mark.slow
def test_real_gemma3_k_quants_and_q5_0(gemma3_path):
    names = {"blk.0.attn_output.weight", "blk.0.ffn_down.weight", "blk.0.ffn_up.weight"}
    ts = gguf_py_tensors(gemma3_path, names)
    rng = np.random.default_rng(1)
    assert {wt for _, wt, _ in ts.values()} == {T.Q4_K, T.Q6_K, T.Q5_0}
    for w, wt, k in ts.values():
        check_real(w[:256], wt, k, rng)


@pytest.mark.parametrize("wtype", [T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q8_0], ids=lambda t: t.name)
def test_integer_path_is_batch_invariant(wtype):
    """Every batch size takes a different tile of the integer kernel (4 rows x 1 or 2 activations, 1 row x 16, 8 or
    4 activations, the last tile's rows past the batch zero: dot_whole.tile_rows); each output must still be
    bit-identical to that activation row computed alone, as in llama.cpp, whose vec_dot computes each (row, column)
    pair the same way whatever the batch."""
    rng = np.random.default_rng(12)
    k, rows = 576, 37
    wq = quantize_w(rng.standard_normal((rows, k)).astype(np.float32), wtype)
    x = act_data(rng, 27, k)
    single = np.empty((27, rows), np.float32)
    for i in range(27):
        mm.mul_mat(wq, wtype, x[i:i + 1], single[i:i + 1], 1 << 30)
    for n in (2, 3, 4, 5, 7, 8, 9, 12, 16, 19, 21, 24, 27):
        out = np.empty((n, rows), np.float32)
        mm.mul_mat(wq, wtype, x[:n], out, 1 << 30)
        assert np.array_equal(out, single[:n]), n


@pytest.mark.parametrize("wtype", [T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q8_0], ids=lambda t: t.name)
def test_rows16_tiles_equal_one_row_tiles(wtype):
    """The AVX-512 prompt tiles (sixteen weight rows as the lanes of a register, dot_q32._mv_rows16) against the one-row
    tiles they replace on such CPUs: the same numbers bit for bit, for every pair of the rows they cover."""
    from llampy.ggml.backends.cpu import dot_q32, simd
    if not simd.ROWS16:
        pytest.skip("this CPU has no AVX-512 VNNI: the sixteen-row tiles are not used here")
    rng = np.random.default_rng(13)
    k, rows, n = 384, 48, 24
    wq = quantize_w(rng.standard_normal((rows, k)).astype(np.float32), wtype)
    s = act_split(act_data(rng, n, k), TYPE_TRAITS[wtype].vec_dot_type)
    name = wtype.name.lower()
    new = np.full((n, rows), np.nan, np.float32)
    old = np.full((n, rows), np.nan, np.float32)
    getattr(dot_q32, "_rows16_" + name)(wq, s.xq, s.xd, s.xs, new, dot_q32.F16_TABLE)
    getattr(dot_q32, "_tiles_" + name)(wq, s.xq, s.xd, s.xs, old, dot_q32.F16_TABLE, np.zeros(1, np.int64), 2)
    assert not np.isnan(new).any()
    assert np.array_equal(new, old)


def test_backend_takes_the_repacked_chain_for_model_weights_only():
    """llama.cpp repacks a model's 2-D weights (3-D for MUL_MAT_ID's experts) in its CPU extra buffer, never the KV
    cache (its K reaches MUL_MAT as a view) nor a LoRA adapter's matrices: the CPU backend's choice of chain."""
    from llampy.ggml import ops
    from llampy.ggml.backends.cpu.backend import _repacked
    from llampy.ggml.tensor import Flags, Tensor

    def leaf(ne, name):
        t = Tensor(T.Q4_0, ne, name=name)
        t.flags |= Flags.WEIGHT
        return t
    w = leaf((64, 16), "blk.0.attn_q.weight")
    cache = leaf((64, 32, 2), "cache_k_l0")
    k_view = ops.view_3d(cache, 64, 16, 2, cache.nb[1], cache.nb[2])
    experts = leaf((64, 16, 4), "blk.0.ffn_gate_exps.weight")
    assert _repacked(w, 2) and _repacked(experts, 3)
    assert not _repacked(k_view, 2) and not _repacked(experts, 2)
    assert not _repacked(leaf((64, 16), "blk.0.attn_q.weight.lora_a"), 2)
    assert not _repacked(Tensor(T.Q4_0, (64, 16), name="x"), 2)      # not a weight
