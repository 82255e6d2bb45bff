"""Binders for the hot ops the cpu backend runs in Numba (element-wise with broadcast, softmax, rows): each takes
(node, dst, srcs) once, at plan time, checks the types and layouts, and returns the call to make on every run, or
None when the NumPy kernel (numpy_ops.py) must handle the case."""
from __future__ import annotations

import numpy as np

from ...tensor import Flags, Op
from ...types import GGMLType, TYPE_TRAITS
from . import elementwise, rows
from .numpy_ops import alibi_slopes
from .dot_q32 import F16_TABLE
from . import softmax
from .direct import Direct, Prepare

T = GGMLType
_BIN = {Op.ADD: elementwise.OP_ADD, Op.SUB: elementwise.OP_SUB, Op.MUL: elementwise.OP_MUL, Op.DIV: elementwise.OP_DIV}
_NO_MASK = np.zeros((1, 1, 1, 0), np.float32)
PAR_MIN_ELEMENTS = 1 << 16   # below this, one thread: a parallel region costs more than the work


def _fixed(*tensors, weight=None) -> bool:
    """Whether each tensor is a graph input (or a view of one), and ``weight``, if given, a leaf of the model's
    weights (RoPE's frequency factors): memory set before the graph runs that its nodes only read, so a test of its
    values holds for the whole run (``direct.Prepare``)."""
    for t in tensors:
        s = t.storage
        if s.op is not Op.NONE or not s.flags & Flags.INPUT:
            return False
    if weight is not None:
        s = weight.storage
        return s.op is Op.NONE and bool(s.flags & Flags.WEIGHT)
    return True


def _pick(module, name, n_elements):
    return getattr(module, name + "_par" if n_elements >= PAR_MIN_ELEMENTS else name)


def bind_binary(node, dst, srcs):
    if not (node.src[0].type == node.src[1].type == node.type == T.F32):
        return None
    a, b = srcs
    code = _BIN[node.op]
    fn = _pick(elementwise, "binary_f32", node.nelements)
    return Direct(fn, a, b, dst, code)


def bind_scale(node, dst, srcs):
    """SCALE of float32 into float32 without a bias: one float32 multiply per value into dst (k_scale's numbers,
    without its temporaries: Gemma runs 19 of these per token)."""
    p = node.op_params
    if node.src[0].type != T.F32 or node.type != T.F32 or p["b"] or srcs[0].shape != dst.shape:
        return None
    x, sv = srcs[0], np.float32(p["s"])
    if x.flags.c_contiguous and dst.flags.c_contiguous:      # a Numba loop: a third of the ufunc call's time at
        from .elementwise import scale_f32                    # a token's 768 values (Granite: 65 per token)
        xf, of = x.reshape(-1), dst.reshape(-1)
        return Direct(scale_f32, xf, sv, of)
    return lambda: np.multiply(x, sv, out=dst)


def bind_soft_max(node, dst, srcs):
    if node.src[0].type != T.F32:
        return None
    p = node.op_params
    x = srcs[0]
    slopes = alibi_slopes(node.ne[2], p["max_bias"], np.float32)
    scale = np.float32(p["scale"])
    soft_max_rows = _pick(softmax, "soft_max_rows", node.nelements)
    if not p["has_mask"]:
        return Direct(soft_max_rows, x, _NO_MASK, slopes, scale, dst)
    m, mtype = srcs[1], node.src[1].type
    if mtype == T.F32:
        return Direct(soft_max_rows, x, m, slopes, scale, dst)
    return lambda: soft_max_rows(x, F16_TABLE[m.view(np.uint16)], slopes, scale, dst)


def bind_get_rows(node, dst, srcs):
    a, b = srcs
    t = node.src[0].type
    idx = b[0]
    if node.src[1].type != T.I32:
        return None
    n_rows = node.src[0].ne[1]
    if t in (T.F32, T.I32):
        fn = _pick(rows, "get_rows_plain", node.nelements)
        kernel = lambda: fn(a, idx, dst)
    elif t == T.F16:
        a16 = a.view(np.uint16)
        fn = _pick(rows, "get_rows_f16", node.nelements)
        kernel = lambda: fn(a16, idx, F16_TABLE, dst)
    else:
        from ...quants import dequantize
        from .matmul import _weights_tile   # the prompt products' tile decoders: ggml's dequantize_row_* values

        k = node.src[0].ne[0]
        blocks = t != T.BF16 and dst.dtype == np.float32 and dst.flags.c_contiguous
        out = dst.reshape(-1, k) if blocks else None     # a view: dst is contiguous

        def run_q():   # block types: decode only the selected rows (a token's embedding row, at decode)
            rows.check_index(idx, n_rows, "get_rows")
            sel = a[np.arange(idx.shape[0])[:, None, None], np.arange(idx.shape[1])[None, :, None], idx]
            if blocks:
                sel = sel.reshape(-1, sel.shape[-1])
                _weights_tile(sel, t, 0, sel.shape[0], k, out)
            else:
                dst[...] = dequantize(sel, t).reshape(dst.shape)
        return run_q

    def run():
        rows.check_index(idx, n_rows, "get_rows")
        kernel()
    return run


def bind_set_rows(node, dst, srcs):
    from .ssm import bind_state_store
    stored = bind_state_store(node, dst, srcs)       # a Mamba-2 layer's states: its scan writes them itself
    if stored is not None:
        return stored
    src, idx = srcs[0], srcs[1][0]
    t = node.type
    if node.src[0].type != T.F32 or t not in (T.F16, T.F32):
        return None
    n_rows = node.ne[1]
    # the threads split rows: one row (a recurrent layer's state of one sequence, 1 MiB in Mamba-2 370M) runs on one
    # thread either way, without a parallel region's start
    size = src.size if src.size // src.shape[-1] > 1 else 0
    if t == T.F16:
        fn, d, src = _pick(rows, "set_rows_f16", size), dst.view(np.uint16), src.view(np.uint32)
        if fn is rows.set_rows_f16:         # the index test in the same call
            def run_one():
                if not rows.set_rows_f16_checked(src, idx, n_rows, d):
                    raise rows.index_error("set_rows", n_rows)
            if _fixed(node.src[1]):         # indices of an input: tested once a run, the kernel's test then passes
                run_one.direct = (rows.index_prepare(idx, n_rows, "set_rows"),
                                  Direct(rows.set_rows_f16_checked, src, idx, n_rows, d))
            return run_one
    else:
        fn, d = _pick(rows, "set_rows_same", size), dst

    def run():
        rows.check_index(idx, n_rows, "set_rows")
        fn(src, idx, d)
    return run


def _rows2d(a):
    """a as [rows, ne0] without copying, or None (the kernels need each row contiguous and rows evenly spaced)."""
    if a.dtype != np.float32 or a.strides[-1] != 4:
        return None
    try:
        v = a.view()
        v.shape = (-1, a.shape[-1])      # raises instead of copying
    except AttributeError:
        return None
    return v


def bind_glu(node, dst, srcs):
    if node.op not in (Op.SWIGLU, Op.GEGLU) or len(srcs) != 2 or node.type != T.F32 or \
            node.src[0].type != T.F32 or node.src[1].type != T.F32 or node.src[0].ne != node.src[1].ne:
        return None
    g, u, d = _rows2d(srcs[0]), _rows2d(srcs[1]), _rows2d(dst)
    if g is None or u is None or d is None:
        return None                    # two sources: gate, up in that order (ggml reads swapped only with one)
    from .act import GLU_PAR_ROWS, geglu_rows, geglu_rows_par, gelu_table, swiglu_rows, swiglu_rows_par
    # Mamba-2's decoded token gives n_head short rows: rows alone would start a parallel region for 2048 values
    par = g.shape[0] >= GLU_PAR_ROWS and node.nelements >= PAR_MIN_ELEMENTS
    if node.op is Op.GEGLU:
        table = gelu_table()
        fn = geglu_rows_par if par else geglu_rows
        return Direct(fn, g, u, table, d)
    fn = swiglu_rows_par if par else swiglu_rows
    return Direct(fn, g, u, d)


def _apart(*arrays):
    """The arrays' memory ranges do not overlap (the loops below copy without NumPy's overlap handling)."""
    return not any(np.may_share_memory(x, y) for i, x in enumerate(arrays) for y in arrays[i + 1:])


def bind_cont(node, dst, srcs):
    """CONT / CPY / DUP of float32 into float32 (rows.cont_f32) or F16 (rows.cont_f32_f16); else numpy_ops'
    k_cpy."""
    src = srcs[0]
    if node.src[0].type != T.F32 or node.type not in (T.F32, T.F16) or src.ndim != 4 or not dst.flags.c_contiguous:
        return None
    if node.type == T.F16:
        if dst.dtype.itemsize != 2 or src.strides[-1] != 4 or not _apart(src, dst):
            return None
        out = dst.view(np.uint16).reshape(src.shape)
        fn, bits = _pick(rows, "cont_f32_f16", node.nelements), src.view(np.uint32)
        return Direct(fn, bits, out)
    out = dst.view()
    try:
        out.shape = src.shape           # raises instead of copying
    except (AttributeError, ValueError):
        return None
    if not _apart(src, out):
        return None
    fn = _pick(rows, "cont_f32", node.nelements)
    return Direct(fn, src, out)


def bind_concat(node, dst, srcs):
    """CONCAT of float32 along dim 0 (rows.concat0_f32); other dims and types in numpy_ops."""
    a, b = srcs
    if node.op_params["dim"] != 0 or not (node.type == node.src[0].type == node.src[1].type == T.F32) or \
            a.ndim != 4 or b.ndim != 4 or dst.ndim != 4 or not (_apart(a, dst) and _apart(b, dst)):
        return None
    fn = _pick(rows, "concat0_f32", node.nelements)
    return Direct(fn, a, b, dst)


def bind_silu(node, dst, srcs):
    """SILU of float32 rows into float32 rows of the same shape (act.silu_rows), without numpy_ops' copies (Mamba-2
    and LFM2 run one per layer on the convolution's output)."""
    if node.type != T.F32 or node.src[0].type != T.F32 or srcs[0].shape != dst.shape:
        return None
    x, d = _rows2d(srcs[0]), _rows2d(dst)
    if x is None or d is None:
        return None
    from . import act
    fn = act.silu_rows_par if x.shape[0] > 1 and node.nelements >= PAR_MIN_ELEMENTS else act.silu_rows
    return Direct(fn, x, d)


def bind_gelu(node, dst, srcs):
    """GELU of float32 rows into float32 rows of the same shape (act.gelu_rows_par); else numpy_ops' gelu."""
    if node.type != T.F32 or node.src[0].type != T.F32 or srcs[0].shape != dst.shape:
        return None
    x, d = _rows2d(srcs[0]), _rows2d(dst)
    if x is None or d is None:
        return None
    from .act import gelu_rows_par, gelu_table
    table = gelu_table()
    return Direct(gelu_rows_par, x, table, d)


def bind_rms_norm_mul(node, dst, srcs):
    if not (node.type == node.src[0].type == node.src[1].type == T.F32):
        return None
    w = node.src[1]
    x, d = _rows2d(srcs[0]), _rows2d(dst)
    if x is None or d is None or w.ne[0] != node.ne[0] or w.nelements != w.ne[0]:
        return None          # only a weight row broadcast over every row here; the rest in numpy_ops.py
    wr = _rows2d(srcs[1])
    if wr is None:
        return None
    add = np.zeros((1, 0), np.float32)
    if len(srcs) > 2:       # the residual add fused in
        add = _rows2d(srcs[2]) if node.src[2].type == T.F32 else None
        if add is None or add.shape != x.shape:
            return None
    from . import norm
    fn = norm.rms_norm_mul_rows_par if node.nelements >= PAR_MIN_ELEMENTS else norm.rms_norm_mul_rows
    eps = np.float32(node.op_params["eps"])
    return Direct(fn, x, wr, eps, d, add)


def bind_rope(node, dst, srcs):
    if node.type != T.F32 or node.src[0].type != T.F32 or dst.strides[-1] != 4 or not dst.flags.c_contiguous:
        return None
    from . import rope
    p = node.op_params
    ff = srcs[2].reshape(-1) if p.get("has_freq_factors") else None
    return rope.bind(srcs[0], srcs[1].reshape(-1), p, ff, dst,
                     inputs=_fixed(node.src[1], weight=node.src[2] if ff is not None else None))


def bind_add_rms_norm_mul(add, norm, views):
    """A residual ADD and the RMS_NORM_MUL that reads it next, as one call (``norm.add_rms_norm_mul_rows``) where
    both would run on one thread (a decoded token's rows): a pre-norm model's layers join this way twice each.
    ``views``: [add's sources], add, [norm's sources], norm (NumPy views); None where it does not apply."""
    if not (add.op is Op.ADD and norm.op is Op.RMS_NORM_MUL and len(norm.src) == 2 and norm.src[0] is add):
        return None
    if not (add.type == add.src[0].type == add.src[1].type == norm.type == norm.src[1].type == T.F32):
        return None
    w = norm.src[1]
    if add.src[0].ne != add.ne or add.src[1].ne != add.ne or add.nelements >= PAR_MIN_ELEMENTS or \
            w.ne[0] != norm.ne[0] or w.nelements != w.ne[0]:
        return None
    (a, b), s, (_, wr), out = views
    a, b, s, wr, out = (_rows2d(v) for v in (a, b, s, wr, out))
    if a is None or b is None or s is None or wr is None or out is None:
        return None
    from .norm import add_rms_norm_mul_rows
    eps = np.float32(norm.op_params["eps"])
    return Direct(add_rms_norm_mul_rows, a, b, s, wr, eps, out)


def bind_rope_set_rows(rope_node, store, views):
    """A ROPE whose result the next node stores into an F16 cache (a decoded token's K: SET_ROWS of a view of the
    rotation) as one call (``rope.rope_store_f16``); the rotation is still written. ``views``: [the rope's
    sources], the rope, [the store's sources], the store (NumPy views); None where it does not apply."""
    if not (rope_node.op is Op.ROPE and store.op is Op.SET_ROWS and store.type == T.F16):
        return None
    s0 = store.src[0]
    if not (s0 is rope_node or (s0.view_src is rope_node and s0.type == T.F32)) or store.src[1].type not in \
            (T.I32, T.I64) or s0.nelements // s0.ne[0] > 1 and s0.nelements >= PAR_MIN_ELEMENTS:
        return None
    if rope_node.type != T.F32 or rope_node.src[0].type != T.F32 or rope_node.op_params.get("sections"):
        return None
    (x, pos, *ff), dst, (src, idx), cache = views
    if dst.strides[-1] != 4 or not dst.flags.c_contiguous or src.strides[-1] != 4 or not _apart(src, cache):
        return None
    from . import rope
    p = rope_node.op_params
    fa = ff[0].reshape(-1) if p.get("has_freq_factors") else None
    return rope.bind(x, pos.reshape(-1), p, fa, dst,
                     store=(src.view(np.uint32), idx[0], store.ne[1], cache.view(np.uint16)),
                     inputs=_fixed(rope_node.src[1], store.src[1],
                                   weight=rope_node.src[2] if fa is not None else None))


PAIR_BINDERS = {(Op.ADD, Op.RMS_NORM_MUL): bind_add_rms_norm_mul, (Op.ROPE, Op.SET_ROWS): bind_rope_set_rows}

BINDERS = {Op.SCALE: bind_scale, Op.SOFT_MAX: bind_soft_max, Op.GET_ROWS: bind_get_rows, Op.SET_ROWS: bind_set_rows,
           Op.SWIGLU: bind_glu, Op.GEGLU: bind_glu, Op.RMS_NORM_MUL: bind_rms_norm_mul, Op.ROPE: bind_rope,
           Op.GELU: bind_gelu, Op.SILU: bind_silu, Op.CONT: bind_cont, Op.CPY: bind_cont, Op.DUP: bind_cont,
           Op.CONCAT: bind_concat, **{op: bind_binary for op in _BIN}}
