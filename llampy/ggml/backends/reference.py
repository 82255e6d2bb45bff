"""The reference backend: the oracle that tests compare the others against.

Plain NumPy and independent of the backends it checks: it imports nothing from ``backends.cpu`` (the layering test
holds it to that); the only code it shares is the ggml layer's block formats (``quants``). Every product and sum
runs in float64, with llama.cpp's rounding points where they decide the numbers: activations through the weight's
dot type before a matrix product, F16 Q/K/V and the F16 output accumulator in flash attention, ggml's float32 rope
cache, the F16 GELU table (its float32 formula included), and each result stored in its tensor's type the way
ggml-cpu converts a float row (its type traits' ``from_float``). Op parameters are float32 in ggml and are read as
such. Slow and simple; it runs every op, written from ggml's semantics (ggml.c, ggml-cpu/ops.cpp and vec.h).
"""
from __future__ import annotations

import math

import numpy as np

from ..backend import Backend, register_backend, tensor_data
from ..quants import dequantize, quantize_act
from ..tensor import BINARY_OPS, Op, Tensor, UNARY_OPS, VIEW_OPS
from ..types import GGMLType, TYPE_TRAITS

T = GGMLType
F64 = np.float64


# ---------------------------------------------------------------------------------------------- values in and out
def values(arr: np.ndarray, t: GGMLType) -> np.ndarray:
    """A tensor's values in float64 (NumPy order). Block rows and BF16 bits are decoded by the ggml layer's
    dequantizer (ggml's to_float, float32 values); the plain types convert exactly."""
    if TYPE_TRAITS[t].is_quantized or t == T.BF16:
        return dequantize(arr, t).astype(F64)
    return np.asarray(arr).astype(F64)


def store(dst: np.ndarray, t: GGMLType, v: np.ndarray) -> None:
    """Write values into dst in type t as ggml-cpu does: the result is a float32 first, then its type's from_float
    converts it: F16 and BF16 rounded to nearest even, block rows through the x86 row quantizers for Q8_0 and Q8_1
    and the reference ones for the other formats (``quants.quantize_act`` is that table)."""
    v32 = np.asarray(v, F64).astype(np.float32)
    with np.errstate(over="ignore", invalid="ignore"):
        if TYPE_TRAITS[t].is_quantized:
            dst[...] = quantize_act(v32, t).reshape(dst.shape)
        elif t == T.BF16:
            dst[...] = quantize_act(v32, t).view(np.uint16).reshape(dst.shape)
        else:
            dst[...] = v32


def broadcast(b: np.ndarray, shape: tuple) -> np.ndarray:
    """ggml's repeat rule (ggml_can_repeat): each dim of b divides the target's, and element i of b serves every
    i + k * len along that dim."""
    assert all(s % n == 0 for s, n in zip(shape, b.shape)), f"{b.shape} does not repeat to {shape}"
    return np.tile(b, [s // n for s, n in zip(shape, b.shape)])


def param(node: Tensor, key: str) -> float:
    """A float op parameter as ggml holds it: float32."""
    return float(np.float32(node.op_params[key]))


# ---------------------------------------------------------------------------------------------- activations
GELU_COEF_A = 0.044715
SQRT_2_OVER_PI = 0.79788456080286535587989211986876


def gelu_table(h: np.ndarray) -> np.ndarray:
    """ggml_table_gelu_f16 at the F16 values h: ggml_gelu_f32, 0.5f*x*(1.0f + tanhf(SQRT_2_OVER_PI*x*(1.0f +
    GELU_COEF_A*x*x))), in float32 as the C compiles for x86 (``GELU_COEF_A*x*x + 1.0f`` contracted into one fused
    multiply-add; tanhf correctly rounded), rounded to F16. The table is data ggml computes once, and its float32
    arithmetic decides some of its F16 values (274 of the 37376 in (-10, 10) differ from the float64 formula's,
    mostly where 1 + tanh cancels), so it is computed as ggml computes it, not in float64."""
    f32 = np.float32
    x = h.astype(f32)
    inner = ((f32(GELU_COEF_A) * x).astype(F64) * x + 1.0).astype(f32)    # the float64 product is exact
    t = np.tanh((f32(SQRT_2_OVER_PI) * x * inner).astype(F64)).astype(f32)
    return ((f32(0.5) * x) * (f32(1.0) + t)).astype(np.float16).astype(F64)


def gelu(x: np.ndarray) -> np.ndarray:
    """ggml-cpu's GELU (GGML_GELU_FP16): 0 for x <= -10, x for x >= 10, otherwise the table at x's F16 value."""
    with np.errstate(over="ignore", invalid="ignore"):
        table = gelu_table(x.astype(np.float32).astype(np.float16))
    return np.where(x <= -10.0, 0.0, np.where(x >= 10.0, x, table))


def gelu_quick(x: np.ndarray) -> np.ndarray:
    """ggml-cpu's GELU_QUICK (GGML_GELU_QUICK_FP16): a table over F16 inputs of the float32 x * (1 / (1 + expf(-1.702
    x))), rounded to F16."""
    f32 = np.float32
    h = x.astype(f32).astype(np.float16).astype(f32)
    with np.errstate(over="ignore"):
        e = np.exp((f32(-1.702) * h).astype(F64)).astype(f32)
        return (h * (f32(1.0) / (f32(1.0) + e))).astype(np.float16).astype(F64)


def gelu_erf(x: np.ndarray) -> np.ndarray:
    erf = np.vectorize(math.erf, otypes=[F64])
    return 0.5 * x * (1.0 + erf(x / math.sqrt(2.0)))


def silu(x: np.ndarray) -> np.ndarray:
    with np.errstate(over="ignore"):
        return x / (1.0 + np.exp(-x))


def softplus(x: np.ndarray) -> np.ndarray:
    """ggml's softplus: x above 20, else log(1 + exp(x))."""
    with np.errstate(over="ignore"):
        return np.where(x > 20.0, x, np.log1p(np.exp(np.minimum(x, 20.0))))


def sigmoid(x: np.ndarray) -> np.ndarray:
    with np.errstate(over="ignore"):
        return 1.0 / (1.0 + np.exp(-x))


def alibi_slopes(n_head: int, max_bias: float) -> np.ndarray:
    """ALiBi slope per head (ggml's soft_max and flash attention): m0^(h+1) for the first n_head_log2 heads
    (n_head_log2: the largest power of two <= n_head), m1^(2(h - n_head_log2) + 1) after them; 1 without a bias."""
    if max_bias <= 0:
        return np.ones(n_head)
    n_head_log2 = 2 ** int(math.floor(math.log2(n_head)))
    m0 = 2.0 ** (-max_bias / n_head_log2)
    m1 = 2.0 ** (-(max_bias / 2.0) / n_head_log2)
    return np.array([m0 ** (h + 1) if h < n_head_log2 else m1 ** (2 * (h - n_head_log2) + 1)
                     for h in range(n_head)])


# ---------------------------------------------------------------------------------------------- matrix products
def round_to_dot_type(x: np.ndarray, vdt: GGMLType) -> tuple[np.ndarray, np.ndarray | None]:
    """x (float32 [n, k]) as a vec_dot sees it: converted to the dot type with the ggml layer's quantizers
    (``quants.quantize_act``: ggml-cpu's from_float for each dot type) and read back exactly, in float64.
    Returns (values, the dot-type bytes; None for F32)."""
    if vdt == T.F32:
        return x.astype(F64), None
    xq = quantize_act(x, vdt)
    if vdt == T.Q8_K:
        # d (float32) * q (int8) needs up to 31 bits: dequantize's float32 product would round it
        blk = np.ascontiguousarray(xq).reshape(-1, TYPE_TRAITS[T.Q8_K].type_size)
        d = blk[:, 0:4].copy().view("<f4").astype(F64)
        q = blk[:, 4:260].view(np.int8).astype(F64)
        return (d * q).reshape(x.shape), xq
    return dequantize(xq, vdt).astype(F64).reshape(x.shape), xq       # Q8_0/Q8_1 (F16 d * int8), F16, BF16: exact


def mul_mat_f64(w: np.ndarray, wtype: GGMLType, x: np.ndarray, out: np.ndarray) -> None:
    """out[n, rows] = round(x) · w^T in float64; x rounded through the weight type's vec_dot_type first."""
    vdt = TYPE_TRAITS[wtype].vec_dot_type
    x = np.ascontiguousarray(x, dtype=np.float32)
    xr, xq = round_to_dot_type(x, vdt)
    res = xr @ values(w, wtype).T
    if wtype in (T.Q4_1, T.Q5_1):                                       # blocks of (d, m, ...), dot type Q8_1
        # llama.cpp adds each block's min times Q8_1's s (F16 of d * the block sum of the quantized x), not times
        # the sum of the rounded values: correct the difference
        n, k = x.shape
        q = np.ascontiguousarray(xq).reshape(n, k // 32, 36)
        s = q[:, :, 2:4].copy().view(np.float16).astype(F64).reshape(n, -1)
        delta = s - xr.reshape(n, k // 32, 32).sum(axis=2)
        blk = np.ascontiguousarray(w).reshape(w.shape[0], k // 32, TYPE_TRAITS[wtype].type_size)
        mins = blk[:, :, 2:4].copy().view(np.float16).astype(F64).reshape(w.shape[0], -1)
        res += delta @ mins.T
    out[...] = res


def k_mul_mat(node, dst, srcs):
    a, b = node.src
    r2, r3 = b.ne[2] // a.ne[2], b.ne[3] // a.ne[3]
    for i13 in range(b.ne[3]):
        for i12 in range(b.ne[2]):
            x = values(srcs[1][i13, i12], b.type).astype(np.float32)
            mul_mat_f64(srcs[0][i13 // r3, i12 // r2], a.type, x, dst[i13, i12])


def k_mul_mat_glu(node, dst, srcs):
    gate, up, b = node.src
    g, u = np.empty(dst.shape, np.float32), np.empty(dst.shape, np.float32)
    for i13 in range(b.ne[3]):
        for i12 in range(b.ne[2]):
            x = values(srcs[2][i13, i12], b.type).astype(np.float32)
            mul_mat_f64(srcs[0][0, 0], gate.type, x, g[i13, i12])
            mul_mat_f64(srcs[1][0, 0], up.type, x, u[i13, i12])
    act = silu(g.astype(F64)) if node.op_params["glu"] == "swiglu" else gelu(g.astype(F64))
    store(dst, node.type, act * u)


def k_mul_mat_id(node, dst, srcs):
    as_, b, _ = node.src
    sel = np.asarray(srcs[2])[0, 0]                                   # (n_tokens, n_used)
    o = np.empty((1, as_.ne[1]), np.float32)
    for t in range(sel.shape[0]):
        for u in range(sel.shape[1]):
            x = values(srcs[1][0, t, u % b.ne[1]][None, :], b.type).astype(np.float32)
            mul_mat_f64(srcs[0][0, int(sel[t, u])], as_.type, x, o)
            dst[0, t, u] = o[0]


# ---------------------------------------------------------------------------------------------- rope
def rope_cache(pos: np.ndarray, p: dict, ff: np.ndarray | None):
    """cos, sin [n_tokens, n_dims/2] as ggml_rope_cache_init: theta in float32 (pos, then times theta_scale pair
    after pair), cos/sin of that float32 angle, times mscale in float32."""
    f32 = np.float32
    n_dims = p["n_dims"]
    half = n_dims // 2
    theta_scale = f32(math.pow(p["freq_base"], -2.0 / n_dims))
    extrap = np.empty((len(pos), half), f32)
    th = pos.astype(f32)
    for j in range(half):
        extrap[:, j] = th / (f32(ff[j]) if ff is not None else f32(1.0))
        th = (th * theta_scale).astype(f32)
    freq_scale = f32(p["freq_scale"])
    theta = (freq_scale * extrap).astype(f32)
    mscale = f32(p["attn_factor"])
    if p["ext_factor"] != 0.0:
        def corr(beta):
            return n_dims * math.log(p["n_ctx_orig"] / (beta * 2 * math.pi)) / (2 * math.log(p["freq_base"]))
        lo = max(0.0, math.floor(corr(p["beta_fast"])))
        hi = min(n_dims - 1.0, math.ceil(corr(p["beta_slow"])))
        y = (np.arange(half) - lo) / max(0.001, hi - lo)                 # i0 / 2 == j
        mix = ((1 - np.clip(y, 0, 1)) * p["ext_factor"]).astype(f32)
        theta = (theta * (1 - mix) + extrap * mix).astype(f32)
        mscale = f32(mscale * f32(1.0 + 0.1 * math.log(1.0 / p["freq_scale"])))
    cos = (np.cos(theta.astype(F64)).astype(f32) * mscale).astype(f32)
    sin = (np.sin(theta.astype(F64)).astype(f32) * mscale).astype(f32)
    return cos, sin


def mrope_cache(pos: np.ndarray, p: dict, ff: np.ndarray | None, n_pairs: int):
    """cos, sin [n_tokens, n_pairs] as ggml_mrope_cache_init: four angles (one per row of positions) each multiplied
    by theta_scale pair after pair in float32; pair j takes the angle of its section's row (j cycles over the
    sections); the vision rope restarts each section's angle at its row's position."""
    f32 = np.float32
    s0, s1, s2, s3 = p["sections"]
    sect_dims, sec_w = s0 + s1 + s2 + s3, s0 + s1
    sec_e = sec_w + s2
    indep = p["mode"] == 24
    nt = len(pos) // 4
    rows = pos.reshape(4, nt).astype(f32)
    th = [rows[r].copy() for r in range(4)]
    theta_scale = f32(math.pow(p["freq_base"], -2.0 / p["n_dims"]))
    extrap = np.empty((nt, n_pairs), f32)
    for j in range(n_pairs):
        sector = j % sect_dims
        if indep:
            for r, start in ((0, 0), (1, s0), (2, sec_w), (3, sec_e)):
                if sector == start:
                    th[r] = rows[r].copy()
                    break
        r = 1 if s0 <= sector < sec_w else 2 if sec_w <= sector < sec_w + s2 else 3 if sector >= sec_w + s2 else 0
        extrap[:, j] = th[r] / (f32(ff[j]) if ff is not None else f32(1.0))
        th = [(t * theta_scale).astype(f32) for t in th]
    return _yarn_cos_sin(extrap, p, p["n_dims"])


def _yarn_cos_sin(extrap, p, n_dims):
    f32 = np.float32
    half = extrap.shape[1]
    freq_scale = f32(p["freq_scale"])
    theta = (freq_scale * extrap).astype(f32)
    mscale = f32(p["attn_factor"])
    if p["ext_factor"] != 0.0:
        def corr(beta):
            return n_dims * math.log(p["n_ctx_orig"] / (beta * 2 * math.pi)) / (2 * math.log(p["freq_base"]))
        lo = max(0.0, math.floor(corr(p["beta_fast"])))
        hi = min(n_dims - 1.0, math.ceil(corr(p["beta_slow"])))
        y = (np.arange(half) - lo) / max(0.001, hi - lo)
        mix = ((1 - np.clip(y, 0, 1)) * p["ext_factor"]).astype(f32)
        theta = (theta * (1 - mix) + extrap * mix).astype(f32)
        mscale = f32(mscale * f32(1.0 + 0.1 * math.log(1.0 / p["freq_scale"])))
    cos = (np.cos(theta.astype(F64)).astype(f32) * mscale).astype(f32)
    sin = (np.sin(theta.astype(F64)).astype(f32) * mscale).astype(f32)
    return cos, sin


def k_rope(node, dst, srcs):
    p = node.op_params
    x = values(srcs[0], node.src[0].type)                                 # (ne3, n_tokens, n_head, head_dim)
    pos = np.asarray(srcs[1]).reshape(-1)
    ff = np.asarray(srcs[2]).reshape(-1) if p.get("has_freq_factors") else None
    n_dims = p["n_dims"]
    if p.get("sections"):
        # MROPE: NeoX halves of n_dims; VISION: pairs (i, i + n_dims) over the whole head
        n_rot = n_dims if p["mode"] == 8 else 2 * n_dims
        cos, sin = mrope_cache(pos, p, ff, n_rot // 2)
        c, s = cos.astype(F64)[None, :, None, :], sin.astype(F64)[None, :, None, :]
        x0, x1 = x[..., : n_rot // 2], x[..., n_rot // 2: n_rot]
        out = x.copy()
        out[..., : n_rot // 2], out[..., n_rot // 2: n_rot] = x0 * c - x1 * s, x0 * s + x1 * c
        store(dst, node.type, out)
        return
    cos, sin = rope_cache(pos, p, ff)
    c = cos.astype(F64)[None, :, None, :]
    s = sin.astype(F64)[None, :, None, :]
    if p["mode"] == 2:      # NEOX: (x_i, x_{i + n_dims/2})
        x0, x1 = x[..., : n_dims // 2], x[..., n_dims // 2: n_dims]
    else:                   # NORM: adjacent pairs
        x0, x1 = x[..., 0:n_dims:2], x[..., 1:n_dims:2]
    out = x.copy()
    r0, r1 = x0 * c - x1 * s, x0 * s + x1 * c
    if p["mode"] == 2:
        out[..., : n_dims // 2], out[..., n_dims // 2: n_dims] = r0, r1
    else:
        out[..., 0:n_dims:2], out[..., 1:n_dims:2] = r0, r1
    store(dst, node.type, out)


# ---------------------------------------------------------------------------------------------- flash attention
def _r16(x):
    return x.astype(np.float16).astype(F64)


def k_flash_attn(node, dst, srcs):
    """ggml's two CPU paths. one_chunk (decode and small batches): Q rounded to K's dot type, online softmax over
    the KV cells in order, with F16 V the accumulator rounded to F16 after every scale and every multiply-add.
    tiled (>= 64 queries, F16/F32 K and V of one type): float32 Q, plain softmax (here float64). Sinks join each
    row's sum after the cells (ggml: after the accumulator is back in float32)."""
    q, k, v = node.src[:3]
    p = node.op_params
    qf = np.asarray(srcs[0], F64)                                       # (ne3, n_head, n_q, d)
    ne3, n_head, n_q, _ = qf.shape
    kf = values(srcs[1], k.type)
    vf = values(srcs[2], v.type)
    rk = n_head // kf.shape[1]
    kf = np.repeat(kf, rk, axis=1)
    vf = np.repeat(vf, rk, axis=1)
    kf = kf[np.arange(ne3) % kf.shape[0]]
    vf = vf[np.arange(ne3) % vf.shape[0]]
    mask = np.zeros((ne3, n_head, n_q, kf.shape[2]))
    if p["has_mask"]:
        m = values(srcs[3], node.src[3].type)[:, :, :n_q, :]
        m = m[np.arange(ne3) % m.shape[0]][:, np.arange(n_head) % m.shape[1]]
        mask = alibi_slopes(n_head, param(node, "max_bias")).reshape(1, -1, 1, 1) * m
    tiled = k.type in (T.F16, T.F32) and k.type == v.type and n_q >= 64
    sink = None
    if p.get("has_sinks"):
        sink = np.asarray(srcs[-1], F64).reshape(-1)[:n_head].reshape(1, n_head, 1, 1)
    if not tiled:
        vdt = TYPE_TRAITS[k.type].vec_dot_type
        q32 = np.ascontiguousarray(qf.reshape(-1, qf.shape[-1]), np.float32)
        qf = round_to_dot_type(q32, vdt)[0].reshape(qf.shape)
    cap = param(node, "softcap")
    s = np.einsum("ahqd,ahkd->ahqk", qf, kf) * param(node, "scale")
    if cap:
        s = cap * np.tanh(s / cap)
    with np.errstate(invalid="ignore"):
        s = s + mask
    if tiled or v.type != T.F16:
        mx = s.max(axis=-1, keepdims=True)
        with np.errstate(invalid="ignore"):
            e = np.nan_to_num(np.exp(s - mx), nan=0.0)
        den = e.sum(axis=-1, keepdims=True)
        if sink is not None:
            with np.errstate(invalid="ignore", over="ignore"):
                den = den + np.where(mx == -np.inf, 1.0, np.exp(sink - mx))
        o = np.einsum("ahqk,ahkd->ahqd", e, vf) / np.where(den == 0, 1, den)
    else:
        o = _online_f16(s, vf, sink)
    dst[...] = o.transpose(0, 2, 1, 3)


def _online_f16(s: np.ndarray, vf: np.ndarray, sink: np.ndarray | None = None) -> np.ndarray:
    """ggml's online softmax with the F16 VKQ accumulator, vectorised over rows, in order over the KV cells; then
    the sink (one more logit, no value) in float."""
    shape = s.shape[:3]
    M = np.full(shape + (1,), -np.inf)
    S = np.zeros(shape + (1,))
    acc = np.zeros(shape + (vf.shape[-1],))
    for ic in range(s.shape[3]):
        sc = s[..., ic:ic + 1]
        live = sc > -np.inf                                               # masked cells are skipped
        new_max = live & (sc > M)
        with np.errstate(invalid="ignore", over="ignore"):
            ms = np.where(new_max, np.exp(M - sc), 1.0)
            vs = np.where(new_max | ~live, 1.0, np.exp(sc - M))
        acc = np.where(new_max, _r16(acc * ms), acc)
        acc = np.where(live, _r16(acc + vf[:, :, ic:ic + 1, :] * vs), acc)
        S = np.where(live, S * ms + vs, S)
        M = np.where(new_max, sc, M)
    if sink is not None:
        with np.errstate(invalid="ignore", over="ignore"):
            ms = np.where(sink > M, np.exp(M - sink), 1.0)
            vs = np.where(sink > M, 1.0, np.exp(sink - M))
        acc, S = acc * ms, S * ms + vs
    return acc / np.where(S == 0, np.inf, S)


# ---------------------------------------------------------------------------------------------- element-wise
_BINARY = {Op.ADD: np.add, Op.SUB: np.subtract, Op.MUL: np.multiply, Op.DIV: np.divide}


def k_binary(node, dst, srcs):
    """a op b, b repeated over a's shape."""
    a = values(srcs[0], node.src[0].type)
    b = broadcast(values(srcs[1], node.src[1].type), a.shape)
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        store(dst, node.type, _BINARY[node.op](a, b))


_UNARY = {
    Op.SQR: lambda x: x * x, Op.SQRT: np.sqrt, Op.EXP: np.exp, Op.TANH: np.tanh, Op.SILU: silu, Op.GELU: gelu,
    Op.GELU_ERF: gelu_erf, Op.RELU: lambda x: np.maximum(x, 0.0), Op.SIGMOID: sigmoid, Op.SOFTPLUS: softplus,
    Op.GELU_QUICK: gelu_quick, Op.NEG: np.negative,
}


def k_unary(node, dst, srcs):
    with np.errstate(invalid="ignore", over="ignore"):
        store(dst, node.type, _UNARY[node.op](values(srcs[0], node.src[0].type)))


def k_scale(node, dst, srcs):
    """x * s + b"""
    store(dst, node.type, values(srcs[0], node.src[0].type) * param(node, "s") + param(node, "b"))


def k_clamp(node, dst, srcs):
    """MAX(MIN(x, max), min) with C's comparisons (a NaN comes out as max)."""
    x = values(srcs[0], node.src[0].type)
    lo, hi = param(node, "min"), param(node, "max")
    y = np.where(x < hi, x, hi)
    store(dst, node.type, np.where(y > lo, y, lo))


def k_softcap(node, dst, srcs):
    """tanh(x * s_in) * s_out"""
    x = values(srcs[0], node.src[0].type)
    store(dst, node.type, np.tanh(x * param(node, "s_in")) * param(node, "s_out"))


def k_swiglu_oai(node, dst, srcs):
    x = np.minimum(values(srcs[0], node.src[0].type), param(node, "limit"))
    y = np.clip(values(srcs[1], node.src[1].type), -param(node, "limit"), param(node, "limit"))
    with np.errstate(over="ignore"):
        store(dst, node.type, x / (1.0 + np.exp(-param(node, "alpha") * x)) * (y + 1.0))


def k_glu(node, dst, srcs):
    """act(gate) * up. One source: each row is [gate | up] ([up | gate] when swapped); two sources: gate and up
    (ggml's split form; its ``swapped`` is always false there and not read)."""
    a = values(srcs[0], node.src[0].type)
    if len(node.src) == 2:
        g, u = a, values(srcs[1], node.src[1].type)
    else:
        h = a.shape[-1] // 2
        g, u = (a[..., h:], a[..., :h]) if node.op_params.get("swapped") else (a[..., :h], a[..., h:])
    act = silu(g) if node.op is Op.SWIGLU else gelu(g)
    store(dst, node.type, act * u)


# ---------------------------------------------------------------------------------------------- state-space models
def k_ssm_conv(node, dst, srcs):
    """out[s, t, i] = sum over k of sx[s, i, t + k] * c[i, k]."""
    sx = values(srcs[0], node.src[0].type)[0]                     # (n_s, d_inner, d_conv - 1 + n_t)
    c = values(srcs[1], node.src[1].type)[0, 0]                   # (d_inner, d_conv)
    d_conv, n_t = c.shape[1], node.ne[1]
    out = np.zeros((sx.shape[0], n_t, sx.shape[1]))
    for k in range(d_conv):
        out += sx[:, :, k:k + n_t].transpose(0, 2, 1) * c[:, k]
    store(dst, node.type, out.reshape(dst.shape))


def k_ssm_gate(node, dst, srcs):
    """silu(z) * (y + x * d), d one value per head (swiglu after mamba-2's skip: the float32 product and sum first,
    as the unfused nodes store them)."""
    z, y, x = (values(srcs[i], node.src[i].type) for i in range(3))
    skip = (y + x * values(srcs[3], node.src[3].type)).astype(np.float32).astype(F64)
    store(dst, node.type, silu(z) * skip)


def k_ssm_conv_state(node, dst, srcs):
    """ssm_conv over each sequence's row src[j] of r (channel-major, d_conv - 1 a channel) followed by its new
    inputs x; then row dst[j] of r holds the last d_conv - 1 of them (all src rows read first). Then the bias and
    silu where the node has them."""
    x = values(srcs[0], node.src[0].type)[0]                      # (n_s, n_t, d_inner)
    c = values(srcs[1], node.src[1].type)[0, 0]                   # (d_inner, d_conv)
    r = srcs[2][0, 0]                                             # (n_rows, (d_conv - 1) d_inner), F32
    src, dst_ids = np.asarray(srcs[3]).reshape(-1), np.asarray(srcs[4]).reshape(-1)
    n_s, n_t, d_inner = x.shape
    d_conv = c.shape[1]
    sx = np.concatenate([r[src].reshape(n_s, d_inner, d_conv - 1), x.transpose(0, 2, 1)], axis=2)
    out = np.zeros((n_s, n_t, d_inner))
    for k in range(d_conv):
        out += sx[:, :, k:k + n_t].transpose(0, 2, 1) * c[:, k]
    r[dst_ids] = sx[:, :, n_t:].reshape(n_s, -1)
    if len(srcs) > 5:
        out = out + values(srcs[5], node.src[5].type).reshape(-1)
    if node.op_params.get("silu"):
        out = out / (1.0 + np.exp(-out))
    store(dst, node.type, out.reshape(dst.shape))


def k_ssm_scan(node, dst, srcs):
    """Each sequence from its state row ids[j], token by token: dt' = softplus(dt); state = state * exp(dt' * A) +
    B[g] * x * dt'; y = state . C[g] (g: the head's group). y first, then the final states."""
    s_t, x_t = node.src[0], node.src[1]
    s = values(srcs[0], s_t.type)                                 # (n_rs, n_head, head_dim, d_state)
    x = values(srcs[1], x_t.type)                                 # (n_seqs, n_tok, n_head, head_dim)
    dt = values(srcs[2], node.src[2].type)[0]                     # (n_seqs, n_tok, n_head)
    A = values(srcs[3], node.src[3].type)[0, 0]                   # (n_head, d_state | 1)
    B = values(srcs[4], node.src[4].type)                         # (n_seqs, n_tok, n_group, d_state)
    C = values(srcs[5], node.src[5].type)
    ids = np.asarray(srcs[6]).reshape(-1)
    n_seqs, n_tok, n_head, head_dim = x.shape
    group = np.arange(n_head) // (n_head // B.shape[2])
    y = np.empty(x.shape)
    states = np.empty((n_seqs,) + s.shape[1:])
    for j in range(n_seqs):
        if not 0 <= ids[j] < s.shape[0]:
            raise IndexError(f"ssm_scan: state row {ids[j]} out of range 0..{s.shape[0] - 1}")
        st = s[ids[j]].copy()
        for t in range(n_tok):
            dtp = softplus(dt[j, t])                              # (n_head,)
            dA = np.exp(dtp[:, None] * A)[:, None, :]             # (n_head, 1, d_state | 1)
            st = st * dA + B[j, t][group][:, None, :] * (x[j, t] * dtp[:, None])[:, :, None]
            y[j, t] = (st * C[j, t][group][:, None, :]).sum(axis=-1)
        states[j] = st
    store(dst, node.type, np.concatenate([y.reshape(-1), states.reshape(-1)]).reshape(dst.shape))


def _wkv_inputs(node, srcs, n_tok_srcs):
    S, H = node.src[0].ne[0], node.src[0].ne[1]
    T_ = node.src[0].ne[2]
    n_seqs = node.src[-1].ne[1]
    xs = [values(srcs[i], node.src[i].type).reshape(n_seqs, T_ // n_seqs, H, S) for i in n_tok_srcs]
    state = values(srcs[-1], node.src[-1].type).reshape(n_seqs, H, S, S)
    return S, H, T_, n_seqs, xs, state


def k_rwkv_wkv6(node, dst, srcs):
    """Per sequence and head, token by token: y = r . (tf k (x) v + st); st = td * st + k (x) v (st: key x value)."""
    S, H, T_, n_seqs, (k, v, r, td), state = _wkv_inputs(node, srcs, (0, 1, 2, 4))
    tf = values(srcs[3], node.src[3].type).reshape(H, S)
    y = np.empty((n_seqs, T_ // n_seqs, H, S))
    for j in range(n_seqs):
        st = state[j].copy()                                       # (H, S key, S value)
        for t in range(T_ // n_seqs):
            kv = k[j, t][:, :, None] * v[j, t][:, None, :]
            y[j, t] = np.einsum("hi,hij->hj", r[j, t], kv * tf[:, :, None] + st)
            st = st * td[j, t][:, :, None] + kv
        state[j] = st
    store(dst, node.type, np.concatenate([y.reshape(-1), state.reshape(-1)]).reshape(dst.shape))


def k_rwkv_wkv7(node, dst, srcs):
    """Per sequence and head, token by token: st = st * w + v (x) k + (st . a) (x) b; y = st . r (st: value x key)."""
    S, H, T_, n_seqs, (r, w, k, v, a, b), state = _wkv_inputs(node, srcs, range(6))
    y = np.empty((n_seqs, T_ // n_seqs, H, S))
    for j in range(n_seqs):
        st = state[j].copy()                                       # (H, S value, S key)
        for t in range(T_ // n_seqs):
            sa = np.einsum("hij,hj->hi", st, a[j, t])
            st = st * w[j, t][:, None, :] + v[j, t][:, :, None] * k[j, t][:, None, :] \
                + sa[:, :, None] * b[j, t][:, None, :]
            y[j, t] = np.einsum("hij,hj->hi", st, r[j, t])
        state[j] = st
    store(dst, node.type, np.concatenate([y.reshape(-1), state.reshape(-1)]).reshape(dst.shape))


def k_gated_linear_attn(node, dst, srcs):
    """Per sequence and head, token by token: st = st * g + k (x) v; y = (q * scale) . st (st: key x value)."""
    S, H, T_, n_seqs, (k, v, q, g), state = _wkv_inputs(node, srcs, range(4))
    q = q * param(node, "scale")
    y = np.empty((n_seqs, T_ // n_seqs, H, S))
    for j in range(n_seqs):
        st = state[j].copy()                                       # (H, S key, S value)
        for t in range(T_ // n_seqs):
            st = st * g[j, t][:, :, None] + k[j, t][:, :, None] * v[j, t][:, None, :]
            y[j, t] = np.einsum("hi,hij->hj", q[j, t], st)
        state[j] = st
    store(dst, node.type, np.concatenate([y.reshape(-1), state.reshape(-1)]).reshape(dst.shape))


def k_gated_delta_net(node, dst, srcs):
    """Per sequence and value head, token by token: M = M * exp(g); d = (v - M k) beta; M += d (x) k;
    y = (M q) / sqrt(S) (M: value x key; q and k broadcast over heads and sequences as ggml's)."""
    q, k, v, g, beta, state = (values(s, t.type) for s, t in zip(srcs, node.src))    # (ne3, ne2, ne1, ne0)
    n_seqs, n_tok, H, S = v.shape
    y = np.empty_like(v)
    st = state.copy()                                              # (n_seqs, H, S value, S key)
    for j in range(n_seqs):
        jq = j // (n_seqs // q.shape[0])
        for h in range(H):
            hq = h % q.shape[2]
            M = st[j, h]
            for t in range(n_tok):
                M *= np.exp(g[j, t, h])[None, :]
                d = (v[j, t, h] - M @ k[jq, t, hq]) * beta[j, t, h, 0]
                M += d[:, None] * k[jq, t, hq][None, :]
                y[j, t, h] = (M @ q[jq, t, hq]) / math.sqrt(S)
    store(dst, node.type, np.concatenate([y.reshape(-1), st.reshape(-1)]).reshape(dst.shape))


# ---------------------------------------------------------------------------------------------- softmax, norms, rows
def k_soft_max(node, dst, srcs):
    x = values(srcs[0], node.src[0].type) * param(node, "scale")
    p = node.op_params
    if p["has_mask"]:
        m = values(srcs[1], node.src[1].type)[:, :, :x.shape[2], :]
        m = broadcast(m, (x.shape[0], x.shape[1]) + m.shape[2:])
        with np.errstate(invalid="ignore"):
            x = x + alibi_slopes(x.shape[1], param(node, "max_bias")).reshape(1, -1, 1, 1) * m
    e = np.exp(x - x.max(axis=-1, keepdims=True))
    store(dst, node.type, e / e.sum(axis=-1, keepdims=True))


def _rms(x, eps):
    return x / np.sqrt((x * x).mean(axis=-1, keepdims=True) + eps)


def k_rms_norm(node, dst, srcs):
    store(dst, node.type, _rms(values(srcs[0], node.src[0].type), param(node, "eps")))


def k_rms_norm_mul(node, dst, srcs):
    x = values(srcs[0], node.src[0].type)
    w = broadcast(values(srcs[1], node.src[1].type), x.shape)
    y = _rms(x, param(node, "eps")) * w
    if len(srcs) > 2:
        y = y + values(srcs[2], node.src[2].type)
    store(dst, node.type, y)


def k_norm(node, dst, srcs):
    x = values(srcs[0], node.src[0].type)
    xc = x - x.mean(axis=-1, keepdims=True)
    store(dst, node.type, xc / np.sqrt((xc * xc).mean(axis=-1, keepdims=True) + param(node, "eps")))


def k_l2_norm(node, dst, srcs):
    """x / max(||x||, eps) over each row (||x||: the square root of the sum of squares)."""
    x = values(srcs[0], node.src[0].type)
    norm = np.sqrt((x * x).sum(axis=-1, keepdims=True))
    store(dst, node.type, x / np.maximum(norm, param(node, "eps")))


def k_get_rows(node, dst, srcs):
    a, idx = srcs[0], np.asarray(srcs[1])[0]                        # a (ne3, ne2, ne1, X); idx (ne3', ne2', n)
    if idx.size and (idx.min() < 0 or idx.max() >= a.shape[2]):
        raise IndexError(f"get_rows: row index out of range 0..{a.shape[2] - 1}")
    rows = a[np.arange(idx.shape[0])[:, None, None], np.arange(idx.shape[1])[None, :, None], idx]
    if node.src[0].type == T.I32:
        dst[...] = rows
    else:
        store(dst, node.type, values(rows, node.src[0].type))


def k_set_rows(node, dst, srcs):
    """Row r of src at (i2, i3) becomes row idx[r, i2 % idx.ne1, i3 % idx.ne2] of dst at (i2, i3), in dst's type;
    the other rows of dst keep their values."""
    src = values(srcs[0], node.src[0].type)                       # (s3, s2, s1, ne0)
    idx = np.asarray(srcs[1])                                     # (1, ne12, ne11, s1)
    for i3 in range(src.shape[0]):
        for i2 in range(src.shape[1]):
            for r in range(src.shape[2]):
                row = int(idx[0, i3 % idx.shape[1], i2 % idx.shape[2], r])
                if not 0 <= row < dst.shape[2]:
                    raise IndexError(f"set_rows: row index {row} out of range 0..{dst.shape[2] - 1}")
                store(dst[i3, i2, row], node.type, src[i3, i2, r])


# ------------------------------------------------------------------------------------------- convolution, pooling
def k_im2col(node, dst, srcs):
    """dst[n, oh, ow, (c, kh, kw)] = b[n, c, oh s1 + kh d1 - p1, ow s0 + kw d0 - p0], 0 outside the input, stored
    in dst's type (F16: the pixels rounded to F16)."""
    p = node.op_params
    kw_, kh_ = node.src[0].ne[0], node.src[0].ne[1]
    x = values(srcs[1], node.src[1].type)                           # (N, IC, IH, IW)
    n, ic, ih, iw = x.shape
    ow, oh = node.ne[1], node.ne[2]
    out = np.zeros((n, oh, ow, ic, kh_, kw_))
    for ky in range(kh_):
        for kx in range(kw_):
            for oy in range(oh):
                y = oy * p["s1"] + ky * p["d1"] - p["p1"]
                if not 0 <= y < ih:
                    continue
                for ox in range(ow):
                    xx = ox * p["s0"] + kx * p["d0"] - p["p0"]
                    if 0 <= xx < iw:
                        out[:, oy, ox, :, ky, kx] = x[:, :, y, xx]
    store(dst, node.type, out.reshape(dst.shape))


def k_pool_2d(node, dst, srcs):
    """Each output: the max, or the sum divided by k0 * k1, of the input values under the window (padding is
    left out of the sum but counted in the divisor, as ggml does)."""
    p = node.op_params
    x = values(srcs[0], node.src[0].type)                           # (N, C, IH, IW)
    ih, iw = x.shape[2], x.shape[3]
    out = np.empty(dst.shape)
    for oy in range(dst.shape[2]):
        for ox in range(dst.shape[3]):
            y0, x0 = oy * p["s1"] - p["p1"], ox * p["s0"] - p["p0"]
            win = x[:, :, max(y0, 0):min(y0 + p["k1"], ih), max(x0, 0):min(x0 + p["k0"], iw)]
            if p["op"] == 1:
                out[:, :, oy, ox] = win.sum(axis=(2, 3)) / (p["k0"] * p["k1"])
            else:
                out[:, :, oy, ox] = win.max(axis=(2, 3)) if win.size else -np.finfo(np.float32).max
    store(dst, node.type, out)


# ------------------------------------------------------------------------------------------- copies, shapes, reductions
def k_cpy(node, dst, srcs):
    """CPY, CONT, DUP: the source's elements in row-major order, written in that order into dst's shape and type
    (the same type: its bytes as they are)."""
    st = node.src[0].type
    if st == node.type:
        dst[...] = np.asarray(srcs[0]).reshape(-1).reshape(dst.shape)
        return
    flat = values(srcs[0], st).reshape(-1)
    store(dst, node.type, flat.reshape(dst.shape[:-1] + (node.ne[0],)))


def k_concat(node, dst, srcs):
    dst[...] = np.concatenate([np.asarray(srcs[0]), np.asarray(srcs[1])], axis=3 - node.op_params["dim"])


def k_repeat(node, dst, srcs):
    dst[...] = broadcast(np.asarray(srcs[0]), dst.shape)


def k_sum_rows(node, dst, srcs):
    store(dst, node.type, values(srcs[0], node.src[0].type).sum(axis=-1, keepdims=True))


def k_mean(node, dst, srcs):
    store(dst, node.type, values(srcs[0], node.src[0].type).mean(axis=-1, keepdims=True))


def k_argmax(node, dst, srcs):
    """ggml_vec_argmax_f32 on each row: ``max = MAX(max, x[i]); if (max == x[i]) idx = i;`` from max = -inf,
    idx = 0, with C's ``MAX(a, b) = a > b ? a : b``. Of equal largest values the last wins; a NaN is never
    chosen, but the value after it is taken as the new max."""
    x = values(srcs[0], node.src[0].type)[0, 0]                   # (ne1, ne0)
    mx = np.full(x.shape[0], -np.inf)
    idx = np.zeros(x.shape[0], np.int64)
    for i in range(x.shape[1]):
        mx = np.where(mx > x[:, i], mx, x[:, i])
        idx = np.where(mx == x[:, i], i, idx)
    dst[...] = idx.reshape(dst.shape)


def _sorted_indices(x: np.ndarray, descending: bool) -> np.ndarray:
    """Per row, the indices that sort it; equal values keep their order (stable)."""
    return np.argsort(-x if descending else x, axis=-1, kind="stable")


def k_argsort(node, dst, srcs):
    x = values(srcs[0], node.src[0].type)
    dst[...] = _sorted_indices(x, node.op_params["order"] == 1)


def k_top_k(node, dst, srcs):
    """The indices of each row's k largest values, largest first."""
    x = values(srcs[0], node.src[0].type)
    dst[...] = _sorted_indices(x, True)[..., :node.op_params["k"]]


_TABLE = {
    Op.MUL_MAT: k_mul_mat, Op.MUL_MAT_GLU: k_mul_mat_glu, Op.MUL_MAT_ID: k_mul_mat_id, Op.ROPE: k_rope,
    Op.FLASH_ATTN_EXT: k_flash_attn, Op.SSM_CONV: k_ssm_conv, Op.SSM_SCAN: k_ssm_scan,
    Op.SSM_CONV_STATE: k_ssm_conv_state, Op.SSM_GATE: k_ssm_gate,
    Op.IM2COL: k_im2col, Op.POOL_2D: k_pool_2d,
    Op.RWKV_WKV6: k_rwkv_wkv6, Op.RWKV_WKV7: k_rwkv_wkv7, Op.GATED_DELTA_NET: k_gated_delta_net,
    Op.GATED_LINEAR_ATTN: k_gated_linear_attn,
    Op.SOFT_MAX: k_soft_max, Op.RMS_NORM: k_rms_norm, Op.RMS_NORM_MUL: k_rms_norm_mul, Op.NORM: k_norm,
    Op.L2_NORM: k_l2_norm, Op.GET_ROWS: k_get_rows, Op.SET_ROWS: k_set_rows,
    Op.CPY: k_cpy, Op.CONT: k_cpy, Op.DUP: k_cpy, Op.CONCAT: k_concat, Op.REPEAT: k_repeat,
    Op.SCALE: k_scale, Op.CLAMP: k_clamp, Op.SOFTCAP: k_softcap, Op.SWIGLU: k_glu, Op.GEGLU: k_glu, Op.SWIGLU_OAI: k_swiglu_oai,
    Op.SUM_ROWS: k_sum_rows, Op.MEAN: k_mean, Op.ARGMAX: k_argmax, Op.ARGSORT: k_argsort, Op.TOP_K: k_top_k,
    **{o: k_binary for o in BINARY_OPS}, **{o: k_unary for o in UNARY_OPS},
}


class Plan:
    __slots__ = ("calls", "nodes")

    def __init__(self, calls, nodes):
        self.calls = calls
        self.nodes = nodes


class ReferenceBackend(Backend):
    name = "reference"

    def __init__(self, device: str | None = None, n_threads: int | None = None):
        super().__init__(device or "reference")

    def supports_op(self, node: Tensor) -> bool:
        return node.op in VIEW_OPS or node.op in _TABLE

    def _bind(self, node: Tensor):
        fn = _TABLE[node.op]
        dst = tensor_data(node)
        srcs = [tensor_data(s) if s is not None else None for s in node.src]
        return lambda: fn(node, dst, srcs)

    def graph_plan_create(self, nodes: list[Tensor]) -> Plan:
        return Plan([self._bind(n) for n in nodes if n.op not in VIEW_OPS], nodes)

    def graph_plan_compute(self, plan: Plan) -> None:
        for c in plan.calls:
            c()

    def graph_compute(self, nodes: list[Tensor]) -> None:
        self.graph_plan_compute(self.graph_plan_create(nodes))


register_backend("reference", ReferenceBackend)
