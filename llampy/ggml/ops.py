"""Graph builders: one small function per op, with ggml's semantics. They assert shapes and record a node;
they never compute. Shapes are in ggml order (ne0 fastest).
"""
from __future__ import annotations

from .tensor import (BINARY_OPS, GGML_MAX_DIMS, Op, Tensor, UNARY_OPS, contiguous_strides)
from .types import GGMLType, TYPE_TRAITS

F32 = GGMLType.F32
I32 = GGMLType.I32

ROPE_TYPE_NORM = 0
ROPE_TYPE_NEOX = 2
ROPE_TYPE_MROPE = 8
ROPE_TYPE_VISION = 24


def _node(op: Op, type, ne, src, params=None, name="") -> Tensor:
    return Tensor(type, ne, op=op, src=src, op_params=params or {}, name=name)


def _can_repeat(b: Tensor, a: Tensor) -> bool:
    """b can be broadcast to a's shape (ggml_can_repeat)."""
    return all(b.ne[i] != 0 and a.ne[i] % b.ne[i] == 0 for i in range(GGML_MAX_DIMS))


def _same_shape(a: Tensor, b: Tensor) -> bool:
    return a.ne == b.ne


def _check(cond: bool, msg: str):
    if not cond:
        raise ValueError(msg)


# ---------------------------------------------------------------------------------------------- element-wise

# a: any, b: broadcastable to a  ->  a's shape, F32
def _binary(op: Op, a: Tensor, b: Tensor) -> Tensor:
    _check(_can_repeat(b, a), f"{op.value}: cannot broadcast {b.shape_str()} to {a.shape_str()}")
    return _node(op, F32, a.ne, [a, b])


def add(a, b): return _binary(Op.ADD, a, b)
def sub(a, b): return _binary(Op.SUB, a, b)
def mul(a, b): return _binary(Op.MUL, a, b)
def div(a, b): return _binary(Op.DIV, a, b)


def _unary(op: Op, a: Tensor) -> Tensor:
    assert op in UNARY_OPS
    return _node(op, F32, a.ne, [a])


def sqr(a): return _unary(Op.SQR, a)
def sqrt(a): return _unary(Op.SQRT, a)
def exp(a): return _unary(Op.EXP, a)
def tanh(a): return _unary(Op.TANH, a)
def silu(a): return _unary(Op.SILU, a)
def gelu(a): return _unary(Op.GELU, a)            # tanh approximation, as ggml_gelu
def gelu_erf(a): return _unary(Op.GELU_ERF, a)    # exact erf form
def relu(a): return _unary(Op.RELU, a)
def sigmoid(a): return _unary(Op.SIGMOID, a)
def softplus(a): return _unary(Op.SOFTPLUS, a)    # log(1 + exp(x)), x itself above 20 (ggml_softplus)
def gelu_quick(a): return _unary(Op.GELU_QUICK, a)  # x * sigmoid(1.702 x) (ggml_gelu_quick)
def neg(a): return _unary(Op.NEG, a)              # -x (ggml_neg)


# a * s + b
def scale(a: Tensor, s: float, b: float = 0.0) -> Tensor:
    return _node(Op.SCALE, F32, a.ne, [a], {"s": float(s), "b": float(b)})


def clamp(a: Tensor, min: float, max: float) -> Tensor:
    return _node(Op.CLAMP, F32, a.ne, [a], {"min": float(min), "max": float(max)})


# tanh(a * s_in) * s_out: the soft-cap of gemma2 logits and attention scores (ggml builds it from three ops;
# the fusion pass rewrites scale·tanh·scale into this node)
def softcap(a: Tensor, s_in: float, s_out: float) -> Tensor:
    return _node(Op.SOFTCAP, F32, a.ne, [a], {"s_in": float(s_in), "s_out": float(s_out)})


# Gated linear units. With b (ggml_glu_split): act(a) * b, a the gate, a and b the same shape; there is no
# swapped form (ggml records swapped = 0 and its kernels read it only without b): pass the tensors the other way
# round instead. Without b (ggml_glu): a's rows hold [gate | up] halves (gate first; ``swapped`` puts up first)
# -> ne0 / 2.
def _glu(op: Op, a: Tensor, b: Tensor | None, swapped: bool) -> Tensor:
    if b is None:
        _check(a.ne[0] % 2 == 0, f"{op.value}: fused gate/up rows need an even ne0, got {a.ne[0]}")
        ne = (a.ne[0] // 2,) + a.ne[1:]
        return _node(op, F32, ne, [a], {"swapped": bool(swapped)})
    _check(not swapped, f"{op.value}: swapped applies to one [gate | up] tensor; with two, pass (up, gate)")
    _check(_same_shape(a, b), f"{op.value}: gate {a.shape_str()} and up {b.shape_str()} differ")
    return _node(op, F32, a.ne, [a, b], {"swapped": False})


def swiglu(a, b=None, swapped=False): return _glu(Op.SWIGLU, a, b, swapped)
def geglu(a, b=None, swapped=False): return _glu(Op.GEGLU, a, b, swapped)


# gate, up: same shape  ->  that shape: x = min(gate, limit), x / (1 + exp(-alpha x)) * (clamp(up, -limit, limit) + 1)
# (ggml_swiglu_oai, gpt-oss's experts)
def swiglu_oai(gate: Tensor, up: Tensor, alpha: float, limit: float) -> Tensor:
    _check(_same_shape(gate, up), f"swiglu_oai: gate {gate.shape_str()} and up {up.shape_str()} differ")
    return _node(Op.SWIGLU_OAI, F32, gate.ne, [gate, up], {"alpha": float(alpha), "limit": float(limit)})


# ---------------------------------------------------------------------------------------------- normalisation

# over rows (ne0)
def norm(a: Tensor, eps: float) -> Tensor:
    return _node(Op.NORM, F32, a.ne, [a], {"eps": float(eps)})


def rms_norm(a: Tensor, eps: float) -> Tensor:
    return _node(Op.RMS_NORM, F32, a.ne, [a], {"eps": float(eps)})


def l2_norm(a: Tensor, eps: float) -> Tensor:
    return _node(Op.L2_NORM, F32, a.ne, [a], {"eps": float(eps)})


# rms_norm(a) * w, w broadcastable to a (fusion pass only)
# rms_norm(a) * w (+ add): the fused form of rms_norm, mul and the residual add after it
def rms_norm_mul(a: Tensor, w: Tensor, eps: float, add: Tensor | None = None) -> Tensor:
    _check(_can_repeat(w, a), f"rms_norm_mul: cannot broadcast {w.shape_str()} to {a.shape_str()}")
    if add is None:
        return _node(Op.RMS_NORM_MUL, F32, a.ne, [a, w], {"eps": float(eps)})
    _check(_same_shape(add, a), f"rms_norm_mul: add {add.shape_str()} differs from {a.shape_str()}")
    return _node(Op.RMS_NORM_MUL, F32, a.ne, [a, w, add], {"eps": float(eps)})


# ---------------------------------------------------------------------------------------------- matrix products

# a: [k, m, ne02, ne03]  b: [k, n, ne12, ne13]  ->  [m, n, ne12, ne13]; a broadcast over dims 2 and 3
def mul_mat(a: Tensor, b: Tensor) -> Tensor:
    _check(a.ne[0] == b.ne[0], f"mul_mat: inner dims differ: {a.shape_str()} x {b.shape_str()}")
    _check(b.ne[2] % a.ne[2] == 0 and b.ne[3] % a.ne[3] == 0,
           f"mul_mat: cannot broadcast {a.shape_str()} over {b.shape_str()}")
    _check(not TYPE_TRAITS[b.type].is_quantized, "mul_mat: b must be a float tensor")
    return _node(Op.MUL_MAT, F32, (a.ne[1], b.ne[1], b.ne[2], b.ne[3]), [a, b])


# gate, up: [k, m]  b: [k, n, ne12, ne13]  ->  [m, n, ne12, ne13]: glu(mul_mat(gate, b)) * mul_mat(up, b), the
# feed-forward's two products and its gated unit in one node (glu: "swiglu" or "geglu"); made by the fusion pass
def mul_mat_glu(gate: Tensor, up: Tensor, b: Tensor, glu: str) -> Tensor:
    _check(glu in ("swiglu", "geglu"), f"mul_mat_glu: unknown gated unit {glu!r}")
    _check(gate.ne == up.ne and gate.type == up.type,
           f"mul_mat_glu: gate {gate.shape_str()} and up {up.shape_str()} differ")
    _check(gate.ne[2] == gate.ne[3] == 1, f"mul_mat_glu: the weights must be 2-D, got {gate.shape_str()}")
    r = mul_mat(gate, b)
    return _node(Op.MUL_MAT_GLU, F32, r.ne, [gate, up, b], {"glu": glu})


# as_: [k, m, n_expert]  b: [k, n_used or 1, n_tokens]  ids: I32 [n_used, n_tokens]  ->  [m, n_used, n_tokens]
def mul_mat_id(as_: Tensor, b: Tensor, ids: Tensor) -> Tensor:
    _check(ids.type == I32 and ids.ne[2] == 1 and ids.ne[3] == 1, "mul_mat_id: ids must be a 2-D I32 matrix")
    _check(as_.ne[0] == b.ne[0], f"mul_mat_id: inner dims differ: {as_.shape_str()} x {b.shape_str()}")
    _check(b.ne[2] == ids.ne[1] and b.ne[3] == 1, "mul_mat_id: b must be [k, n_used|1, n_tokens]")
    _check(b.ne[1] in (1, ids.ne[0]), "mul_mat_id: b.ne1 must be 1 or n_used")
    return _node(Op.MUL_MAT_ID, F32, (as_.ne[1], ids.ne[0], b.ne[2], 1), [as_, b, ids])


# ---------------------------------------------------------------------------------------------- rows

# a: [ne0, n_rows, ne2, ne3]  b: I32 [n, ne2, ne3]  ->  [ne0, n, ne2, ne3] (F32; I32 if a is I32)
def get_rows(a: Tensor, b: Tensor) -> Tensor:
    _check(b.type == I32, "get_rows: row indices must be I32")
    _check(a.ne[2] == b.ne[1] and b.ne[3] == 1, f"get_rows: {a.shape_str()} rows by {b.shape_str()}")
    out_type = I32 if a.type == I32 else F32
    return _node(Op.GET_ROWS, out_type, (a.ne[0], b.ne[0], b.ne[1], b.ne[2]), [a, b])


# dst: [ne0, n_rows, ne2, ne3]  src: F32 [ne0, n, ne2', ne3']  idx: I32|I64 [n, ne2', ne3']  ->  dst, rows idx[i] = src[i]
# The result is a view of dst written in place (ggml_set_rows); dst may be a quantized or F16 tensor.
def set_rows(dst: Tensor, src: Tensor, idx: Tensor) -> Tensor:
    _check(idx.type in (I32, GGMLType.I64), "set_rows: indices must be I32 or I64")
    _check(dst.ne[0] == src.ne[0], f"set_rows: row length {src.ne[0]} into rows of {dst.ne[0]}")
    _check(src.ne[1] == idx.ne[0], f"set_rows: {src.ne[1]} rows but {idx.ne[0]} indices")
    _check(src.ne[2] % idx.ne[1] == 0 and src.ne[3] % idx.ne[2] == 0, "set_rows: indices do not broadcast")
    _check(dst.ne[2] % src.ne[2] == 0 or src.ne[2] % dst.ne[2] == 0, "set_rows: dims 2 differ")
    t = Tensor(dst.type, dst.ne, dst.nb, op=Op.SET_ROWS, src=[src, idx], view_src=dst, view_offs=0)
    return t


# ---------------------------------------------------------------------------------------------- softmax, rope, attention

# softmax over ne0 of (a * scale + mask * slope); mask: [ne0, >= ne1, broadcast over ne2, ne3], F16 or F32;
# max_bias > 0 gives ALiBi slopes per head (dim 2)
def soft_max_ext(a: Tensor, mask: Tensor | None = None, scale: float = 1.0, max_bias: float = 0.0) -> Tensor:
    if mask is not None:
        _check(mask.ne[0] == a.ne[0] and mask.ne[1] >= a.ne[1], f"soft_max: mask {mask.shape_str()} for {a.shape_str()}")
        _check(a.ne[2] % mask.ne[2] == 0 and a.ne[3] % mask.ne[3] == 0, "soft_max: mask does not broadcast")
        _check(mask.type in (F32, GGMLType.F16), "soft_max: mask must be F32 or F16")
    src = [a] if mask is None else [a, mask]
    return _node(Op.SOFT_MAX, F32, a.ne, src, {"scale": float(scale), "max_bias": float(max_bias), "has_mask": mask is not None})


def soft_max(a: Tensor) -> Tensor:
    return soft_max_ext(a)


# a: [head_dim, n_head, n_tokens, 1]  pos: I32 [n_tokens]  freq_factors: F32 [n_dims / 2] or None  ->  a's shape
# mode NORM rotates adjacent pairs (x0, x1); NEOX rotates (x_i, x_{i + n_dims/2}). Only the first n_dims are rotated.
def rope_ext(a: Tensor, pos: Tensor, freq_factors: Tensor | None, n_dims: int, mode: int, n_ctx_orig: int,
             freq_base: float, freq_scale: float, ext_factor: float, attn_factor: float,
             beta_fast: float, beta_slow: float) -> Tensor:
    _check(pos.type == I32 and pos.ne[0] == a.ne[2], f"rope: {pos.ne[0]} positions for {a.ne[2]} tokens")
    _check(n_dims <= a.ne[0] and n_dims % 2 == 0, f"rope: n_dims {n_dims} for rows of {a.ne[0]}")
    _check(mode in (ROPE_TYPE_NORM, ROPE_TYPE_NEOX), f"rope: mode {mode} not supported")
    if freq_factors is not None:
        _check(freq_factors.ne[0] >= n_dims // 2, "rope: freq_factors too short")
    src = [a, pos] + ([freq_factors] if freq_factors is not None else [])
    params = dict(n_dims=n_dims, mode=mode, n_ctx_orig=n_ctx_orig, freq_base=float(freq_base),
                  freq_scale=float(freq_scale), ext_factor=float(ext_factor), attn_factor=float(attn_factor),
                  beta_fast=float(beta_fast), beta_slow=float(beta_slow), has_freq_factors=freq_factors is not None)
    return _node(Op.ROPE, F32, a.ne, src, params)


# ggml_rope_multi: pos I32 [4 * n_tokens], four rows of positions (row-major: all tokens' first, then the second...).
# Pair j of the rotated dims takes its angle from row r of its section (sections: 4 counts of pairs, over which j
# cycles): MROPE (qwen2-VL's language model: t, h, w, e rows, NeoX halves of n_dims) or VISION (the encoder's 2-D
# rope: n_dims = head_dim / 2, pairs (i, i + n_dims) over the whole head, each section's angle restarting at its row)
def rope_multi(a: Tensor, pos: Tensor, freq_factors: Tensor | None, n_dims: int, sections, mode: int,
               n_ctx_orig: int, freq_base: float, freq_scale: float, ext_factor: float, attn_factor: float,
               beta_fast: float, beta_slow: float) -> Tensor:
    sections = tuple(int(s) for s in sections)
    _check(len(sections) == 4 and all(s >= 0 for s in sections) and any(sections[:3]),
           f"rope_multi: sections {list(sections)}")
    _check(mode in (ROPE_TYPE_MROPE, ROPE_TYPE_VISION), f"rope_multi: mode {mode} not supported")
    _check(pos.type == I32 and pos.ne[0] == 4 * a.ne[2], f"rope_multi: {pos.ne[0]} positions for {a.ne[2]} tokens "
           f"(4 rows of positions a token)")
    if mode == ROPE_TYPE_VISION:
        _check(n_dims * 2 == a.ne[0], f"rope_multi: vision rope takes n_dims = head size / 2, not {n_dims}")
        _check(sum(sections) <= a.ne[0], f"rope_multi: sections {list(sections)} exceed the head")
    else:
        _check(n_dims <= a.ne[0] and n_dims % 2 == 0, f"rope_multi: n_dims {n_dims} for rows of {a.ne[0]}")
        _check(sum(sections) <= a.ne[0], f"rope_multi: sections {list(sections)} exceed the head")
    if freq_factors is not None:
        _check(freq_factors.ne[0] >= n_dims // 2, "rope_multi: freq_factors too short")
    src = [a, pos] + ([freq_factors] if freq_factors is not None else [])
    params = dict(n_dims=n_dims, mode=mode, n_ctx_orig=n_ctx_orig, freq_base=float(freq_base),
                  freq_scale=float(freq_scale), ext_factor=float(ext_factor), attn_factor=float(attn_factor),
                  beta_fast=float(beta_fast), beta_slow=float(beta_slow), has_freq_factors=freq_factors is not None,
                  sections=sections)
    return _node(Op.ROPE, F32, a.ne, src, params)


def rope(a: Tensor, pos: Tensor, n_dims: int, mode: int = ROPE_TYPE_NORM, freq_base: float = 10000.0) -> Tensor:
    return rope_ext(a, pos, None, n_dims, mode, 0, freq_base, 1.0, 0.0, 1.0, 32.0, 1.0)


# q: [d, n_q, n_head, ne3]  k: [d, n_kv, n_head_kv, ne3]  v: [dv, n_kv, n_head_kv, ne3]
# mask: [n_kv, >= n_q, 1|.., 1|..] F16/F32  ->  [dv, n_head, n_q, ne3] (note the permuted result, as ggml)
# n_head % n_head_kv == 0 (GQA broadcast). softcap > 0: scores = softcap * tanh(scores / softcap).
# sinks: F32 [n_head] or None: one more logit per head that joins each row's softmax with no value (gpt-oss's
# attention sinks, ggml_flash_attn_ext_add_sinks); it is the last source
def flash_attn_ext(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, scale: float,
                   max_bias: float = 0.0, logit_softcap: float = 0.0, sinks: Tensor | None = None) -> Tensor:
    _check(q.ne[0] == k.ne[0], f"flash_attn: q {q.shape_str()} and k {k.shape_str()} head sizes differ")
    _check(k.ne[1] == v.ne[1] and k.ne[2] == v.ne[2], f"flash_attn: k {k.shape_str()} and v {v.shape_str()} differ")
    _check(q.ne[2] % k.ne[2] == 0, f"flash_attn: {q.ne[2]} heads over {k.ne[2]} kv heads")
    if mask is not None:
        _check(mask.ne[0] == k.ne[1] and mask.ne[1] >= q.ne[1], f"flash_attn: mask {mask.shape_str()}")
    if sinks is not None:
        _check(sinks.type == F32 and sinks.ne == (q.ne[2], 1, 1, 1), f"flash_attn: sinks {sinks.shape_str()} for "
               f"{q.ne[2]} heads")
    src = [q, k, v] + ([mask] if mask is not None else []) + ([sinks] if sinks is not None else [])
    params = {"scale": float(scale), "max_bias": float(max_bias), "softcap": float(logit_softcap),
              "has_mask": mask is not None, "has_sinks": sinks is not None}
    return _node(Op.FLASH_ATTN_EXT, F32, (v.ne[0], q.ne[2], q.ne[1], q.ne[3]), src, params)


# ---------------------------------------------------------------------------------------------- state-space models

# sx: [d_conv - 1 + n_t, d_inner, n_s]  c: [d_conv, d_inner]  ->  [d_inner, n_t, n_s]
# out[i, t, s] = sum over k < d_conv of sx[t + k, i, s] * c[k, i], a float sum in k order (ggml_ssm_conv): the
# depthwise causal convolution of each sequence's previous d_conv - 1 columns followed by its n_t new ones.
def ssm_conv(sx: Tensor, c: Tensor) -> Tensor:
    _check(sx.ne[3] == 1 and c.ne[2] == 1 and c.ne[3] == 1, "ssm_conv: sx must be 3-D and c a matrix")
    d_conv, d_inner = c.ne[0], c.ne[1]
    n_t = sx.ne[0] - d_conv + 1
    _check(n_t >= 0 and sx.ne[1] == d_inner, f"ssm_conv: sx {sx.shape_str()} for a kernel {c.shape_str()}")
    _check(sx.type == F32 and c.type == F32, "ssm_conv: F32 only")
    _check(sx.nb[0] == 4 and sx.nb[1] == 4 * sx.ne[0], "ssm_conv: sx rows must be contiguous")
    return _node(Op.SSM_CONV, F32, (d_inner, n_t, sx.ne[2]), [sx, c])


# x: F32 [d_inner, n_t, n_s] (each sequence's new inputs)  c: [d_conv, d_inner]  r: F32 [(d_conv - 1) d_inner, n_rows]
# (a row: each channel's last d_conv - 1 inputs, channel by channel)  src, dst: I32 [n_s]  ->  [d_inner, n_t, n_s]
# = ssm_conv(concat(reshape(get_rows(r, src), d_conv - 1, d_inner, n_s), transpose(x), 0), c), and row dst[j] of r
# then holds sequence j's last d_conv - 1 inputs (every src row is read before any dst row is written): a recurrent
# layer's convolution with its rolling rows (llama.cpp's build_rs and ssm_conv). Produced by the fusion pass.
# bias (F32 [d_inner]) and silu: the output is silu(conv + bias) (mamba's conv then add then silu), silu(conv) without one.
def ssm_conv_state(x: Tensor, c: Tensor, r: Tensor, src: Tensor, dst: Tensor, bias: Tensor | None = None,
                   silu: bool = False) -> Tensor:
    d_conv, d_inner = c.ne[0], c.ne[1]
    _check(x.type == F32 and c.type == F32 and r.type == F32, "ssm_conv_state: F32 only")
    _check(x.ne[0] == d_inner and x.ne[3] == 1 and x.nb[0] == 4, f"ssm_conv_state: x {x.shape_str()} for a kernel "
           f"{c.shape_str()}")
    _check(d_conv >= 2 and r.ne[0] == (d_conv - 1) * d_inner and r.ne[2] == r.ne[3] == 1 and r.is_contiguous(),
           f"ssm_conv_state: rows {r.shape_str()} for a kernel {c.shape_str()}")
    _check(src.type == I32 and dst.type == I32 and src.ne == dst.ne == (x.ne[2], 1, 1, 1),
           "ssm_conv_state: src and dst must be I32 [n_s]")
    _check(bias is None or (silu and bias.type == F32 and bias.ne == (d_inner, 1, 1, 1) and bias.is_contiguous()),
           "ssm_conv_state: a bias is F32 [d_inner], and comes with silu")
    srcs = [x, c, r, src, dst] + ([bias] if bias is not None else [])
    return _node(Op.SSM_CONV_STATE, F32, (d_inner, x.ne[1], x.ne[2]), srcs, {"silu": bool(silu)})


# z, y, x: F32 of one shape [head_dim, n_head, n_t, n_s], rows contiguous  d: F32 [1, n_head]  ->  silu(z) * (y + x d)
# = swiglu(z, add(y, mul(x, d))): Mamba-2's output after the scan, its skip x·D (one value per head) and the gate z.
# Produced by the fusion pass.
def ssm_gate(z: Tensor, y: Tensor, x: Tensor, d: Tensor) -> Tensor:
    _check(all(t.type == F32 for t in (z, y, x, d)), "ssm_gate: F32 only")
    _check(z.ne == y.ne == x.ne and all(t.nb[0] == 4 for t in (z, y, x)),
           f"ssm_gate: z {z.shape_str()}, y {y.shape_str()} and x {x.shape_str()} must be one shape, rows contiguous")
    _check(d.ne == (1, x.ne[1], 1, 1) and d.is_contiguous(), f"ssm_gate: d {d.shape_str()} is not one value per head")
    return _node(Op.SSM_GATE, F32, x.ne, [z, y, x, d])


# s: [d_state, head_dim, n_head, n_rs]  x: [head_dim, n_head, n_seq_tokens, n_seqs]  dt: [n_head, n_seq_tokens, n_seqs]
# A: [d_state, n_head] (Mamba-1: a decay per element) or [1, n_head] (Mamba-2: one per head)
# B, C: [d_state, n_group, n_seq_tokens, n_seqs] (head h reads group h / (n_head / n_group))  ids: I32 [n_seqs]
#   ->  F32 [x.nelements + d_state * head_dim * n_head * n_seqs]: y ([head_dim, n_head, n_seq_tokens, n_seqs]), then
#       the final state of each sequence ([d_state, head_dim, n_head, n_seqs])
# Sequence j starts from state row ids[j] of s; per token: dt' = softplus(dt), state = state * exp(dt' * A) +
# B * (x * dt'), y = sum over d_state of state * C (ggml_ssm_scan with K = 1).
def ssm_scan(s: Tensor, x: Tensor, dt: Tensor, A: Tensor, B: Tensor, C: Tensor, ids: Tensor) -> Tensor:
    d_state, head_dim, n_head, n_seq_tokens, n_seqs = s.ne[0], x.ne[0], x.ne[1], x.ne[2], x.ne[3]
    _check(all(t.type == F32 for t in (s, x, dt, A, B, C)), "ssm_scan: F32 tensors only")
    _check(s.is_contiguous() and dt.is_contiguous() and A.is_contiguous(), "ssm_scan: s, dt and A must be contiguous")
    for name, t in (("x", x), ("B", B), ("C", C)):
        _check(t.nb[0] == 4 and t.nb[1] == t.ne[0] * 4, f"ssm_scan: {name} rows must be packed")
    _check(B.ne == C.ne, f"ssm_scan: B {B.shape_str()} and C {C.shape_str()} differ")
    _check(ids.type == I32 and ids.n_dims == 1 and ids.ne[0] == n_seqs, f"ssm_scan: ids must be I32 [{n_seqs}]")
    _check(dt.ne[:3] == (n_head, n_seq_tokens, n_seqs) and dt.ne[3] == 1, f"ssm_scan: dt {dt.shape_str()}")
    _check(s.ne[1] == head_dim and s.ne[2] == n_head, f"ssm_scan: states {s.shape_str()} for x {x.shape_str()}")
    _check(B.ne[0] == d_state and B.ne[2] == n_seq_tokens and B.ne[3] == n_seqs, f"ssm_scan: B {B.shape_str()}")
    _check(B.ne[1] >= 1 and n_head % B.ne[1] == 0, f"ssm_scan: {n_head} heads in {B.ne[1]} groups")
    _check(A.ne[1] == n_head and A.ne[0] in (1, d_state) and A.ne[2] == A.ne[3] == 1, f"ssm_scan: A {A.shape_str()}")
    n = x.nelements + d_state * head_dim * n_head * n_seqs
    return _node(Op.SSM_SCAN, F32, (n,), [s, x, dt, A, B, C, ids])


def _wkv_check(name: str, state: Tensor, *ts: Tensor) -> tuple[int, int, int, int]:
    S, H, n_tokens = ts[0].ne[0], ts[0].ne[1], ts[0].ne[2]
    n_seqs = state.ne[1]
    for t in ts + (state,):
        _check(t.type == F32 and t.is_contiguous(), f"{name}: contiguous F32 tensors only, not {t.shape_str()}")
    for t in ts[1:]:
        _check(t.ne[:3] == (S, H, n_tokens), f"{name}: {t.shape_str()} beside {ts[0].shape_str()}")
    _check(state.nelements == S * S * H * n_seqs and n_seqs >= 1 and n_tokens % n_seqs == 0,
           f"{name}: state {state.shape_str()} for {H} heads of {S} and {n_tokens} tokens")
    return S, H, n_tokens, n_seqs


# k, v, r, td: [S, H, n_tokens]  tf: [S, H]  state: [S * S * H, n_seqs]  ->  [S * H, n_tokens + S * n_seqs]: the
# outputs, then each sequence's new state. Tokens are grouped by sequence (n_tokens / n_seqs each); per head, a
# sequence's state st[i, j] (i: key channel, j: value channel) starts from its state row and per token
# y[j] = sum over i of (k[i] v[j] tf[i] + st[i, j]) r[i] (in i order), then st[i, j] = st[i, j] td[i] + k[i] v[j]
# (ggml_rwkv_wkv6).
def rwkv_wkv6(k: Tensor, v: Tensor, r: Tensor, tf: Tensor, td: Tensor, state: Tensor) -> Tensor:
    S, H, n_tokens, n_seqs = _wkv_check("rwkv_wkv6", state, k, v, r, td)
    _check(tf.type == F32 and tf.is_contiguous() and tf.nelements == S * H, f"rwkv_wkv6: tf {tf.shape_str()}")
    return _node(Op.RWKV_WKV6, F32, (S * H, n_tokens + S * n_seqs), [k, v, r, tf, td, state])


# r, w, k, v, a, b: [S, H, n_tokens]  state: [S * S * H, n_seqs]  ->  [S * H, n_tokens + S * n_seqs], laid out as
# rwkv_wkv6's. Per head the state st[i, j] (i: value channel, j: key channel) follows, per token,
# sa = sum over j of a[j] st[i, j]; st[i, j] = st[i, j] w[j] + v[i] k[j] + sa b[j]; y[i] = sum over j of
# st[i, j] r[j] (ggml_rwkv_wkv7: RWKV-7's generalised delta rule).
def rwkv_wkv7(r: Tensor, w: Tensor, k: Tensor, v: Tensor, a: Tensor, b: Tensor, state: Tensor) -> Tensor:
    S, H, n_tokens, n_seqs = _wkv_check("rwkv_wkv7", state, k, r, w, v, a, b)
    return _node(Op.RWKV_WKV7, F32, (S * H, n_tokens + S * n_seqs), [r, w, k, v, a, b, state])


# k, v, q, g: [S, H, n_tokens]  state: [S * S * H, n_seqs]  ->  [S * H, n_tokens + S * n_seqs], laid out as
# rwkv_wkv6's: per head the state st[i, j] (i: key channel, j: value channel) follows, per token,
# st[i, j] = st[i, j] g[i] + k[i] v[j], and y[j] = sum over i of st[i, j] (q[i] scale), in i order
# (ggml_gated_linear_attn: RWKV-6 Qwen2's time mix).
def gated_linear_attn(k: Tensor, v: Tensor, q: Tensor, g: Tensor, state: Tensor, scale: float) -> Tensor:
    S, H, n_tokens, n_seqs = _wkv_check("gated_linear_attn", state, k, v, q, g)
    return _node(Op.GATED_LINEAR_ATTN, F32, (S * H, n_tokens + S * n_seqs), [k, v, q, g, state],
                 {"scale": float(scale)})

# q, k: [S, H_k, n_tokens, n_seqs_k]  v: [S, H, n_tokens, n_seqs]  g: [1 or S, H, n_tokens, n_seqs]
# beta: [1, H, n_tokens, n_seqs]  state: [S, S, H, n_seqs]  ->  [S * H, n_tokens * n_seqs + S * n_seqs]: the outputs
# ([S, H, n_tokens, n_seqs]), then each sequence's new state. Value head h reads key head h % H_k and sequence
# j / (n_seqs / n_seqs_k) of q and k, as ggml broadcasts. Per head the state M[j, i] (row j: value channel, i: key
# channel) follows, per token, M *= exp(g) (per key channel when g has S rows: Kimi's KDA),
# d[j] = (v[j] - M[j] . k) beta, M[j, i] += k[i] d[j], y[j] = (M[j] . q) / sqrt(S) (ggml_gated_delta_net with one
# state slot: Qwen3-Next's gated DeltaNet).
def gated_delta_net(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, state: Tensor) -> Tensor:
    S, H, n_tokens, n_seqs = v.ne
    for name, t in (("q", q), ("k", k), ("v", v), ("g", g), ("beta", beta), ("state", state)):
        _check(t.type == F32, f"gated_delta_net: {name} must be F32, not {t.type.name}")
    for name, t in (("q", q), ("k", k), ("v", v)):
        _check(t.nb[0] == 4, f"gated_delta_net: {name} rows must be contiguous")
    for name, t in (("g", g), ("beta", beta), ("state", state)):
        _check(t.is_contiguous(), f"gated_delta_net: {name} must be contiguous")
    _check(q.ne == k.ne, f"gated_delta_net: q {q.shape_str()} and k {k.shape_str()} differ")
    _check(q.ne[0] == S and q.ne[2] == n_tokens and H % q.ne[1] == 0 and n_seqs % q.ne[3] == 0,
           f"gated_delta_net: q {q.shape_str()} for v {v.shape_str()}")
    _check(g.ne[0] in (1, S) and g.ne[1:] == (H, n_tokens, n_seqs), f"gated_delta_net: g {g.shape_str()}")
    _check(beta.ne == (1, H, n_tokens, n_seqs), f"gated_delta_net: beta {beta.shape_str()}")
    _check(state.ne == (S, S, H, n_seqs), f"gated_delta_net: state {state.shape_str()} for v {v.shape_str()}")
    return _node(Op.GATED_DELTA_NET, F32, (S * H, n_tokens * n_seqs + S * n_seqs), [q, k, v, g, beta, state])


# ---------------------------------------------------------------------------------------------- convolution, pooling

# a (the kernel, shape only): [KW, KH, IC, OC]  b: [IW, IH, IC, N]  ->  dst_type [IC * KH * KW, OW, OH, N]
# (ggml_im2col, 2-D): each output column holds the input patch under the kernel, ordered (channel, row, column),
# zeros where the kernel reaches into the padding; OW = (IW + 2 p0 - d0 (KW - 1) - 1) / s0 + 1, OH likewise.
# The values are stored in dst_type: F16 (ggml_conv_2d's choice) rounds the pixels there.
def im2col(a: Tensor, b: Tensor, s0: int, s1: int, p0: int, p1: int, d0: int, d1: int,
           dst_type: GGMLType = GGMLType.F16) -> Tensor:
    _check(a.ne[2] == b.ne[2], f"im2col: kernel {a.shape_str()} for {b.ne[2]} input channels")
    _check(b.type in (F32, GGMLType.F16), "im2col: the input must be F32 or F16")
    _check(dst_type in (F32, GGMLType.F16), "im2col: the result must be F32 or F16")
    _check(min(s0, s1, d0, d1) > 0 and min(p0, p1) >= 0, "im2col: strides and dilations positive, padding >= 0")
    ow = (b.ne[0] + 2 * p0 - d0 * (a.ne[0] - 1) - 1) // s0 + 1
    oh = (b.ne[1] + 2 * p1 - d1 * (a.ne[1] - 1) - 1) // s1 + 1
    _check(ow > 0 and oh > 0, f"im2col: kernel {a.shape_str()} larger than the input {b.shape_str()}")
    params = dict(s0=s0, s1=s1, p0=p0, p1=p1, d0=d0, d1=d1)
    return _node(Op.IM2COL, dst_type, (a.ne[2] * a.ne[1] * a.ne[0], ow, oh, b.ne[3]), [a, b], params)


# a: [KW, KH, IC, OC]  b: [IW, IH, IC, N]  ->  [OW, OH, OC, N] (ggml_conv_2d): im2col to F16 (F32 for a BF16
# kernel), then one product of the patches with the kernel rows; the F16 step rounds the input, as ggml does
def conv_2d(a: Tensor, b: Tensor, s0: int, s1: int, p0: int, p1: int, d0: int = 1, d1: int = 1) -> Tensor:
    im = im2col(a, b, s0, s1, p0, p1, d0, d1, F32 if a.type == GGMLType.BF16 else GGMLType.F16)
    k = im.ne[0]
    res = mul_mat(reshape(im, k, im.ne[3] * im.ne[2] * im.ne[1]), reshape(a, k, a.ne[3]))   # [N OH OW, OC]
    res = reshape(res, im.ne[1], im.ne[2], im.ne[3], a.ne[3])                                    # [OW, OH, N, OC]
    return cont(permute(res, 0, 1, 3, 2))


POOL_MAX = 0
POOL_AVG = 1


# a: [IW, IH, C, N]  ->  F32 [OW, OH, C, N], OW = (IW + 2 p0 - k0) / s0 + 1 (ggml_pool_2d). AVG divides the sum of
# the values inside the input by k0 * k1, padding included.
def pool_2d(a: Tensor, op: int, k0: int, k1: int, s0: int, s1: int, p0: int = 0, p1: int = 0) -> Tensor:
    _check(op in (POOL_MAX, POOL_AVG), f"pool_2d: unknown pooling {op}")
    _check(a.type in (F32, GGMLType.F16), "pool_2d: the input must be F32 or F16")
    _check(min(k0, k1, s0, s1) > 0 and min(p0, p1) >= 0, "pool_2d: kernel and strides positive, padding >= 0")
    ow = (a.ne[0] + 2 * p0 - k0) // s0 + 1
    oh = (a.ne[1] + 2 * p1 - k1) // s1 + 1
    _check(ow > 0 and oh > 0, f"pool_2d: a {k0}x{k1} kernel over {a.shape_str()}")
    params = dict(op=op, k0=k0, k1=k1, s0=s0, s1=s1, p0=p0, p1=p1)
    return _node(Op.POOL_2D, F32, (ow, oh, a.ne[2], a.ne[3]), [a], params)


# ---------------------------------------------------------------------------------------------- copies and views

# copy a into b (converting type; same number of elements); the result is a view of b
def cpy(a: Tensor, b: Tensor) -> Tensor:
    _check(a.nelements == b.nelements, f"cpy: {a.shape_str()} into {b.shape_str()}")
    return Tensor(b.type, b.ne, b.nb, op=Op.CPY, src=[a, b], view_src=b, view_offs=0)


def cont(a: Tensor, *ne) -> Tensor:
    """A contiguous copy of a (optionally reshaped to ne)."""
    ne = tuple(ne) if ne else a.ne
    _check(_prod(ne) == a.nelements, f"cont: {a.shape_str()} to {ne}")
    return _node(Op.CONT, a.type, ne, [a])


def dup(a: Tensor) -> Tensor:
    return _node(Op.DUP, a.type, a.ne, [a])


def cast(a: Tensor, type: GGMLType) -> Tensor:
    return cpy(a, Tensor(type, a.ne))


def _prod(ne):
    p = 1
    for n in ne:
        p *= n
    return p


# a must be contiguous; metadata only
def reshape(a: Tensor, *ne) -> Tensor:
    _check(a.is_contiguous(), "reshape: tensor must be contiguous")
    _check(_prod(ne) == a.nelements, f"reshape: {a.shape_str()} has {a.nelements} elements, not {ne}")
    return Tensor(a.type, ne, op=Op.RESHAPE, src=[a], view_src=a, view_offs=0)


# a view of ne elements with strides nb (bytes, dims 1..3) starting offset bytes into a
def view(a: Tensor, ne, nb=None, offset: int = 0) -> Tensor:
    ne = tuple(ne) + (1,) * (GGML_MAX_DIMS - len(ne))
    if nb is None:
        nb = contiguous_strides(a.type, ne)
    else:
        nb = (TYPE_TRAITS[a.type].type_size,) + tuple(nb)
        nb = nb + tuple(nb[-1] * ne[i - 1] for i in range(len(nb), GGML_MAX_DIMS))
    t = Tensor(a.type, ne, nb, op=Op.VIEW, src=[a], op_params={"offset": offset}, view_src=a, view_offs=offset)
    owner = t.view_src
    _check(t.view_offs + t.nbytes <= owner.nbytes, f"view: {t.shape_str()} at +{offset} exceeds {owner!r}")
    return t


def view_1d(a, ne0, offset=0): return view(a, (ne0,), None, offset)
def view_2d(a, ne0, ne1, nb1, offset=0): return view(a, (ne0, ne1), (nb1,), offset)
def view_3d(a, ne0, ne1, ne2, nb1, nb2, offset=0): return view(a, (ne0, ne1, ne2), (nb1, nb2), offset)
def view_4d(a, ne0, ne1, ne2, ne3, nb1, nb2, nb3, offset=0): return view(a, (ne0, ne1, ne2, ne3), (nb1, nb2, nb3), offset)


# dim i of a goes to position axes[i] of the result (ggml_permute)
def permute(a: Tensor, a0: int, a1: int, a2: int, a3: int) -> Tensor:
    axes = (a0, a1, a2, a3)
    _check(sorted(axes) == [0, 1, 2, 3], f"permute: {axes} is not a permutation")
    ne = [0] * 4
    nb = [0] * 4
    for i, ax in enumerate(axes):
        ne[ax] = a.ne[i]
        nb[ax] = a.nb[i]
    return Tensor(a.type, ne, nb, op=Op.PERMUTE, src=[a], op_params={"axes": axes}, view_src=a, view_offs=0)


def transpose(a: Tensor) -> Tensor:
    t = permute(a, 1, 0, 2, 3)
    t.op = Op.TRANSPOSE
    return t


# ---------------------------------------------------------------------------------------------- shape ops and reductions

# a and b agree on every dim but ``dim``  ->  concatenated along it
def concat(a: Tensor, b: Tensor, dim: int) -> Tensor:
    _check(0 <= dim < GGML_MAX_DIMS, f"concat: dim {dim}")
    _check(all(a.ne[i] == b.ne[i] for i in range(GGML_MAX_DIMS) if i != dim), f"concat: {a.shape_str()} and {b.shape_str()}")
    _check(a.type == b.type, "concat: types differ")
    ne = list(a.ne)
    ne[dim] += b.ne[dim]
    return _node(Op.CONCAT, a.type, ne, [a, b], {"dim": dim})


# a tiled to b's shape
def repeat(a: Tensor, b: Tensor) -> Tensor:
    _check(_can_repeat(a, b), f"repeat: {a.shape_str()} does not tile {b.shape_str()}")
    return _node(Op.REPEAT, a.type, b.ne, [a])


# [ne0, ne1, ne2, ne3] -> [1, ne1, ne2, ne3]
def sum_rows(a: Tensor) -> Tensor:
    return _node(Op.SUM_ROWS, F32, (1,) + a.ne[1:], [a])


def mean(a: Tensor) -> Tensor:
    return _node(Op.MEAN, F32, (1,) + a.ne[1:], [a])


# a: [ne0, ne1] -> I32 [ne1], index of the largest value of each row as ggml_vec_argmax_f32 scans it: the last
# of equal maxima; a NaN is never taken and restarts the scan (all -inf: the last index; all NaN: 0)
def argmax(a: Tensor) -> Tensor:
    _check(a.ne[2] == 1 and a.ne[3] == 1, "argmax: a must be a matrix")
    return _node(Op.ARGMAX, I32, (a.ne[1],), [a])


SORT_ASC = 0
SORT_DESC = 1


# I32 indices that sort each row (stable)
def argsort(a: Tensor, order: int = SORT_ASC) -> Tensor:
    return _node(Op.ARGSORT, I32, a.ne, [a], {"order": order})


# I32 [k, ne1, ne2, ne3]: indices of the k largest values of each row, largest first
def top_k(a: Tensor, k: int) -> Tensor:
    _check(0 < k <= a.ne[0], f"top_k: k={k} for rows of {a.ne[0]}")
    return _node(Op.TOP_K, I32, (k,) + a.ne[1:], [a], {"k": k})


def is_binary(op: Op) -> bool:
    return op in BINARY_OPS
