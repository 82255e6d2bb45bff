"""The 32-value ``quantize_row_<type>_ref`` quantizers as Numba loops that release the GIL, for quantizing whole
models (``llama.quant`` runs them over chunks of rows in several threads). Same bytes as ``quants.quantize``, whose
vectorised NumPy versions stay the readable reference; each kernel writes the block bytes, fp16 fields included."""
from __future__ import annotations

import numpy as np

from .quants_base import F32, njit, _bits_f32, _f32_bits
from .quants_k import _put_f16
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
def _q8_0(b, o, lv):
    """block_q8_0 {d, qs[32]}"""
    for i in range(b.shape[0]):
        amax = F32(0.0)
        for j in range(32):
            amax = max(amax, abs(b[i, j]))
        di = amax / F32(127.0)
        inv = F32(1.0) / di if di != 0 else F32(0.0)
        _put_f16(o[i], 0, di)
        for j in range(32):
            o[i, 2 + j] = np.int8(_roundf(b[i, j] * inv)) & 0xFF


@njit(cache=True, nogil=True)
def _qx_0(b, o, lv, nlev):
    """Q4_0 (nlev 8: {d, qs[16]}) / Q5_0 (nlev 16: {d, qh[4], qs[16]}): d = max / -nlev,
    L = min(2*nlev - 1, (int8)(x * id + nlev + 0.5)); qs[j] = L[j] low nibble | L[j+16] low nibble << 4. The
    signed maximum by selects, the levels into an int32 row, then the nibbles and high bits.

    The level and nibble loops run to the block's width read from ``b`` (32), not to a constant: LLVM unrolls a
    constant 32-trip loop whole before its loop vectorizer runs, and Numba leaves the SLP vectorizer off, so the
    unrolled code stayed scalar (Q4_0: 10.3 -> 7.1 ms for 8 M values, AVX2). ``lv``: int32 scratch of the block's
    width, given by the caller (as for every kernel here: a kernel that allocates loads with Numba's array module,
    ~0.04 s of CPU at the first load)."""
    off = F32(nlev) + F32(0.5)
    q = 2 if nlev == 8 else 6
    top = np.int32(2 * nlev - 1)
    n = b.shape[1]
    h = n // 2
    for i in range(b.shape[0]):
        amax = F32(0.0)
        mx = F32(0.0)
        for j in range(32):
            v = b[i, j]
            a = abs(v)
            gt = amax < a
            amax = a if gt else amax
            mx = v if gt else mx
        di = mx / F32(-nlev)
        inv = F32(1.0) / di if di != 0 else F32(0.0)
        _put_f16(o[i], 0, di)
        for j in range(n):
            lv[j] = min(top, np.int32(b[i, j] * inv + off))
        for j in range(h):
            o[i, q + j] = np.uint8((lv[j] & 0xF) | ((lv[h + j] & 0xF) << 4))
        if nlev == 16:
            _put_qh(lv, o[i], 2)


@njit(cache=True, nogil=True)
def _qx_1(b, o, lv, nmax):
    """Q4_1 (nmax 15: {d, m, qs[16]}) / Q5_1 (nmax 31, no clamp in ggml: {d, m, qh[4], qs[16]}):
    d = (max - min) / nmax, L = (x - min) * id + 0.5 (loops to the block's width as in _qx_0)."""
    q = 4 if nmax == 15 else 8
    n = b.shape[1]
    h = n // 2
    for i in range(b.shape[0]):
        mn = b[i, 0]
        mx = b[i, 0]
        for j in range(1, 32):
            mn = min(mn, b[i, j])
            mx = max(mx, b[i, j])
        di = (mx - mn) / F32(nmax)
        inv = F32(1.0) / di if di != 0 else F32(0.0)
        _put_f16(o[i], 0, di)
        _put_f16(o[i], 2, mn)
        for j in range(n):
            l = np.int32((b[i, j] - mn) * inv + F32(0.5))
            lv[j] = min(np.int32(15), l) if nmax == 15 else l
        for j in range(h):
            o[i, q + j] = np.uint8((lv[j] & 0xF) | ((lv[h + j] & 0xF) << 4))
        if nmax == 31:
            _put_qh(lv, o[i], 4)


@njit(cache=True, nogil=True, inline="always")
def _put_qh(lv, o, at):
    """qh[4] at o[at]: bit j = bit 4 of level j (j to lv's width, 32: a loop LLVM vectorizes, as in _qx_0)"""
    qh = np.uint32(0)
    for j in range(lv.shape[0]):
        qh |= np.uint32((lv[j] >> 4) & 1) << np.uint32(j)
    for k in range(4):
        o[at + k] = (qh >> np.uint32(8 * k)) & np.uint32(0xFF)


@njit(cache=True, nogil=True)
def _q2_0(b, o, lv):
    """quantize_row_q2_0_ref, blocks of 64 {d, qs[16]}: d = amax, q = clamp(roundf(x / d) + 1, 0, 3) (x * (d ? 1/d
    : 0), as quants.quantize_q2_0), four consecutive values a byte from the low bits."""
    for i in range(b.shape[0]):
        amax = F32(0.0)
        for j in range(64):
            a = abs(b[i, j])
            amax = a if amax < a else amax
        inv = F32(1.0) / amax if amax != 0 else F32(0.0)
        _put_f16(o[i], 0, amax)
        for j in range(64):
            r = _roundf(b[i, j] * inv) + F32(1.0)
            lv[j] = np.int32(min(max(r, F32(0.0)), F32(3.0)))
        for j in range(16):
            o[i, 2 + j] = np.uint8(lv[4 * j] | (lv[4 * j + 1] << 2) | (lv[4 * j + 2] << 4) | (lv[4 * j + 3] << 6))


@njit(cache=True, nogil=True)
def _q1_0(b, o, lv):
    """quantize_row_q1_0_ref, blocks of 128 {d, qs[16]}: d = mean |x| (summed in order, as the C loop), bit j of the
    block (byte j / 8, from the low bit) set for x >= 0."""
    for i in range(b.shape[0]):
        s = F32(0.0)
        for j in range(128):
            s += abs(b[i, j])
        _put_f16(o[i], 0, s / F32(128.0))
        for j in range(16):
            v = np.uint8(0)
            for l in range(8):
                v |= np.uint8(b[i, 8 * j + l] >= 0) << np.uint8(l)
            o[i, 2 + j] = v


@njit(cache=True, nogil=True, inline="always")
def _ternary_levels(x, lv):
    """The ternary types' levels of one block of 256: lv = (lroundf(x / d) + 1) & 3 (x * (d ? 1/d : 0), 0..2 for
    finite x) with d = amax, returned."""
    amax = F32(0.0)
    for j in range(256):
        a = abs(x[j])
        amax = a if amax < a else amax
    inv = F32(1.0) / amax if amax != 0 else F32(0.0)
    for j in range(256):
        lv[j] = (np.int32(_roundf(x[j] * inv)) + 1) & 3
    return amax


@njit(cache=True, nogil=True)
def _tq2_0(b, o, lv):
    """quantize_row_tq2_0_ref, blocks of 256 {qs[64], d}: d = amax, q = (lroundf(x / d) + 1) & 3 (x * (d ? 1/d : 0)),
    qs[32 h + l] = q[128 h + 32 k + l] << 2 k for k 0..3."""
    for i in range(b.shape[0]):
        amax = _ternary_levels(b[i], lv)
        for h in range(2):
            for l in range(32):
                j = 128 * h + l
                o[i, 32 * h + l] = np.uint8(lv[j] | (lv[j + 32] << 2) | (lv[j + 64] << 4) | (lv[j + 96] << 6))
        _put_f16(o[i], 64, amax)


@njit(cache=True, nogil=True, inline="always")
def _trits(lv, at, step, npow, m):
    """5 (or fewer, then zero) trits lv[at + step k + m] into one byte: q = q 3 + t (mod 256), ceil(q 256 / 243)"""
    q = np.int32(0)
    for k in range(5):
        t = lv[at + step * k + m] if k < npow else np.int32(0)
        q = (q * 3 + t) & 0xFF
    return np.uint8((q * 256 + 242) // 243)


@njit(cache=True, nogil=True)
def _tq1_0(b, o, lv):
    """quantize_row_tq1_0_ref, blocks of 256 {qs[48], qh[4], d}: trits lroundf(x / d) + 1 (x * (d ? 1/d : 0), d =
    amax), five a byte over values m, m + 32, ... (qs[0:32]; then m, m + 16, ... from 160 for qs[32:48]), four a
    byte (and a zero trit) from 240 for qh."""
    for i in range(b.shape[0]):
        amax = _ternary_levels(b[i], lv)
        for m in range(32):
            o[i, m] = _trits(lv, 0, 32, 5, m)
        for m in range(16):
            o[i, 32 + m] = _trits(lv, 160, 16, 5, m)
        for m in range(4):
            o[i, 48 + m] = _trits(lv, 240, 4, 4, m)
        _put_f16(o[i], 52, amax)


# type -> (kernel, values a block, bytes a block, its further arguments); each kernel takes (blocks, out, int32 scratch
# of a block's width (unused by Q8_0 and Q1_0), ...): the kernels allocate nothing
_KERNELS = {T.Q8_0: (_q8_0, 32, 34, ()), T.Q4_0: (_qx_0, 32, 18, (8,)), T.Q5_0: (_qx_0, 32, 22, (16,)),
            T.Q4_1: (_qx_1, 32, 20, (15,)), T.Q5_1: (_qx_1, 32, 24, (31,)),
            T.Q1_0: (_q1_0, 128, 18, ()), T.Q2_0: (_q2_0, 64, 18, ()),
            T.TQ1_0: (_tq1_0, 256, 54, ()), T.TQ2_0: (_tq2_0, 256, 66, ())}


def quantize_rows_ref(x: np.ndarray, t: GGMLType, out: np.ndarray | None = None) -> np.ndarray | None:
    """float32 [nrows, k] -> uint8 [nrows, row bytes] for Q8_0, Q4_0, Q5_0, Q4_1, Q5_1, Q1_0, Q2_0, TQ1_0 and
    TQ2_0 (into ``out``, C-contiguous, when given); None for other types."""
    k = _KERNELS.get(t)                 # (a GGMLType or its number: an IntEnum hashes as its value)
    if k is None:
        return None
    kernel, blck, size, args = k
    x = np.ascontiguousarray(x, F32)
    b = x.reshape(-1, blck)
    if out is None:
        out = np.empty((x.shape[0], b.shape[0] // x.shape[0] * size), np.uint8)
    kernel(b, out.reshape(len(b), size), np.empty(blck, np.int32), *args)
    return out


@njit(cache=True, nogil=True)
def f16_to_f32(h, out):
    """fp16 bit patterns (uint16) -> float32 into ``out``, exact (GGML_FP16_TO_FP32; NumPy's float16 cast, NaN
    payloads included): the exponent and mantissa moved to a float's places and scaled by 2^112 (which normalizes
    subnormals too), infinities and NaNs given the top exponent, then the sign. Lanes LLVM vectorizes: ~0.2 ns a
    value, half the time of a 65536-entry table's lookups."""
    for i in range(h.shape[0]):
        x = np.uint32(h[i])
        v = _bits_f32((x & np.uint32(0x7FFF)) << np.uint32(13)) * F32(5.192296858534828e+33)
        u = _f32_bits(v)
        u = u | np.uint32(0x7F800000) if v >= F32(65536.0) else u
        out[i] = _bits_f32(u | ((x & np.uint32(0x8000)) << np.uint32(16)))
