"""The reference backend: the oracle that tests compare the others against.

Plain NumPy, no Numba kernels of its own or of the cpu backend: every product and sum in float64, with llama.cpp's
rounding points where they decide the numbers (activations through the weight's dot type before a matrix product,
F16 Q/K/V and the F16 output accumulator in flash attention, ggml's float32 rope cache, the F16 GELU table).
Slow and simple; it runs every op. The simple element-wise formulas are shared with the cpu backend's NumPy
module (``cpu.numpy_ops``) and run here with ``acc=float64``; rope, attention, matrix products and the hot ops the
cpu backend runs in Numba are written out here again, so that the comparison means something.
"""
from __future__ import annotations

import math

import numpy as np

from ..backend import Backend, register_backend, tensor_data
from ..tensor import BINARY_OPS, Op, Tensor, UNARY_OPS, VIEW_OPS
from ..types import GGMLType, TYPE_TRAITS
from .cpu import numpy_ops as K

T = GGMLType
F64 = np.float64


# ---------------------------------------------------------------------------------------------- matrix products
def mul_mat_f64(w: np.ndarray, wtype: GGMLType, x: np.ndarray, out: np.ndarray) -> None:
    """out[n, rows] = round(x) · w^T in float64; x rounded through the weight type's vec_dot_type first."""
    from ..quants import quantize_act
    from .cpu.matmul import round_act
    vdt = TYPE_TRAITS[wtype].vec_dot_type
    x = np.ascontiguousarray(x, dtype=np.float32)
    xr = round_act(x, vdt).astype(F64)
    wf = K.to_float(w, wtype, F64)
    res = xr @ wf.T
    if vdt == T.Q8_1:
        # llama.cpp adds each block's min times Q8_1's s (the block sum of the quantized x, stored as F16),
        # not times the sum of the rounded values: correct the difference
        n, k = x.shape
        q = quantize_act(x, T.Q8_1).reshape(n, k // 32, 36)
        s = np.ascontiguousarray(q[:, :, 2:4]).view(np.float16).astype(F64).reshape(n, -1)
        delta = s - xr.reshape(n, k // 32, 32).sum(axis=2)
        blk = np.ascontiguousarray(w).reshape(w.shape[0], k // 32, TYPE_TRAITS[wtype].type_size)
        mins = np.ascontiguousarray(blk[:, :, 2:4]).view(np.float16).astype(F64).reshape(w.shape[0], -1)
        res += delta @ mins.T
    out[...] = res


def k_mul_mat(node, dst, srcs):
    a, b = node.src
    r2, r3 = b.ne[2] // a.ne[2], b.ne[3] // a.ne[3]
    for i13 in range(b.ne[3]):
        for i12 in range(b.ne[2]):
            x = K.to_float(srcs[1][i13, i12], b.type, np.float32)
            mul_mat_f64(srcs[0][i13 // r3, i12 // r2], a.type, x, dst[i13, i12])


def k_mul_mat_glu(node, dst, srcs):
    gate, up, b = node.src
    g, u = np.empty(dst.shape, np.float32), np.empty(dst.shape, np.float32)
    for i13 in range(b.ne[3]):
        for i12 in range(b.ne[2]):
            x = K.to_float(srcs[2][i13, i12], b.type, np.float32)
            mul_mat_f64(srcs[0][0, 0], gate.type, x, g[i13, i12])
            mul_mat_f64(srcs[1][0, 0], up.type, x, u[i13, i12])
    with np.errstate(over="ignore"):
        act = K.silu(g.astype(F64), F64) if node.op_params["glu"] == "swiglu" else K.gelu(g.astype(F64), F64)
    K.store(dst, node.type, act * u)


def k_mul_mat_id(node, dst, srcs):
    as_, b, _ = node.src
    sel = np.asarray(srcs[2])[0, 0]                                   # (n_tokens, n_used)
    o = np.empty((1, as_.ne[1]), np.float32)
    for t in range(sel.shape[0]):
        for u in range(sel.shape[1]):
            x = K.to_float(srcs[1][0, t, u % b.ne[1]][None, :], b.type, np.float32)
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


def k_rope(node, dst, srcs):
    p = node.op_params
    x = K.to_float(srcs[0], node.src[0].type, F64)                       # (ne3, n_tokens, n_head, head_dim)
    pos = np.asarray(srcs[1]).reshape(-1)
    ff = np.asarray(srcs[2]).reshape(-1) if p.get("has_freq_factors") else None
    cos, sin = rope_cache(pos, p, ff)
    c = cos.astype(F64)[None, :, None, :]
    s = sin.astype(F64)[None, :, None, :]
    n_dims = p["n_dims"]
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
    K.store(dst, node.type, out)


# ---------------------------------------------------------------------------------------------- flash attention
def _r16(x):
    return x.astype(np.float16).astype(F64)


def k_flash_attn(node, dst, srcs):
    """ggml's two CPU paths. one_chunk (decode and small batches): Q rounded to K's dot type, online softmax over
    the KV cells in order, with F16 V the accumulator rounded to F16 after every scale and every multiply-add.
    tiled (>= 64 queries, F16/F32 K and V of one type, dv % 16 == 0): float32 Q, plain softmax (here float64)."""
    q, k, v = node.src[:3]
    p = node.op_params
    qf = np.asarray(srcs[0], F64)                                       # (ne3, n_head, n_q, d)
    ne3, n_head, n_q, _ = qf.shape
    kf = K.to_float(srcs[1], k.type, F64)
    vf = K.to_float(srcs[2], v.type, F64)
    rk = n_head // kf.shape[1]
    kf = np.repeat(kf, rk, axis=1)
    vf = np.repeat(vf, rk, axis=1)
    kf = kf[np.arange(ne3) % kf.shape[0]]
    vf = vf[np.arange(ne3) % vf.shape[0]]
    mask = np.zeros((ne3, n_head, n_q, kf.shape[2]))
    if p["has_mask"]:
        m = K.to_float(srcs[3], node.src[3].type, F64)[:, :, :n_q, :]
        m = m[np.arange(ne3) % m.shape[0]][:, np.arange(n_head) % m.shape[1]]
        mask = K.alibi_slopes(n_head, p["max_bias"], F64).reshape(1, -1, 1, 1) * m
    tiled = k.type in (T.F16, T.F32) and k.type == v.type and n_q >= 64 and v.ne[0] % 16 == 0
    if not tiled:
        vdt = TYPE_TRAITS[k.type].vec_dot_type
        if vdt != T.F32:
            from .cpu.matmul import round_act
            qf = round_act(np.ascontiguousarray(qf.reshape(-1, qf.shape[-1]), np.float32), vdt).astype(F64).reshape(qf.shape)
    s = np.einsum("ahqd,ahkd->ahqk", qf, kf) * p["scale"]
    if p["softcap"]:
        s = p["softcap"] * np.tanh(s / p["softcap"])
    with np.errstate(invalid="ignore"):
        s = s + mask
    if tiled or v.type != T.F16:
        mx = s.max(axis=-1, keepdims=True)
        with np.errstate(invalid="ignore"):
            e = np.nan_to_num(np.exp(s - mx), nan=0.0)
        den = e.sum(axis=-1, keepdims=True)
        o = np.einsum("ahqk,ahkd->ahqd", e, vf) / np.where(den == 0, 1, den)
    else:
        o = _online_f16(s, vf)
    dst[...] = o.transpose(0, 2, 1, 3)


def _online_f16(s: np.ndarray, vf: np.ndarray) -> np.ndarray:
    """ggml's online softmax with the F16 VKQ accumulator, vectorised over rows, in order over the KV cells."""
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
    return acc / np.where(S == 0, np.inf, S)


# ---------------------------------------------------------------------------------------------- softmax, norms, rows
def k_soft_max(node, dst, srcs):
    x = K.to_float(srcs[0], node.src[0].type, F64) * node.op_params["scale"]
    p = node.op_params
    if p["has_mask"]:
        m = K.to_float(srcs[1], node.src[1].type, F64)[:, :, :x.shape[2], :]
        m = K.tile_to(m, (x.shape[0], x.shape[1]) + m.shape[2:])
        with np.errstate(invalid="ignore"):
            x = x + K.alibi_slopes(x.shape[1], p["max_bias"], F64).reshape(1, -1, 1, 1) * m
    e = np.exp(x - x.max(axis=-1, keepdims=True))
    K.store(dst, node.type, e / e.sum(axis=-1, keepdims=True))


def _rms(x, eps):
    return x / np.sqrt((x * x).mean(axis=-1, keepdims=True) + eps)


def k_rms_norm(node, dst, srcs):
    K.store(dst, node.type, _rms(K.to_float(srcs[0], node.src[0].type, F64), node.op_params["eps"]))


def k_rms_norm_mul(node, dst, srcs):
    x = K.to_float(srcs[0], node.src[0].type, F64)
    w = K.tile_to(K.to_float(srcs[1], node.src[1].type, F64), x.shape)
    y = _rms(x, node.op_params["eps"]) * w
    if len(srcs) > 2:
        y = y + K.to_float(srcs[2], node.src[2].type, F64)
    K.store(dst, node.type, y)


def k_norm(node, dst, srcs):
    x = K.to_float(srcs[0], node.src[0].type, F64)
    xc = x - x.mean(axis=-1, keepdims=True)
    K.store(dst, node.type, xc / np.sqrt((xc * xc).mean(axis=-1, keepdims=True) + node.op_params["eps"]))


def k_get_rows(node, dst, srcs):
    a, idx = srcs[0], np.asarray(srcs[1])[0]                        # a (ne3, ne2, ne1, X); idx (ne3', ne2', n)
    if idx.size and (idx.min() < 0 or idx.max() >= a.shape[2]):
        raise IndexError(f"get_rows: row index out of range 0..{a.shape[2] - 1}")
    rows = a[np.arange(idx.shape[0])[:, None, None], np.arange(idx.shape[1])[None, :, None], idx]
    if node.src[0].type == T.I32:
        dst[...] = rows
    else:
        K.store(dst, node.type, K.to_float(rows, node.src[0].type, F64).astype(np.float32))


def _with_acc(fn):
    return lambda node, dst, srcs: fn(node, dst, srcs, F64)


_TABLE = {
    Op.MUL_MAT: k_mul_mat, Op.MUL_MAT_GLU: k_mul_mat_glu, Op.MUL_MAT_ID: k_mul_mat_id, Op.ROPE: k_rope,
    Op.FLASH_ATTN_EXT: k_flash_attn,
    Op.SOFT_MAX: k_soft_max, Op.RMS_NORM: k_rms_norm, Op.RMS_NORM_MUL: k_rms_norm_mul, Op.NORM: k_norm,
    Op.GET_ROWS: k_get_rows,
}
for _op, _fn in {
    Op.SCALE: K.k_scale, Op.CLAMP: K.k_clamp, Op.SOFTCAP: K.k_softcap, Op.SWIGLU: K.k_glu, Op.GEGLU: K.k_glu,
    Op.L2_NORM: K.k_l2_norm, Op.SET_ROWS: K.k_set_rows, Op.CPY: K.k_cpy, Op.CONT: K.k_cpy, Op.DUP: K.k_cpy,
    Op.CONCAT: K.k_concat, Op.REPEAT: K.k_repeat, Op.SUM_ROWS: K.k_sum_rows, Op.MEAN: K.k_mean,
    Op.ARGMAX: K.k_argmax, Op.ARGSORT: K.k_argsort, Op.TOP_K: K.k_top_k,
    **{o: K.k_binary for o in BINARY_OPS}, **{o: K.k_unary for o in UNARY_OPS},
}.items():
    _TABLE[_op] = _with_acc(_fn)


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
