"""Binders for the hot ops the cpu backend runs in Numba (element-wise with broadcast, softmax, rows): each takes
(node, dst, srcs) once, at plan time, checks the types and layouts, and returns the call to make on every run, or
None when the NumPy kernel (kernels.py) must handle the case."""
from __future__ import annotations

import numpy as np

from ...tensor import Op
from ...types import GGMLType, TYPE_TRAITS
from . import elementwise, rows
from .kernels import alibi_slopes
from .qdot import F16_TABLE
from . import softmax

T = GGMLType
_BIN = {Op.ADD: elementwise.OP_ADD, Op.SUB: elementwise.OP_SUB, Op.MUL: elementwise.OP_MUL, Op.DIV: elementwise.OP_DIV}
_NO_MASK = np.zeros((1, 1, 1, 0), np.float32)
PAR_MIN_ELEMENTS = 1 << 16   # below this, one thread: a parallel region costs more than the work


def _pick(module, name, n_elements):
    return getattr(module, name + "_par" if n_elements >= PAR_MIN_ELEMENTS else name)


def bind_binary(node, dst, srcs):
    if not (node.src[0].type == node.src[1].type == node.type == T.F32):
        return None
    a, b = srcs
    code = _BIN[node.op]
    fn = _pick(elementwise, "binary_f32", node.nelements)
    return lambda: fn(a, b, dst, code)


def bind_soft_max(node, dst, srcs):
    if node.src[0].type != T.F32:
        return None
    p = node.op_params
    x = srcs[0]
    slopes = alibi_slopes(node.ne[2], p["max_bias"], np.float32)
    scale = np.float32(p["scale"])
    soft_max_rows = _pick(softmax, "soft_max_rows", node.nelements)
    if not p["has_mask"]:
        return lambda: soft_max_rows(x, _NO_MASK, slopes, scale, dst)
    m, mtype = srcs[1], node.src[1].type
    if mtype == T.F32:
        return lambda: soft_max_rows(x, m, slopes, scale, dst)
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

        def run_q():   # block types: dequantize only the selected rows
            rows.check_index(idx, n_rows, "get_rows")
            sel = a[np.arange(idx.shape[0])[:, None, None], np.arange(idx.shape[1])[None, :, None], idx]
            dst[...] = dequantize(sel, t).reshape(dst.shape)
        return run_q

    def run():
        rows.check_index(idx, n_rows, "get_rows")
        kernel()
    return run


def bind_set_rows(node, dst, srcs):
    src, idx = srcs[0], srcs[1][0]
    t = node.type
    if node.src[0].type != T.F32 or t not in (T.F16, T.F32):
        return None
    n_rows = node.ne[1]
    if t == T.F16:
        fn, d, src = _pick(rows, "set_rows_f16", src.size), dst.view(np.uint16), src.view(np.uint32)
    else:
        fn, d = _pick(rows, "set_rows_same", src.size), dst

    def run():
        rows.check_index(idx, n_rows, "set_rows")
        fn(src, idx, d)
    return run


BINDERS = {Op.SOFT_MAX: bind_soft_max, Op.GET_ROWS: bind_get_rows, Op.SET_ROWS: bind_set_rows,
           **{op: bind_binary for op in _BIN}}
