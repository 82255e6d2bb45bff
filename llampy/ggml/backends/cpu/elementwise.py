"""ADD, SUB, MUL, DIV of float32 tensors with ggml's broadcast (b repeated over a's shape, each dim of b dividing
a's), straight over the strided views: no tiled copy of b, no temporary. float32 arithmetic is exact per element,
so the result is ggml's bit for bit.
Kernels come in two builds: ``name`` (one thread: small tensors, where starting the thread team costs more
than the work) and ``name_par`` (prange over rows); the binders pick one by size.
"""
from __future__ import annotations

import numpy as np
from numba import njit, prange

from .builds import parallel_build

OP_ADD, OP_SUB, OP_MUL, OP_DIV = 0, 1, 2, 3


def _binary_f32(a, b, out, op):
    """a, out: float32 (ne3, ne2, ne1, ne0); b: float32 (b3, b2, b1, b0) with a.shape[i] % b.shape[i] == 0."""
    ne3, ne2, ne1, ne0 = a.shape
    b3, b2, b1, b0 = b.shape
    for r in prange(ne3 * ne2 * ne1):
        i3 = r // (ne2 * ne1)
        i2 = (r // ne1) % ne2
        i1 = r % ne1
        ar = a[i3, i2, i1]
        br = b[i3 % b3, i2 % b2, i1 % b1]
        o = out[i3, i2, i1]
        if b0 == ne0:
            if op == OP_ADD:
                for i in range(ne0):
                    o[i] = ar[i] + br[i]
            elif op == OP_MUL:
                for i in range(ne0):
                    o[i] = ar[i] * br[i]
            elif op == OP_SUB:
                for i in range(ne0):
                    o[i] = ar[i] - br[i]
            else:
                for i in range(ne0):
                    o[i] = ar[i] / br[i]
        elif b0 == 1:          # one value per row (Mamba-2's D, a scale per head): hoisted, so that the loop vectorises
            bv = br[0]
            if op == OP_ADD:
                for i in range(ne0):
                    o[i] = ar[i] + bv
            elif op == OP_MUL:
                for i in range(ne0):
                    o[i] = ar[i] * bv
            elif op == OP_SUB:
                for i in range(ne0):
                    o[i] = ar[i] - bv
            else:
                for i in range(ne0):
                    o[i] = ar[i] / bv
        else:
            for i in range(ne0):
                bv = br[i % b0]
                if op == OP_ADD:
                    o[i] = ar[i] + bv
                elif op == OP_MUL:
                    o[i] = ar[i] * bv
                elif op == OP_SUB:
                    o[i] = ar[i] - bv
                else:
                    o[i] = ar[i] / bv


binary_f32_par = parallel_build(_binary_f32)
binary_f32 = njit(cache=True)(_binary_f32)


@njit(cache=True)
def scale_f32(x, s, out):
    """out = x * s (float32, one dimension): SCALE without a bias, one rounding per value as ggml_vec_scale_f32."""
    for i in range(x.shape[0]):
        out[i] = x[i] * s
