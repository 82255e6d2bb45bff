"""Matrix products on the CPU with llama.cpp's numerics: the activations are rounded to the weight type's
``vec_dot_type`` (Q8_0, Q8_1, Q8_K, F16) before the dot products, as ggml's CPU backend does.

Two paths give the same numbers (up to float32 summation order):
- decode (few rows of x): integer dot products straight on the GGUF blocks, in Numba (``qdot``);
- prompt batches: x rounded through its dot type and back to float32, weight tiles dequantized to float32, and a
  BLAS matrix product per tile.
"""
from __future__ import annotations

import numpy as np

from ...quants import dequantize, quantize_act as quantize
from ...types import GGMLType, TYPE_TRAITS

T = GGMLType
TILE_BYTES = 4 << 20   # dequantized weight tile size for the BLAS path

# Products of up to this many activation rows run on the integer kernels, which reproduce llama.cpp's arithmetic
# bit for bit (SmolLM2's massive activations make its output sensitive to the last bit of every product, so
# the exact path is the default at every batch size). LLAMPY_FAST_PROMPT=1 sends larger batches to BLAS.
import os as _os

DECODE_MAX_ROWS = 8 if _os.environ.get("LLAMPY_FAST_PROMPT") == "1" else 1 << 30


def round_act(x: np.ndarray, vdt: GGMLType) -> np.ndarray:
    """x (float32 [n, k]) rounded through the dot type: what the integer kernels effectively multiply by."""
    if vdt == T.F32:
        return x
    if vdt == T.F16:
        return x.astype(np.float16).astype(np.float32)
    if vdt == T.BF16:
        return dequantize(quantize(x, T.BF16), T.BF16)
    return dequantize(quantize(np.ascontiguousarray(x), vdt), vdt)


def _weights_f32(w: np.ndarray, wtype: GGMLType, r0: int, r1: int) -> np.ndarray:
    if wtype == T.F32:
        return w[r0:r1]
    if wtype == T.F16:
        return w[r0:r1].astype(np.float32)
    return dequantize(w[r0:r1], wtype)


def mul_mat(w: np.ndarray, wtype: GGMLType, x: np.ndarray, out: np.ndarray, exact_max_rows: int | None = None) -> None:
    """out[n, rows] = x[n, k] · w[rows, k]^T with llama.cpp's CPU numerics (see module doc). Batches of more than
    ``exact_max_rows`` rows take the BLAS path (same numbers up to float32 summation order)."""
    wtype = GGMLType(wtype)
    vdt = TYPE_TRAITS[wtype].vec_dot_type
    n = x.shape[0]
    rows = w.shape[0]
    if n <= (DECODE_MAX_ROWS if exact_max_rows is None else exact_max_rows):
        from . import qdot
        if qdot.supports(wtype):
            qdot.mul_mat(w, wtype, x, out)
            return
    x = np.ascontiguousarray(x, dtype=np.float32)
    k = x.shape[1]
    delta = None
    if vdt == T.Q8_1:
        # ggml adds each block's min times Q8_1's s = fp16(d * sum(q)); the float product below uses the exact
        # block sums instead, so add back the difference: sum over blocks of min * (s - sum(x_rounded))
        q = quantize(x, T.Q8_1).reshape(n, k // 32, 36)
        xr = (np.ascontiguousarray(q[:, :, 4:]).view(np.int8).astype(np.float32)
              * np.ascontiguousarray(q[:, :, 0:2]).view(np.float16).astype(np.float32)).reshape(n, k)
        s = np.ascontiguousarray(q[:, :, 2:4]).view(np.float16).astype(np.float32).reshape(n, -1)
        delta = s - xr.reshape(n, k // 32, 32).sum(axis=2)
    else:
        xr = round_act(x, vdt)
    step = max(16, TILE_BYTES // (4 * k))
    for r0 in range(0, rows, step):
        r1 = min(rows, r0 + step)
        wt = _weights_f32(w, wtype, r0, r1)
        res = xr @ wt.T
        if delta is not None:
            blk = w[r0:r1].reshape(r1 - r0, k // 32, TYPE_TRAITS[wtype].type_size)
            mins = np.ascontiguousarray(blk[:, :, 2:4]).view(np.float16).astype(np.float32).reshape(r1 - r0, -1)
            res += delta @ mins.T
        out[:, r0:r1] = res
