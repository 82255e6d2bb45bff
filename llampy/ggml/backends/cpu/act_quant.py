"""Activation quantization in Numba: x (float32 [n, k]) rounded to a weight's ``vec_dot_type`` before the integer
dot products, exactly as llama.cpp's x86 CPU backend does it.

- Q8_0 / Q8_1: ggml-cpu/arch/x86/quants.c ``quantize_row_q8_0/q8_1`` (AVX2 form): per block of 32,
  ``d = amax / 127``, ``id = 127 / amax`` (0 when amax is 0), ``q = round_half_even(x * id)``; d stored as F16;
  Q8_1's ``s = F16(d * sum(q))``. (ggml's *reference* rounds half away from zero and multiplies by ``id``
  the same way; the two differ only when ``x * id`` is exactly a half-integer.)
- Q8_K: ggml-quants.c ``quantize_row_q8_K_ref`` (x86 calls the reference): per block of 256, the element of largest
  magnitude ``max``, ``iscale = -127 / max``, ``q = min(127, nearest_int(iscale * x))``, ``d = 1 / iscale`` kept
  as float32, ``bsums`` = sums of each 16 quants.

The kernels take the split form (``xq`` int8 [n, k], ``xd`` float32 [n, k/blck], ``xs`` float32 [n, k/32] or
``bsums`` int16 [n, k/16]) so they never decode F16 scales again; ``quantize_act`` packs the split form into
ggml's block bytes.
"""
from __future__ import annotations

import numpy as np
from numba import njit, prange

from .simd import v16_abs, v16_find_abs, v16_hmax, v16_load, v16_max, v16_q8, v16_round_f16, v16_store

from ...types import GGMLType, QK_K, TYPE_TRAITS

T = GGMLType


@njit(cache=True, inline="always")
def round_f16(x):
    """float32 -> the nearest F16 value (round half to even, F16 subnormals, overflow to inf), as float32."""
    ax = abs(x)
    if ax < np.float32(6.103515625e-05):          # F16 subnormal range: multiples of 2^-24
        return np.float32(np.rint(np.float64(x) * 16777216.0) / 16777216.0)
    if ax >= np.float32(65520.0):
        return np.float32(np.inf) if x > 0 else np.float32(-np.inf)
    # Veltkamp split: keeps the top 11 significand bits of x, rounded to nearest even
    t = np.float32(x * np.float32(8193.0))
    return np.float32(t - np.float32(t - x))


@njit(cache=True, inline="always")
def _q8_0_row(x, xq, xd, xs, with_s, vec, i):
    """Row i of ``q8_0_split``."""
    k = x.shape[1]
    xr, qr = x[i], xq[i]
    for b in range(k // 32):
        o = b * 32
        if vec:
            v0, v1 = v16_load(xr, o), v16_load(xr, o + 16)
            amax = v16_hmax(v16_max(v16_abs(v0), v16_abs(v1)))
        else:
            amax = np.float32(0.0)
            for j in range(32):
                v = abs(xr[o + j])
                if v > amax:
                    amax = v
        d = np.float32(amax / np.float32(127.0))
        idv = np.float32(np.float32(127.0) / amax) if amax != 0 else np.float32(0.0)
        if vec:
            tot = v16_q8(qr, o, v0, idv, False) + v16_q8(qr, o + 16, v1, idv, False)
        else:
            tot = 0
            for j in range(32):
                q = np.int32(np.rint(np.float32(xr[o + j] * idv)))
                qr[o + j] = q
                tot += q
        xd[i, b] = round_f16(d)
        if with_s:
            xs[i, b] = round_f16(np.float32(d * np.float32(tot)))


@njit(cache=True)
def q8_0_split(x, xq, xd, xs, with_s):
    """Q8_0 (and Q8_1 when with_s) of x [n, k] into xq [n, k] int8, xd/xs [n, k/32] float32 (F16 values).
    Rows with contiguous values go sixteen lanes at a time (the same arithmetic: the largest |x| of the block,
    rint(x * id), the exact sum of the q)."""
    vec = x.strides[1] == 4
    for i in range(x.shape[0]):
        _q8_0_row(x, xq, xd, xs, with_s, vec, i)


@njit(parallel=True, cache=True, nogil=True)
def q8_0_split_par(x, xq, xd, xs, with_s):
    """``q8_0_split`` with the rows shared among the threads (prompts: the quantization ran on one core while the
    other waited for the product)."""
    vec = x.strides[1] == 4
    for i in prange(x.shape[0]):
        _q8_0_row(x, xq, xd, xs, with_s, vec, i)


@njit(cache=True, inline="always")
def _q8_k_row(x, xq, xd, bsums, vec, i):
    """Row i of ``q8_k_split``."""
    k = x.shape[1]
    xr, qr = x[i], xq[i]
    for b in range(k // 256):
        o = b * 256
        if vec:
            m = v16_abs(v16_load(xr, o))
            for j in range(16, 256, 16):
                m = v16_max(m, v16_abs(v16_load(xr, o + j)))
            amax = v16_hmax(m)
            mx = np.float32(0.0)
            for j in range(0, 256, 16):         # the first value of largest |x|, sixteen lanes per compare
                l = v16_find_abs(v16_load(xr, o + j), amax)
                if l < 16:
                    mx = xr[o + j + l]
                    break
            if mx == 0:         # no match: NaNs only, which the scalar scan skips (an all-zero block)
                amax = np.float32(0.0)
        else:
            amax = np.float32(0.0)
            mx = np.float32(0.0)
            for j in range(256):
                v = xr[o + j]
                if abs(v) > amax:
                    amax = abs(v)
                    mx = v
        if amax == 0:
            xd[i, b] = 0
            for j in range(256):
                qr[o + j] = 0
            for j in range(16):
                bsums[i, b * 16 + j] = 0
            continue
        iscale = np.float32(np.float32(-127.0) / mx)
        if vec:
            for j in range(16):
                bsums[i, b * 16 + j] = v16_q8(qr, o + 16 * j, v16_load(xr, o + 16 * j), iscale, True)
        else:
            for j in range(256):
                q = np.int32(np.rint(np.float32(iscale * xr[o + j])))
                qr[o + j] = min(127, q)
            for j in range(16):
                s = 0
                for e in range(16):
                    s += np.int32(qr[o + j * 16 + e])
                bsums[i, b * 16 + j] = s
        xd[i, b] = np.float32(np.float32(1.0) / iscale)


@njit(cache=True)
def q8_k_split(x, xq, xd, bsums):
    """Q8_K of x [n, k] into xq [n, k] int8, xd [n, k/256] float32, bsums [n, k/16] int16. The scale comes from
    the block's first value of largest |x| (its sign included); rows with contiguous values are rounded sixteen
    lanes at a time, one bsum per sixteen."""
    vec = x.strides[1] == 4
    for i in range(x.shape[0]):
        _q8_k_row(x, xq, xd, bsums, vec, i)


@njit(parallel=True, cache=True, nogil=True)
def q8_k_split_par(x, xq, xd, bsums):
    """``q8_k_split`` with the rows shared among the threads."""
    vec = x.strides[1] == 4
    for i in prange(x.shape[0]):
        _q8_k_row(x, xq, xd, bsums, vec, i)


@njit(cache=True)
def q8_round_rows(x, xr, delta, with_delta):
    """x [n, k] rounded through Q8_0/Q8_1 and back in one pass: xr = q * F16(d) (the values the integer kernels
    multiply by); for Q8_1 also delta = F16(d * sum(q)) - F16(d) * sum(q) per block (what ggml's s adds beyond
    the block sum of xr). Same rounding as ``q8_0_split``."""
    n, k = x.shape
    for i in range(n):
        for b in range(k // 32):
            o = b * 32
            amax = np.float32(0.0)
            for j in range(32):
                v = abs(x[i, o + j])
                if v > amax:
                    amax = v
            d = np.float32(amax / np.float32(127.0))
            idv = np.float32(np.float32(127.0) / amax) if amax != 0 else np.float32(0.0)
            d16 = round_f16(d)
            tot = 0
            for j in range(32):
                q = np.rint(np.float32(x[i, o + j] * idv))
                xr[i, o + j] = np.float32(q) * d16
                tot += np.int32(q)
            if with_delta:
                delta[i, b] = np.float32(np.float64(round_f16(np.float32(d * np.float32(tot))))
                                         - np.float64(d16) * tot)


class ActScratch:
    """Buffers for one shape of quantized activations, reused call after call (decode allocates nothing)."""
    __slots__ = ("xq", "xd", "xs", "x32")

    def __init__(self, n: int, k: int, vdt: GGMLType):
        blck = QK_K if vdt == T.Q8_K else 32
        self.xq = np.empty((n, k), np.int8)
        self.xd = np.empty((n, k // blck), np.float32)
        # Q8_1: s per block of 32; Q8_K: bsums per 16; Q8_0: unused (kept 1 wide so the kernels' types stay fixed)
        if vdt == T.Q8_K:
            self.xs = np.empty((n, k // 16), np.int16)
        else:
            self.xs = np.zeros((n, k // 32), np.float32)   # Q8_0: unused by the kernels, read as 0
        self.x32 = None


_SCRATCH: dict = {}


# from this many rows the quantizers run on all threads (a 576-value row takes ~0.25 us: below it the parallel
# region's start costs more than it saves)
PAR_ROWS = 64


def q8_0_quantizer(n: int):
    """``q8_0_split`` for a batch of n rows: the parallel one from PAR_ROWS rows."""
    return q8_0_split_par if n >= PAR_ROWS else q8_0_split


def q8_k_quantizer(n: int):
    """``q8_k_split`` for a batch of n rows: the parallel one from PAR_ROWS rows."""
    return q8_k_split_par if n >= PAR_ROWS else q8_k_split


def scratch_for(n: int, k: int, vdt: GGMLType) -> ActScratch:
    """The shared buffers for activations of this shape (one set per shape: calls run one after another)."""
    key = (n, k, int(vdt))
    scratch = _SCRATCH.get(key)
    if scratch is None:
        if len(_SCRATCH) > 64:
            _SCRATCH.clear()
        scratch = _SCRATCH[key] = ActScratch(n, k, vdt)
    return scratch


def act_split(x: np.ndarray, vdt: GGMLType, scratch: ActScratch | None = None) -> ActScratch:
    """x float32 [n, k] quantized to vdt (Q8_0, Q8_1 or Q8_K) in split form; buffers cached by shape when
    no scratch is given (the returned object is overwritten by the next call of the same shape)."""
    n, k = x.shape
    if scratch is None:
        scratch = scratch_for(n, k, vdt)
    if x.dtype != np.float32 or x.strides[1] != 4:
        x = np.ascontiguousarray(x, dtype=np.float32)
    if vdt == T.Q8_K:
        if k % QK_K:
            raise ValueError(f"Q8_K needs rows of whole {QK_K}-blocks, got {k}")
        q8_k_quantizer(n)(x, scratch.xq, scratch.xd, scratch.xs)
    elif vdt in (T.Q8_0, T.Q8_1):
        if k % 32:
            raise ValueError(f"{vdt.name} needs rows of whole 32-blocks, got {k}")
        q8_0_quantizer(n)(x, scratch.xq, scratch.xd, scratch.xs, vdt == T.Q8_1)
    else:
        raise ValueError(f"{GGMLType(vdt).name} is not an 8-bit dot type")
    return scratch


def _f16_bytes(v: np.ndarray) -> np.ndarray:
    return v.astype(np.float16).view(np.uint8).reshape(*v.shape, 2)


def quantize_act(x: np.ndarray, vdt: GGMLType) -> np.ndarray:
    """float32 [n, k] -> uint8 [n, row_bytes]: ggml's Q8_0/Q8_1/Q8_K blocks, byte for byte (see module doc)."""
    vdt = GGMLType(vdt)
    x = np.ascontiguousarray(np.asarray(x, dtype=np.float32).reshape(-1, np.shape(x)[-1]))
    n, k = x.shape
    s = ActScratch(n, k, vdt)
    act_split(x, vdt, s)
    out = np.empty((n, k // TYPE_TRAITS[vdt].blck_size, TYPE_TRAITS[vdt].type_size), np.uint8)
    if vdt == T.Q8_K:
        out[:, :, 0:4] = s.xd.view(np.uint8).reshape(n, -1, 4)
        out[:, :, 4:260] = s.xq.view(np.uint8).reshape(n, -1, 256)
        out[:, :, 260:292] = s.xs.view(np.uint8).reshape(n, -1, 32)
    else:
        out[:, :, 0:2] = _f16_bytes(s.xd)
        if vdt == T.Q8_1:
            out[:, :, 2:4] = _f16_bytes(s.xs)
        out[:, :, -32:] = s.xq.view(np.uint8).reshape(n, -1, 32)
    return out.reshape(n, -1)


@njit(cache=True, nogil=True, inline="always")
def _f16_row(xr, o):
    k = xr.shape[0]
    k16 = k - k % 16
    for j in range(0, k16, 16):
        v16_store(o, j, v16_round_f16(v16_load(xr, j)))
    for j in range(k16, k):
        o[j] = round_f16(xr[j])


@njit(cache=True, nogil=True, inline="always")
def _bf16_row(u, o):
    for j in range(u.shape[0]):
        v = np.int64(u[j])
        if (v & 0x7FFFFFFF) > 0x7F800000:
            r = (v >> 16) | 64                          # a NaN stays a quiet NaN
        else:
            r = ((v + 0x7FFF + ((v >> 16) & 1)) >> 16) & 0xFFFF
        o[j] = np.uint32(r << 16)


@njit(cache=True, nogil=True)
def _round_f16(x, out):
    for i in range(x.shape[0]):
        _f16_row(x[i], out[i])


@njit(parallel=True, cache=True, nogil=True)
def _round_f16_par(x, out):
    for i in prange(x.shape[0]):
        _f16_row(x[i], out[i])


@njit(cache=True, nogil=True)
def _round_bf16(u, out):
    for i in range(u.shape[0]):
        _bf16_row(u[i], out[i])


@njit(parallel=True, cache=True, nogil=True)
def _round_bf16_par(u, out):
    for i in prange(u.shape[0]):
        _bf16_row(u[i], out[i])


PAR_ROWS = 16   # from this many rows the rounding runs on every thread (below, a parallel region costs more)


def round_half(x: np.ndarray, vdt: GGMLType) -> np.ndarray:
    """x (float32 [n, k]) rounded to F16 or BF16 (ggml's GGML_FP32_TO_FP16 / _BF16) and widened back to float32,
    in Numba (numpy's float16 casts take ~17 ns a value: 5 ms for a 512 x 576 prompt's activations)."""
    x = np.ascontiguousarray(x, dtype=np.float32)
    x2 = x.reshape(-1, x.shape[-1]) if x.ndim != 2 else x
    out = np.empty_like(x2)
    par = x2.shape[0] >= PAR_ROWS
    if GGMLType(vdt) == T.F16:
        (_round_f16_par if par else _round_f16)(x2, out)
    else:
        (_round_bf16_par if par else _round_bf16)(x2.view(np.uint32), out.view(np.uint32))
    return out.reshape(x.shape)


def round_act(x: np.ndarray, vdt: GGMLType) -> np.ndarray:
    """x (float32 [n, k]) rounded through the dot type and back to float32: the values the integer kernels
    effectively multiply by (exactly representable)."""
    vdt = GGMLType(vdt)
    x = np.ascontiguousarray(x, dtype=np.float32)
    if vdt == T.F32:
        return x
    if vdt in (T.F16, T.BF16):
        return round_half(x, vdt)
    s = act_split(x, vdt, ActScratch(*x.shape, vdt))
    blck = QK_K if vdt == T.Q8_K else 32
    n, k = x.shape
    return (s.xq.reshape(n, k // blck, blck).astype(np.float32) * s.xd[:, :, None]).reshape(n, k)


def f32_to_bf16_bits(x: np.ndarray) -> np.ndarray:
    """ggml's GGML_FP32_TO_BF16: round to nearest even on the top 16 bits; NaNs stay quiet NaNs."""
    u = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32)
    r = ((u + (np.uint32(0x7FFF) + ((u >> np.uint32(16)) & np.uint32(1)))) >> np.uint32(16)).astype(np.uint16)
    nan = (u & np.uint32(0x7FFFFFFF)) > np.uint32(0x7F800000)
    if nan.any():
        r[nan] = ((u[nan] >> np.uint32(16)) | np.uint32(64)).astype(np.uint16)
    return r


def bf16_bits_to_f32(b: np.ndarray) -> np.ndarray:
    return (np.asarray(b, dtype=np.uint16).astype(np.uint32) << np.uint32(16)).view(np.float32)
