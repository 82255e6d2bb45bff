"""Image ops of the vision encoders: im2col (the patch convolution's gather), 2-D pooling and GELU_QUICK.

NumPy over the plan's views, ``kernel(node, dst, srcs, acc)`` like numpy_ops. Each runs once per image on a few
megabytes, so data movement in NumPy is enough; the sums are in ggml's order (pooling: row by row of the window,
in float32) so that the results are ggml's bits.
"""
from __future__ import annotations

import numpy as np

from .numpy_ops import store, to_float


def k_im2col(node, dst, srcs, acc):
    """dst (N, OH, OW, IC*KH*KW): the input patch under the kernel at each output, zeros in the padding."""
    p = node.op_params
    kw_, kh_ = node.src[0].ne[0], node.src[0].ne[1]
    x = to_float(srcs[1], node.src[1].type, np.float32)            # (N, IC, IH, IW)
    n, ic, ih, iw = x.shape
    ow, oh = node.ne[1], node.ne[2]
    s0, s1, p0, p1, d0, d1 = p["s0"], p["s1"], p["p0"], p["p1"], p["d0"], p["d1"]
    if p0 == p1 == 0 and d0 == d1 == 1 and s0 == kw_ and s1 == kh_:
        # non-overlapping patches (a ViT's patch embedding): one reshape and transpose of the cropped image
        xc = x[:, :, :oh * kh_, :ow * kw_].reshape(n, ic, oh, kh_, ow, kw_)
        out = xc.transpose(0, 2, 4, 1, 3, 5)
    else:
        xp = np.zeros((n, ic, ih + 2 * p1, iw + 2 * p0), np.float32)
        xp[:, :, p1:p1 + ih, p0:p0 + iw] = x
        out = np.empty((n, oh, ow, ic, kh_, kw_), np.float32)
        for ky in range(kh_):
            for kx in range(kw_):
                y0, x0 = ky * d1, kx * d0
                win = xp[:, :, y0:y0 + (oh - 1) * s1 + 1:s1, x0:x0 + (ow - 1) * s0 + 1:s0]   # (N, IC, OH, OW)
                out[:, :, :, :, ky, kx] = win.transpose(0, 2, 3, 1)
    store(dst, node.type, np.ascontiguousarray(out).reshape(dst.shape))


def k_pool_2d(node, dst, srcs, acc):
    """ggml_compute_forward_pool_2d: per output a float32 running sum (or max) over the window's rows, then its
    columns, the values outside the input skipped; AVG divides by k0 * k1."""
    p = node.op_params
    x = to_float(srcs[0], node.src[0].type, np.float32)            # (N, C, IH, IW)
    ih, iw = x.shape[2], x.shape[3]
    oh, ow = dst.shape[2], dst.shape[3]
    avg = p["op"] == 1
    res = np.full(x.shape[:2] + (oh, ow), 0.0 if avg else -np.finfo(np.float32).max, np.float32)
    s0, s1 = p["s0"], p["s1"]
    for ky in range(p["k1"]):
        iy = np.arange(oh) * s1 - p["p1"] + ky
        ys = np.flatnonzero((iy >= 0) & (iy < ih))          # a contiguous run of outputs
        for kx in range(p["k0"]):
            ix = np.arange(ow) * s0 - p["p0"] + kx
            xs = np.flatnonzero((ix >= 0) & (ix < iw))
            if not len(ys) or not len(xs):
                continue
            sub = x[:, :, iy[ys[0]]:iy[ys[-1]] + 1:s1, ix[xs[0]]:ix[xs[-1]] + 1:s0]
            cur = res[:, :, ys[0]:ys[-1] + 1, xs[0]:xs[-1] + 1]
            if avg:
                cur += sub
            else:
                np.maximum(sub, cur, out=cur)
    if avg:
        res = res / np.float32(p["k0"] * p["k1"])
    store(dst, node.type, res)


_GELU_QUICK = None


def gelu_quick_table() -> np.ndarray:
    """ggml_table_gelu_quick_f16: x * (1 / (1 + expf(-1.702 x))) in float32 at every F16 value, rounded to F16."""
    global _GELU_QUICK
    if _GELU_QUICK is None:
        h = np.arange(65536, dtype=np.uint32).astype(np.uint16).view(np.float16).astype(np.float32)
        with np.errstate(over="ignore", invalid="ignore"):
            e = np.exp((np.float32(-1.702) * h).astype(np.float64)).astype(np.float32)
            _GELU_QUICK = (h * (np.float32(1.0) / (np.float32(1.0) + e))).astype(np.float16).astype(np.float32)
    return _GELU_QUICK


def k_gelu_quick(node, dst, srcs, acc):
    x = to_float(srcs[0], node.src[0].type, np.float32)
    with np.errstate(over="ignore", invalid="ignore"):
        store(dst, node.type, gelu_quick_table()[x.astype(np.float16).view(np.uint16)])
