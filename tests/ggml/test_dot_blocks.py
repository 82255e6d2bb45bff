"""The block-format table (llampy/ggml/blocks.py) and the kernels specialised from it
(llampy/ggml/backends/cpu/dot_blocks.py): F16, BF16, Q2_K, Q3_K, IQ4_NL, IQ4_XS.

Oracles: the library's reference dequantizer (the table's decode rules must give its bits); a float64 product of
the dequantized weights and x rounded through the dot type (within the float32 arithmetic's bound); and NumPy
transliterations of ggml's x86 float order (``ggml_vec_dot_*`` AVX2 forms, the repacked IQ4_NL gemv), which the
kernels must match bit for bit.
"""
from __future__ import annotations

import numpy as np
import pytest

from llampy.ggml import blocks as B
from llampy.ggml import quants as lq
from llampy.ggml.backends.cpu import dot_blocks as db
from llampy.ggml.backends.cpu import matmul as mm
from llampy.ggml.backends.cpu.act_quant import act_split, f32_to_bf16_bits, bf16_bits_to_f32
from llampy.ggml.backends.cpu.simd import F16_VEC_LANES
from llampy.ggml.types import GGMLType as T, TYPE_TRAITS

TYPES = [T.F16, T.BF16, T.Q2_K, T.Q3_K, T.IQ4_NL, T.IQ4_XS]


def weights(rng, rows, k, t):
    """Quantized rows of mixed magnitudes, in the layout mul_mat takes (F16: float16, BF16: uint16 bits)."""
    w = (rng.standard_normal((rows, k)) * rng.choice([1e-3, 1.0, 40.0], size=(rows, 1))).astype(np.float32)
    if t == T.F32:
        return w
    q = lq.quantize(w, t)
    if t == T.F16:
        return q.view(np.float16).reshape(rows, k)
    if t == T.BF16:
        return q.view(np.uint16).reshape(rows, k)
    return q.reshape(rows, -1)


def dequant(wq, t, k):
    if t == T.F32:
        return wq.astype(np.float64)
    return lq.dequantize(wq.view(np.uint8).reshape(wq.shape[0], -1), t).reshape(wq.shape[0], k).astype(np.float64)


def x_rounded(x, t):
    """x through t's dot type, float64, plus the split form (xq, xd, xs) for the 8-bit ones."""
    vdt = TYPE_TRAITS[t].vec_dot_type
    if vdt == T.F32:
        return x.astype(np.float64), None
    if vdt == T.F16:
        return x.astype(np.float16).astype(np.float64), None
    if vdt == T.BF16:
        return bf16_bits_to_f32(f32_to_bf16_bits(x)).astype(np.float64), None
    n, k = x.shape
    s = act_split(x, vdt)
    blk = 256 if vdt == T.Q8_K else 32
    xr = (s.xq.reshape(n, k // blk, blk).astype(np.float64) * s.xd[:, :, None]).reshape(n, k)
    return xr, (s.xq.copy(), s.xd.copy(), s.xs.copy())


# ------------------------------------------------------------------------------------------------ the table

@pytest.mark.parametrize("t", TYPES, ids=lambda t: t.name)
def test_decode_rule_gives_the_reference_dequantizer_bits(t):
    rng = np.random.default_rng(1)
    fmt = B.BLOCKS[t]
    k, rows = 512, 5
    wq = weights(rng, rows, k, t).view(np.uint8).reshape(rows, -1)
    out = np.full((rows, k), np.nan, np.float32)
    for r in range(rows):
        for b in range(k // fmt.blck_size):
            fmt.decode(wq[r], b * fmt.type_size, out[r], b * fmt.blck_size)
    ref = lq.dequantize(wq, t).reshape(rows, k).astype(np.float32)
    assert np.array_equal(out.view(np.uint32), ref.view(np.uint32))


@pytest.mark.parametrize("t", [T.NVFP4, T.Q1_0, T.Q2_0], ids=lambda t: t.name)
def test_decode_rules_of_nvfp4_q1_0_q2_0_give_the_dequantizer_bits(t):
    """The table's rules for the formats the CPU multiplies through quants.dequantize (the CUDA backend's value
    rules follow them): random bits in every field, every UE4M3 scale byte (NVFP4), F16 scales of mixed magnitudes
    (Q1_0, Q2_0)."""
    rng = np.random.default_rng(int(t))
    fmt = B.BLOCKS[t]
    nb = 256
    wq = rng.integers(0, 256, (nb, fmt.type_size), dtype=np.uint8)
    if t == T.NVFP4:
        wq[:, :4] = (np.arange(4 * nb) % 256).reshape(nb, 4)
    else:
        d = rng.uniform(0.5, 2.0, nb) * rng.choice([1e-3, 1.0, 40.0], nb)
        wq[:, :2] = d.astype(np.float16).view(np.uint8).reshape(nb, 2)
    out = np.full(nb * fmt.blck_size, np.nan, np.float32)
    row = wq.reshape(-1)
    for b in range(nb):
        fmt.decode(row, b * fmt.type_size, out, b * fmt.blck_size)
    ref = lq.dequantize(wq, t).reshape(-1).astype(np.float32)
    assert np.array_equal(out.view(np.uint32), ref.view(np.uint32))


def test_table_agrees_with_type_traits():
    for t, f in B.BLOCKS.items():
        tt = TYPE_TRAITS[t]
        assert (f.blck_size, f.type_size, f.dot_type) == (tt.blck_size, tt.type_size, tt.vec_dot_type)
    assert B.BLOCKS[T.IQ4_XS].field("qs").offset == 8 and B.BLOCKS[T.Q3_K].field("d").offset == 108


# ------------------------------------------------------------------------------------------------ ggml's order

def f32(v):
    return np.asarray(v, np.float32)


def fma(a, b, c):
    """float32 fma through float64 (product exact, one rounding of the sum, then to float32)."""
    return (np.asarray(a, np.float64) * np.asarray(b, np.float64) + np.asarray(c, np.float64)).astype(np.float32)


def hsum8(a):
    return ((a[..., 4] + a[..., 0]) + (a[..., 6] + a[..., 2])) + ((a[..., 5] + a[..., 1]) + (a[..., 7] + a[..., 3]))


def f16v(b, o):
    return b[:, :, o:o + 2].copy().view(np.float16)[:, :, 0].astype(np.float32)


def ggml_order(wq, t, x):
    """out[i, r] as llama.cpp's x86 build computes it (module doc), in NumPy over all rows at once."""
    rows, n, k = wq.shape[0], x.shape[0], x.shape[1]
    out = np.empty((n, rows), np.float32)
    if t in (T.F32, T.F16, T.BF16):
        xr, _ = x_rounded(x, t)
        wv = dequant(wq, t, k)
        lanes = 8 if t == T.BF16 else F16_VEC_LANES    # ggml_vec_dot_f16/_f32 in the build's width (AVX-512: 16)
        np_ = k - k % (4 * lanes)
        for i in range(n):
            p = (wv[:, :np_] * xr[i, :np_]).reshape(rows, -1, 4, lanes)     # exact in float64
            if t != T.F32:
                p = p.astype(np.float32)       # and in float32: products of two 11- or 8-bit significands
            c = np.zeros((rows, 4, lanes), np.float32)
            for j in range(p.shape[1]):
                c = (c + p[:, j]).astype(np.float32)     # one rounding: the fma's
            if t != T.BF16 and lanes == 16:
                v = (c[:, 0] + c[:, 2]) + (c[:, 1] + c[:, 3])
                for h in (8, 4, 2, 1):                                # _mm512_reduce_add_ps
                    v = v[:, :h] + v[:, h:2 * h]
                r = v[:, 0]
            elif t != T.BF16:
                v = (c[:, 0] + c[:, 2]) + (c[:, 1] + c[:, 3])
                tt = v[:, :4] + v[:, 4:]
                r = (tt[:, 0] + tt[:, 1]) + (tt[:, 2] + tt[:, 3])
            else:
                r = hsum8((c[:, 0] + c[:, 2]) + (c[:, 1] + c[:, 3]))
            tail = (wv[:, np_:] * xr[i, np_:]).astype(np.float32).astype(np.float64)
            if t == T.F32:      # ggml_vec_dot_f32's leftovers: a float sum
                tail, r = tail.astype(np.float32), r.astype(np.float32)
                for j in range(tail.shape[1]):
                    r = (r + tail[:, j]).astype(np.float32)
                out[i] = r
                continue
            s = r.astype(np.float64)
            for j in range(tail.shape[1]):
                s = s + tail[:, j]
            out[i] = s.astype(np.float32)
        return out
    fmt = B.BLOCKS[t]
    nb = k // fmt.blck_size
    blk = np.ascontiguousarray(wq).reshape(rows, nb, fmt.type_size)
    _, (xq, xd, xs) = x_rounded(x, t)
    # integer values and per-value integer scales from the table's rules
    qv = np.empty((rows, nb, fmt.blck_size), np.int64)
    sv = np.ones((rows, nb, fmt.blck_size), np.int64)
    for r in range(rows):
        for b in range(nb):
            o = b * fmt.type_size
            for j in range(fmt.blck_size):
                if t == T.Q2_K:
                    qv[r, b, j], sv[r, b, j] = B.q2_k_quant(wq[r], o, j), B.q2_k_scale(wq[r], o, j // 16)
                elif t == T.Q3_K:
                    qv[r, b, j], sv[r, b, j] = B.q3_k_quant(wq[r], o, j), B.q3_k_scale(wq[r], o, j // 16)
                elif t == T.IQ4_XS:
                    qv[r, b, j], sv[r, b, j] = B.iq4_xs_quant(wq[r], o, j), B.iq4_xs_scale(wq[r], o, j // 32)
                else:
                    qv[r, b, j] = B.iq4_nl_quant(wq[r], o, j)
    for i in range(n):
        prod = qv * sv * xq[i].reshape(nb, fmt.blck_size).astype(np.int64)
        if t == T.IQ4_NL:
            isum = prod.sum(axis=2)                                           # [rows, nb]
            dw = f16v(blk, 0)
            if rows % 8 == 0:                                                 # the repacked gemv's chain
                acc = np.zeros(rows, np.float32)
                for b in range(nb):
                    acc = fma(isum[:, b].astype(np.float32), f32(dw[:, b] * xd[i, b]), acc)
                out[i] = acc
                continue
            lanes = prod.reshape(rows, nb, 8, 4).sum(axis=3)
            a = [np.zeros((rows, 8), np.float32), np.zeros((rows, 8), np.float32)]
            for b in range(nb - nb % 2):
                a[b % 2] = fma(f32(xd[i, b] * dw[:, b])[:, None], lanes[:, b].astype(np.float32), a[b % 2])
            r = hsum8((a[0] + a[1]).astype(np.float32))
            if nb % 2:
                b = nb - 1
                r = f32(r + f32(f32(xd[i, b] * dw[:, b]) * isum[:, b].astype(np.float32)))   # not contracted
            out[i] = r
            continue
        lanes = prod.reshape(rows, nb, 8, 8, 4).sum(axis=(2, 4))              # lane l: elements 32c + 4l .. + 3
        acc = np.zeros((rows, 8), np.float32)
        for b in range(nb):
            if t == T.Q2_K:
                mins = (blk[:, b, 0:16] >> 4).astype(np.int64)
                bs = xs[i, 16 * b:16 * b + 16].astype(np.int64)
                ml = (mins * bs).reshape(rows, 8, 2).sum(axis=2)
                dmin = f32(-xd[i, b] * f16v(blk, 82)[:, b])
                acc = fma(dmin[:, None], ml.astype(np.float32), acc)
                d = f32(xd[i, b] * f16v(blk, 80)[:, b])
            elif t == T.Q3_K:
                d = f32(xd[i, b] * f16v(blk, 108)[:, b])
            else:
                d = f32(f16v(blk, 0)[:, b] * xd[i, b])
            acc = fma(d[:, None], lanes[:, b].astype(np.float32), acc)
        out[i] = hsum8(acc)
    return out


CASES = [(T.F32, 200, 9), (T.F16, 576, 21), (T.F16, 1552, 8), (T.BF16, 576, 13), (T.BF16, 80, 4), (T.Q2_K, 512, 13),
         (T.Q3_K, 768, 9), (T.IQ4_XS, 512, 11), (T.IQ4_NL, 576, 16), (T.IQ4_NL, 608, 13)]


@pytest.mark.parametrize("t,k,rows", CASES, ids=lambda v: getattr(v, "name", str(v)))
def test_kernels_match_ggml_order_and_the_float64_product(t, k, rows):
    rng = np.random.default_rng(k + rows)
    wq = weights(rng, rows, k, t)
    w64 = dequant(wq, t, k)
    for n in (1, 2, 3, 5):
        x = (rng.standard_normal((n, k)) * rng.choice([1e-2, 1.0, 300.0], size=(n, 1))).astype(np.float32)
        out = np.full((n, rows), np.nan, np.float32)
        db.mul_mat(wq, t, x, out)
        assert np.array_equal(out, ggml_order(wq, t, x)), (t.name, n)
        xr, _ = x_rounded(x, t)
        ref = xr @ w64.T
        bound = (k + 8) * 2.0 ** -24 * (np.abs(xr) @ np.abs(w64).T) + 1e-30
        assert (np.abs(out - ref) <= bound).all()


@pytest.mark.parametrize("t", TYPES, ids=lambda t: t.name)
def test_mul_mat_dispatch_takes_the_kernels(t):
    """matmul.mul_mat and bind_mul_mat give the kernels' bits for one-token decode and small batches."""
    rng = np.random.default_rng(7)
    k = 512 if TYPE_TRAITS[t].blck_size == 256 else 576
    rows = 24
    wq = weights(rng, rows, k, t)
    for n in (1, 4):
        x = rng.standard_normal((n, k)).astype(np.float32)
        out, ref = np.empty((n, rows), np.float32), np.empty((n, rows), np.float32)
        db.mul_mat(wq, t, x, ref)
        if t in (T.F16, T.BF16) and n >= 2:   # ggml-cpu takes llamafile's tinyBLAS there (test_dot_f16_tiny.py)
            from tests.ggml.test_dot_f16_tiny import tinyblas_order
            ref = tinyblas_order(wq.view(np.uint16) if t == T.BF16 else wq, x, bf16=t == T.BF16)
        mm.mul_mat(wq, t, x, out)
        assert np.array_equal(out, ref)
        out[...] = np.nan
        run = mm.bind_mul_mat(wq, t, x, out, lambda: None)
        assert run is not None
        run()
        assert np.array_equal(out, ref)
