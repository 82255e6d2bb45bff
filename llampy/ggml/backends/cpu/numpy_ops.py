"""NumPy kernels for every op, over the NumPy views of the source and destination tensors.

Arrays are in NumPy order: a tensor of ne [ne0, ne1, ne2, ne3] is an array of shape (ne3, ne2, ne1, ne0); block
types are uint8 rows (ne3, ne2, ne1, row_bytes). ``acc`` is the dtype computations run in (float32, as ggml's CPU
code). Results are stored in the destination's type. Each function is ``kernel(node, dst, srcs, acc)``; the backend
binds them once per plan. The reference backend (reference.py) is written apart from this file, so that the tests
comparing the two compare two implementations.
"""
from __future__ import annotations

import math

import numpy as np

from ...quants import dequantize, quantize_act
from ...tensor import Op
from ...types import GGMLType, TYPE_TRAITS

T = GGMLType


def to_float(arr: np.ndarray, t: GGMLType, acc) -> np.ndarray:
    """A tensor's values as floats (dequantizing block rows)."""
    if TYPE_TRAITS[t].is_quantized:
        return dequantize(arr, t).astype(acc, copy=False)
    if t == T.BF16:
        return dequantize(arr, T.BF16).astype(acc, copy=False)
    return arr.astype(acc, copy=False)


def store(dst: np.ndarray, dst_type: GGMLType, values: np.ndarray) -> None:
    """Write float values into dst, converting to its type as ggml-cpu's from_float does (F16 rounding; block rows
    through ``quants.quantize_act``: x86's Q8_0/Q8_1 row quantizers, which round halves to even, and the
    reference quantizers for the other formats)."""
    if TYPE_TRAITS[dst_type].is_quantized or dst_type == T.BF16:
        q = quantize_act(np.ascontiguousarray(values, dtype=np.float32), dst_type)
        dst[...] = q.reshape(dst.shape) if dst_type != T.BF16 else q.view(np.uint16).reshape(dst.shape)
    else:
        np.copyto(dst, np.broadcast_to(values, dst.shape), casting="unsafe")


def tile_to(b: np.ndarray, shape) -> np.ndarray:
    """ggml's broadcast: b repeated to shape (each dim of b divides the target's)."""
    if all(bs == 1 or bs == s for bs, s in zip(b.shape, shape)):
        return b
    reps = tuple(s // bs for bs, s in zip(b.shape, shape))
    return np.tile(b, reps)


# ------------------------------------------------------------------------------------------ element-wise
def k_binary(node, dst, srcs, acc):
    a = to_float(srcs[0], node.src[0].type, acc)
    b = tile_to(to_float(srcs[1], node.src[1].type, acc), a.shape)
    op = node.op
    if op is Op.ADD:
        r = a + b
    elif op is Op.SUB:
        r = a - b
    elif op is Op.MUL:
        r = a * b
    else:
        r = a / b
    store(dst, node.type, r)


def gelu(x, acc):
    """ggml's CPU GELU: the tanh form looked up in an F16 table (input and output rounded to F16)."""
    from .act import gelu_f32
    return gelu_f32(x).astype(acc)


def gelu_erf(x, acc):
    from math import erf
    verf = np.vectorize(erf, otypes=[np.float64])
    return (acc(0.5) * x * (acc(1.0) + verf(x * acc(0.70710678118654752440084436210484)))).astype(acc)


def silu(x, acc):
    return x / (acc(1.0) + np.exp(-x))


def k_unary(node, dst, srcs, acc):
    x = to_float(srcs[0], node.src[0].type, acc)
    op = node.op
    with np.errstate(over="ignore", invalid="ignore"):
        if op is Op.SQR:
            r = x * x
        elif op is Op.SQRT:
            r = np.sqrt(x)
        elif op is Op.NEG:
            r = -x
        elif op in (Op.EXP, Op.TANH, Op.SIGMOID, Op.SOFTPLUS) and acc == np.float32:
            from .act import libm_unary
            x2 = np.ascontiguousarray(x, dtype=np.float32).reshape(-1)
            r = np.empty_like(x2)
            libm_unary(x2, r, (Op.EXP, Op.TANH, Op.SIGMOID, Op.SOFTPLUS).index(op))
            r = r.reshape(x.shape)
        elif op is Op.EXP:
            r = np.exp(x)
        elif op is Op.TANH:
            r = np.tanh(x)
        elif op is Op.SILU and acc == np.float32:
            from .act import silu_rows
            x2 = np.ascontiguousarray(x).reshape(-1, x.shape[-1])
            r = np.empty_like(x2)
            silu_rows(x2, r)
            r = r.reshape(x.shape)
        elif op is Op.SILU:
            r = silu(x, acc)
        elif op is Op.GELU:
            r = gelu(x, acc)
        elif op is Op.GELU_ERF:
            r = gelu_erf(x, acc)
        elif op is Op.RELU:
            r = np.maximum(x, acc(0))
        elif op is Op.SIGMOID:
            r = acc(1.0) / (acc(1.0) + np.exp(-x))
        elif op is Op.SOFTPLUS:             # ggml: x above 20, else logf(1 + expf(x))
            r = np.where(x > acc(20.0), x, np.log(acc(1.0) + np.exp(np.minimum(x, acc(20.0)))))
        else:
            raise NotImplementedError(op)
    store(dst, node.type, r)


def k_scale(node, dst, srcs, acc):
    x = to_float(srcs[0], node.src[0].type, acc)
    p = node.op_params
    store(dst, node.type, x * acc(p["s"]) + acc(p["b"]) if p["b"] else x * acc(p["s"]))


def k_clamp(node, dst, srcs, acc):
    """ggml's MAX(MIN(x, max), min) with C's comparisons: a NaN comes out as max (NaN < max is false), and with
    min > max every value is min (np.clip differs on both)."""
    x = to_float(srcs[0], node.src[0].type, acc)
    lo, hi = acc(node.op_params["min"]), acc(node.op_params["max"])
    with np.errstate(invalid="ignore"):
        y = np.where(x < hi, x, hi)
        store(dst, node.type, np.where(y > lo, y, lo))


def k_softcap(node, dst, srcs, acc):
    x = to_float(srcs[0], node.src[0].type, acc)
    p = node.op_params
    store(dst, node.type, np.tanh(x * acc(p["s_in"])) * acc(p["s_out"]))


def k_glu(node, dst, srcs, acc):
    a = to_float(srcs[0], node.src[0].type, acc)
    if len(srcs) == 2:                 # ggml's split form: swapped is not read (ops.cpp: only ``if (!src1)``)
        g, u = a, to_float(srcs[1], node.src[1].type, acc)
    else:
        h = a.shape[-1] // 2
        g, u = (a[..., h:], a[..., :h]) if node.op_params.get("swapped") else (a[..., :h], a[..., h:])
    if node.op is Op.SWIGLU and acc == np.float32:
        from .act import swiglu_rows
        ne0 = g.shape[-1]
        g2 = np.ascontiguousarray(g, dtype=np.float32).reshape(-1, ne0)
        u2 = np.ascontiguousarray(u, dtype=np.float32).reshape(-1, ne0)
        out = np.empty_like(g2)
        swiglu_rows(g2, u2, out)
        store(dst, node.type, out.reshape(g.shape))
        return
    with np.errstate(over="ignore"):
        act = silu(g, acc) if node.op is Op.SWIGLU else gelu(g, acc)
    store(dst, node.type, act * u)


# glibc's expf (the table-driven algorithm of ARM's optimized routines, glibc >= 2.27), which scalar C code such as
# ggml's swiglu_oai calls: a double-precision evaluation whose float rounding is not always the correctly rounded
# one, so neither NumPy's float32 exp nor exp in double reproduces every value
_EXPF_N = 32
_EXPF_SHIFT = float.fromhex("0x1.8p+52")
_EXPF_INVLN2N = float.fromhex("0x1.71547652b82fep+0") * _EXPF_N
_EXPF_C = (float.fromhex("0x1.c6af84b912394p-5") / _EXPF_N ** 3, float.fromhex("0x1.ebfce50fac4f3p-3") / _EXPF_N ** 2,
           float.fromhex("0x1.62e42ff0c52d6p-1") / _EXPF_N)
_EXPF_T = np.array([np.float64(2.0 ** (i / _EXPF_N)).view(np.uint64) - np.uint64((i << 52) // _EXPF_N)
                    for i in range(_EXPF_N)], np.uint64)


def expf_glibc(x: np.ndarray) -> np.ndarray:
    xd = np.asarray(x, np.float32).astype(np.float64)
    z = _EXPF_INVLN2N * xd
    kd = z + _EXPF_SHIFT                        # round z to an integer in the low bits
    ki = kd.view(np.uint64)
    r = z - (kd - _EXPF_SHIFT)
    s = (_EXPF_T[ki % np.uint64(_EXPF_N)] + (ki << np.uint64(47))).view(np.float64)
    y = (_EXPF_C[0] * r + _EXPF_C[1]) * (r * r) + (_EXPF_C[2] * r + 1.0)
    with np.errstate(invalid="ignore", over="ignore"):
        y = (y * s).astype(np.float32)
        y = np.where(xd > 88.72283935546875, np.float32(np.inf), y)
        y = np.where(xd < -103.97207641601562, np.float32(0.0), y)
        return np.where(np.isnan(xd), np.float32(np.nan), y)


def k_swiglu_oai(node, dst, srcs, acc):
    """ggml_compute_forward_swiglu_oai_f32 in float32: x = min(g, limit), x / (1 + expf(alpha * -x)) * (y + 1) with
    y = clamp(up, -limit, limit)."""
    p = node.op_params
    lim, alpha = acc(p["limit"]), acc(p["alpha"])
    x = np.minimum(to_float(srcs[0], node.src[0].type, acc), lim)
    y = np.clip(to_float(srcs[1], node.src[1].type, acc), -lim, lim)
    e = expf_glibc(alpha * -x) if acc == np.float32 else np.exp(alpha * -x)
    with np.errstate(over="ignore"):
        store(dst, node.type, x / (acc(1.0) + e) * (y + acc(1.0)))


# ------------------------------------------------------------------------------------------ norms
def _rms(x, eps, acc):
    if acc == np.float32:
        from .norm import rms_norm_rows
        x2 = np.ascontiguousarray(x, dtype=np.float32).reshape(-1, x.shape[-1])
        out = np.empty_like(x2)
        rms_norm_rows(x2, np.float32(eps), out)
        return out.reshape(x.shape)
    # the oracle: ggml's formula in double
    ms = (x.astype(np.float64) ** 2).mean(axis=-1, keepdims=True)
    return x * (acc(1.0) / np.sqrt(ms.astype(acc) + acc(eps)))


def k_rms_norm(node, dst, srcs, acc):
    x = to_float(srcs[0], node.src[0].type, acc)
    store(dst, node.type, _rms(x, node.op_params["eps"], acc))


def k_rms_norm_mul(node, dst, srcs, acc):
    x = to_float(srcs[0], node.src[0].type, acc)
    w = tile_to(to_float(srcs[1], node.src[1].type, acc), x.shape)
    y = _rms(x, node.op_params["eps"], acc) * w
    if len(srcs) > 2:      # the residual add, after the product's rounding as ggml's separate ADD has it
        y = y + to_float(srcs[2], node.src[2].type, acc)
    store(dst, node.type, y)


def k_norm(node, dst, srcs, acc):
    x = to_float(srcs[0], node.src[0].type, acc)
    eps = node.op_params["eps"]
    if acc == np.float32:
        from .norm import norm_rows
        x2 = np.ascontiguousarray(x, dtype=np.float32).reshape(-1, x.shape[-1])
        out = np.empty_like(x2)
        norm_rows(x2, np.float32(eps), out)
        store(dst, node.type, out.reshape(x.shape))
        return
    mean = x.astype(np.float64).mean(axis=-1, keepdims=True).astype(acc)
    xc = x - mean
    var = (xc.astype(np.float64) ** 2).mean(axis=-1, keepdims=True).astype(acc)
    store(dst, node.type, xc * (acc(1.0) / np.sqrt(var + acc(eps))))


def k_l2_norm(node, dst, srcs, acc):
    x = to_float(srcs[0], node.src[0].type, acc)
    eps = node.op_params["eps"]
    if acc == np.float32:
        from .norm import l2_norm_rows
        x2 = np.ascontiguousarray(x, dtype=np.float32).reshape(-1, x.shape[-1])
        out = np.empty_like(x2)
        l2_norm_rows(x2, np.float32(eps), out)
        store(dst, node.type, out.reshape(x.shape))
        return
    s = np.sqrt((x.astype(np.float64) ** 2).sum(axis=-1, keepdims=True)).astype(acc)
    store(dst, node.type, x * (acc(1.0) / np.maximum(s, acc(eps))))


# ------------------------------------------------------------------------------------------ softmax
def alibi_slopes(n_head: int, max_bias: float, acc) -> np.ndarray:
    if max_bias <= 0:
        return np.ones(n_head, acc)
    n_head_log2 = 1 << int(math.floor(math.log2(n_head)))
    m0 = 2.0 ** (-max_bias / n_head_log2)
    m1 = 2.0 ** (-(max_bias / 2.0) / n_head_log2)
    h = np.arange(n_head)
    return np.where(h < n_head_log2, m0 ** (h + 1), m1 ** (2 * (h - n_head_log2) + 1)).astype(acc)


def k_soft_max(node, dst, srcs, acc):
    x = to_float(srcs[0], node.src[0].type, acc)          # (ne3, ne2, ne1, ne0)
    p = node.op_params
    x = x * acc(p["scale"])
    if p["has_mask"]:
        m = to_float(srcs[1], node.src[1].type, acc)       # (m3, m2, >=ne1, ne0)
        m = m[:, :, :x.shape[2], :]
        m = tile_to(m, (x.shape[0], x.shape[1]) + m.shape[2:])
        slopes = alibi_slopes(x.shape[1], p["max_bias"], acc).reshape(1, -1, 1, 1)
        with np.errstate(invalid="ignore"):
            x = x + (slopes * m if p["max_bias"] > 0 else m)
    mx = x.max(axis=-1, keepdims=True)
    with np.errstate(invalid="ignore"):
        e = np.exp(x - mx)
        r = e / e.sum(axis=-1, keepdims=True)
    store(dst, node.type, np.nan_to_num(r, nan=0.0))


# ------------------------------------------------------------------------------------------ rope
def _yarn_ramp(low, high, i0):
    y = (i0 / 2 - low) / max(0.001, high - low)
    return 1 - min(1.0, max(0.0, y))


def _yarn_corr_dim(n_dims, n_ctx_orig, n_rot, base):
    return n_dims * math.log(n_ctx_orig / (n_rot * 2 * math.pi)) / (2 * math.log(base))


def rope_cache(pos: np.ndarray, p: dict, ff: np.ndarray | None, acc):
    """cos and sin per (token, pair) as ggml's rope_yarn, in float32 like ggml: [n_tokens, n_dims/2]."""
    n_dims = p["n_dims"]
    f32 = np.float32
    theta_scale = f32(p["freq_base"]) ** f32(-2.0 / n_dims)
    i = np.arange(n_dims // 2)
    # ggml's rope cache starts at theta = pos and multiplies by theta_scale pair after pair, in float
    theta_base = np.empty((len(pos), n_dims // 2), dtype=np.float32)
    th = pos.astype(np.float32)
    for j in range(n_dims // 2):
        theta_base[:, j] = th
        th = th * theta_scale
    if ff is not None:
        theta_base = theta_base / ff[: n_dims // 2].astype(np.float32)[None, :]
    freq_scale = f32(p["freq_scale"])
    ext = p["ext_factor"]
    mscale = f32(p["attn_factor"])
    theta_interp = freq_scale * theta_base
    theta = theta_interp
    if ext != 0.0:
        lo = max(0.0, math.floor(_yarn_corr_dim(n_dims, p["n_ctx_orig"], p["beta_fast"], p["freq_base"])))
        hi = min(n_dims - 1.0, math.ceil(_yarn_corr_dim(n_dims, p["n_ctx_orig"], p["beta_slow"], p["freq_base"])))
        ramp = np.array([_yarn_ramp(lo, hi, 2 * j) for j in i], dtype=np.float32) * f32(ext)
        theta = theta_interp * (1 - ramp) + theta_base * ramp
        mscale = mscale * f32(1.0 + 0.1 * math.log(1.0 / p["freq_scale"]))
    cos = (np.cos(theta) * mscale).astype(np.float32)
    sin = (np.sin(theta) * mscale).astype(np.float32)
    return cos.astype(acc), sin.astype(acc)


def k_rope(node, dst, srcs, acc):
    from .rope import rope
    x = to_float(srcs[0], node.src[0].type, np.float32)   # (ne3, n_tokens, n_head, head_dim)
    pos = np.asarray(srcs[1]).reshape(-1)
    p = node.op_params
    ff = np.asarray(srcs[2]).reshape(-1) if p.get("has_freq_factors") else None
    store(dst, node.type, rope(x, pos, p, ff))


# ------------------------------------------------------------------------------------------ rows, copies
def k_get_rows(node, dst, srcs, acc):
    a, b = srcs[0], np.asarray(srcs[1])                   # a (ne3, ne2, ne1, X); b (1, nb2, nb1, nb0)
    idx = b[0]
    i2 = np.arange(idx.shape[0])[:, None, None]
    i1 = np.arange(idx.shape[1])[None, :, None]
    if idx.size and (idx.min() < 0 or idx.max() >= a.shape[2]):
        raise IndexError(f"get_rows: row index out of range 0..{a.shape[2] - 1}")
    rows = a[i2, i1, idx]                                   # (nb2, nb1, nb0, X)
    if node.src[0].type == T.I32:
        dst[...] = rows
        return
    store(dst, node.type, to_float(rows, node.src[0].type, acc))


def k_set_rows(node, dst, srcs, acc):
    src = to_float(srcs[0], node.src[0].type, acc)         # (s3, s2, s1, ne0)
    idx = np.asarray(srcs[1]).astype(np.int64)             # (1, i2, i1, n)
    s3, s2, s1 = src.shape[:3]
    if idx.size and (idx.min() < 0 or idx.max() >= dst.shape[2]):
        raise IndexError(f"set_rows: row index out of range 0..{dst.shape[2] - 1}")
    j3 = np.arange(s3)[:, None, None]
    j2 = np.arange(s2)[None, :, None]
    rows = idx[0][j3 % idx.shape[1], j2 % idx.shape[2], np.arange(s1)[None, None, :]]
    t = node.type
    if TYPE_TRAITS[t].is_quantized:
        q = quantize_act(np.ascontiguousarray(src, dtype=np.float32), t)        # ggml-cpu's from_float (store)
        dst[j3, j2, rows] = q
    elif t == T.F16:
        dst[j3, j2, rows] = src.astype(np.float16)
    elif t == T.BF16:                   # ggml_cpu_fp32_to_bf16: to nearest even (dst holds the bits)
        from .act_quant import f32_to_bf16_bits
        dst[j3, j2, rows] = f32_to_bf16_bits(src)
    else:
        dst[j3, j2, rows] = src.astype(dst.dtype)


def k_cpy(node, dst, srcs, acc):
    """CPY, CONT, DUP: elements in row-major order of the source, into dst's layout and type."""
    st = node.src[0].type
    if st == node.type and not TYPE_TRAITS[st].is_quantized:
        dst[...] = np.asarray(srcs[0]).reshape(-1).reshape(dst.shape) if srcs[0].shape != dst.shape else srcs[0]
        return
    vals = to_float(srcs[0], st, np.float32 if acc == np.float32 else acc)
    vals = vals.reshape(-1)
    if TYPE_TRAITS[node.type].is_quantized:
        ne0 = node.ne[0]
        store(dst, node.type, vals.reshape(dst.shape[:-1] + (ne0,)))
    else:
        store(dst, node.type, vals.reshape(dst.shape))


def k_concat(node, dst, srcs, acc):
    dim = node.op_params["dim"]
    a, b = srcs
    dst[...] = np.concatenate([a, b], axis=3 - dim)


def k_repeat(node, dst, srcs, acc):
    dst[...] = tile_to(np.asarray(srcs[0]), dst.shape)


def k_sum_rows(node, dst, srcs, acc):
    x = to_float(srcs[0], node.src[0].type, acc)
    store(dst, node.type, x.astype(np.float64).sum(axis=-1, keepdims=True))


def k_mean(node, dst, srcs, acc):
    x = to_float(srcs[0], node.src[0].type, acc)
    store(dst, node.type, x.astype(np.float64).mean(axis=-1, keepdims=True))


def k_argmax(node, dst, srcs, acc):
    """ggml_vec_argmax_f32 per row: ``max = -INFINITY; idx = 0; for i: max = MAX(max, x[i]); if (max == x[i])
    idx = i;`` (MAX(a, b) = a > b ? a : b). A NaN makes max NaN and is never chosen; the value after it restarts
    the scan as -INFINITY does. So: the last non-NaN run of the row decides, and in it the last of its equal
    maxima (an all -inf run: its last cell); a row of NaNs only gives 0."""
    x = to_float(srcs[0], node.src[0].type, acc)[0, 0]    # (ne1, ne0)
    n = x.shape[-1]
    nan = np.isnan(x)
    run = np.cumsum(nan, axis=-1)                          # run id of each cell: the NaNs before it (itself included)
    rows = np.arange(x.shape[0])
    last = n - 1 - np.argmax(~nan[:, ::-1], axis=-1)       # the last non-NaN cell
    live = ~nan & (run == run[rows, last][:, None])        # the cells of its run
    mx = np.where(live, x, -np.inf).max(axis=-1, initial=-np.inf)
    idx = n - 1 - np.argmax((live & (x == mx[:, None]))[:, ::-1], axis=-1)
    dst[...] = np.where(nan.all(axis=-1), 0, idx).astype(np.int32).reshape(dst.shape)


def k_argsort(node, dst, srcs, acc):
    x = to_float(srcs[0], node.src[0].type, acc)
    order = node.op_params["order"]
    idx = np.argsort(-x if order == 1 else x, axis=-1, kind="stable")
    dst[...] = idx.astype(np.int32)


def k_top_k(node, dst, srcs, acc):
    x = to_float(srcs[0], node.src[0].type, acc)
    k = node.op_params["k"]
    idx = np.argsort(-x, axis=-1, kind="stable")[..., :k]
    dst[...] = idx.astype(np.int32)
