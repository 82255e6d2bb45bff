"""The 32-value ``quantize_row_<type>_ref`` quantizers as Numba loops that release the GIL, for quantizing whole
models (``llama.quant`` runs them over chunks of rows in several threads). Same bytes as ``quants.quantize``, whose
vectorised NumPy versions stay the readable reference; the block scale d is rounded to fp16 by NumPy."""
from __future__ import annotations

import numpy as np
from numba import njit

from .quants_base import F32
from .types import GGMLType

T = GGMLType


@njit(cache=True, nogil=True, inline="always")
def _roundf(v):
    """C roundf: halves away from zero, exactly."""
    a = abs(v)
    fl = np.floor(a)
    r = fl + (F32(1.0) if a - fl >= F32(0.5) else F32(0.0))
    return -r if v < 0 else r


@njit(cache=True, nogil=True)
def _q8_0(b, d, q):
    for i in range(b.shape[0]):
        amax = F32(0.0)
        for j in range(32):
            amax = max(amax, abs(b[i, j]))
        di = amax / F32(127.0)
        inv = F32(1.0) / di if di != 0 else F32(0.0)
        d[i] = di
        for j in range(32):
            q[i, j] = np.int8(_roundf(b[i, j] * inv))


@njit(cache=True, nogil=True)
def _qx_0(b, d, L, nlev):
    """Q4_0 (nlev 8) / Q5_0 (nlev 16): d = max / -nlev, L = min(2*nlev - 1, (int8)(x * id + nlev + 0.5))."""
    off = F32(nlev) + F32(0.5)
    for i in range(b.shape[0]):
        amax = F32(0.0)
        mx = F32(0.0)
        for j in range(32):
            v = b[i, j]
            if amax < abs(v):
                amax = abs(v)
                mx = v
        di = mx / F32(-nlev)
        inv = F32(1.0) / di if di != 0 else F32(0.0)
        d[i] = di
        for j in range(32):
            L[i, j] = min(2 * nlev - 1, int(b[i, j] * inv + off))


@njit(cache=True, nogil=True)
def _qx_1(b, d, m, L, nmax, clamp):
    """Q4_1 (nmax 15) / Q5_1 (nmax 31, no clamp in ggml): d = (max - min) / nmax, L = (x - min) * id + 0.5."""
    for i in range(b.shape[0]):
        mn = b[i, 0]
        mx = b[i, 0]
        for j in range(1, 32):
            mn = min(mn, b[i, j])
            mx = max(mx, b[i, j])
        di = (mx - mn) / F32(nmax)
        inv = F32(1.0) / di if di != 0 else F32(0.0)
        d[i] = di
        m[i] = mn
        for j in range(32):
            v = int((b[i, j] - mn) * inv + F32(0.5))
            L[i, j] = min(nmax, v) if clamp else v & 0xFF


def _f16(v):
    return v.astype("<f2").view(np.uint8).reshape(-1, 2)


def _q5_bits(L):
    qs = (L[:, :16] & 0xF) | ((L[:, 16:] & 0xF) << 4)
    qh = np.packbits((L >> 4) & 1, axis=1, bitorder="little")
    return qh, qs


def quantize_rows_ref(x: np.ndarray, t: GGMLType) -> np.ndarray | None:
    """float32 [nrows, k] -> uint8 [nrows, row bytes] for Q8_0, Q4_0, Q5_0, Q4_1, Q5_1; None for other types."""
    t = GGMLType(t)
    if t not in (T.Q8_0, T.Q4_0, T.Q5_0, T.Q4_1, T.Q5_1):
        return None
    x = np.ascontiguousarray(x, F32)
    nrows = x.shape[0]
    b = x.reshape(-1, 32)
    n = len(b)
    d = np.empty(n, F32)
    if t == T.Q8_0:
        q = np.empty((n, 32), np.int8)
        _q8_0(b, d, q)
        parts = [_f16(d), q.view(np.uint8)]
    elif t in (T.Q4_0, T.Q5_0):
        L = np.empty((n, 32), np.uint8)
        _qx_0(b, d, L, 8 if t == T.Q4_0 else 16)
        if t == T.Q4_0:
            parts = [_f16(d), L[:, :16] | (L[:, 16:] << 4)]
        else:
            qh, qs = _q5_bits(L)
            parts = [_f16(d), qh, qs]
    else:
        m = np.empty(n, F32)
        L = np.empty((n, 32), np.uint8)
        _qx_1(b, d, m, L, 15 if t == T.Q4_1 else 31, t == T.Q4_1)
        if t == T.Q4_1:
            parts = [_f16(d), _f16(m), L[:, :16] | (L[:, 16:] << 4)]
        else:
            qh, qs = _q5_bits(L)
            parts = [_f16(d), _f16(m), qh, qs]
    return np.concatenate(parts, axis=1).reshape(nrows, -1)
