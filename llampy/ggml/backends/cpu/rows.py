"""GET_ROWS and SET_ROWS for the plain types in Numba (token embeddings, KV-cache writes); block types go through
``llampy.ggml.quants`` on just the selected rows (backend.py). ``f32_to_f16_bits`` is ggml's GGML_FP32_TO_FP16
(round to nearest even, subnormals, overflow to inf) with integer bit operations: Numba has no float16."""
from __future__ import annotations

import numpy as np
from numba import njit, prange

from .builds import parallel_build
from .direct import Prepare
from .simd import v16_f16_copy


@njit(cache=True, inline="always")
def f32_to_f16_bits(bits):
    """The F16 bit pattern nearest to the float32 of bit pattern ``bits`` (ties to even), as uint16."""
    u = np.int64(bits)
    sign = (u >> 16) & 0x8000
    a = u & 0x7FFFFFFF
    if a >= 0x7F800000:                       # inf, nan (kept quiet)
        h = 0x7E00 if a > 0x7F800000 else 0x7C00
    elif a >= 0x477FF000:                     # >= 65520 rounds to inf
        h = 0x7C00
    elif a < 0x38800000:                      # below 2^-14: an F16 subnormal, a multiple of 2^-24
        # the float32 value is m * 2^(e - 150); shift right with round-to-nearest-even
        e = a >> 23
        m = (a & 0x7FFFFF) | (0x800000 if e > 0 else 0)
        shift = 126 - e if e > 0 else 125
        if shift > 31:
            h = 0
        else:
            h = m >> shift
            rem = m & ((1 << shift) - 1)
            half = 1 << (shift - 1)
            if rem > half or (rem == half and (h & 1) == 1):
                h += 1
    else:
        h = (a - 0x38000000) >> 13
        rem = a & 0x1FFF
        if rem > 0x1000 or (rem == 0x1000 and (h & 1) == 1):
            h += 1
    return np.uint16(sign | h)


def _get_rows_plain(a, idx, out):
    """a: (ne3, ne2, n_rows, ne0) float32/int32; idx: int (ne3', ne2', n), ne2' == ne2; out (ne3', ne2', n, ne0)."""
    n3, n2, n = idx.shape
    for r in prange(n3 * n2 * n):
        i3 = r // (n2 * n)
        i2 = (r // n) % n2
        i = r % n
        src = a[i3 % a.shape[0], i2, idx[i3, i2, i]]
        o = out[i3, i2, i]
        for j in range(src.shape[0]):   # a loop, not a slice assignment: 0.3 s to compile instead of 3 s
            o[j] = src[j]


def _get_rows_f16(a, idx, tab, out):
    """As get_rows_plain from F16 bits (uint16) through tab, the F16 -> float32 table."""
    n3, n2, n = idx.shape
    ne0 = a.shape[3]
    for r in prange(n3 * n2 * n):
        i3 = r // (n2 * n)
        i2 = (r // n) % n2
        i = r % n
        src = a[i3 % a.shape[0], i2, idx[i3, i2, i]]
        o = out[i3, i2, i]
        for j in range(ne0):
            o[j] = tab[src[j]]


def _set_rows_f16(src, idx, dst):
    """src: float32 bit patterns (uint32) (s3, s2, s1, ne0); idx int (i3, i2, s1) broadcast over dims 3, 2; dst uint16 F16 bits (d3, d2, rows, ne0)."""
    s3, s2, s1, ne0 = src.shape
    for r in prange(s3 * s2 * s1):
        j3 = r // (s2 * s1)
        j2 = (r // s1) % s2
        j1 = r % s1
        row = idx[j3 % idx.shape[0], j2 % idx.shape[1], j1]
        o = dst[j3 % dst.shape[0], j2 % dst.shape[1], row]
        s = src[j3, j2, j1]
        n16 = ne0 - ne0 % 16 if o.strides[0] == 2 and s.strides[0] == 4 else 0
        for j in range(0, n16, 16):     # sixteen at a time where both rows are contiguous (same bits)
            v16_f16_copy(o, s, j)
        for j in range(n16, ne0):
            o[j] = f32_to_f16_bits(s[j])


def _set_rows_same(src, idx, dst):
    """As set_rows_f16 without conversion (F32 into F32, F16 bits into F16 bits)."""
    s3, s2, s1, ne0 = src.shape
    for r in prange(s3 * s2 * s1):
        j3 = r // (s2 * s1)
        j2 = (r // s1) % s2
        j1 = r % s1
        row = idx[j3 % idx.shape[0], j2 % idx.shape[1], j1]
        o = dst[j3 % dst.shape[0], j2 % dst.shape[1], row]
        for j in range(ne0):
            o[j] = src[j3, j2, j1, j]


@njit(cache=True, nogil=True)
def _in_range(idx, n_rows):
    for v in idx:
        if v < 0 or v >= n_rows:
            return False
    return True


def check_index(idx: np.ndarray, n_rows: int, what: str) -> None:
    """ggml asserts its row indices are in range; a bad one here is an IndexError, not a stray write. One pass
    in Numba: two NumPy reductions cost ~8 us per call, 60 calls per decode step."""
    flat = idx.reshape(-1)
    if flat.size and not _in_range(flat, n_rows):
        raise index_error(what, n_rows)


def index_prepare(idx: np.ndarray, n_rows: int, what: str) -> Prepare:
    """``check_index`` of indices that a graph input holds, as a plan's ``Prepare`` step: a fast run tests them
    once before the first store reading them (a decoded token's cell index: 2 x n_layer stores), not per store."""
    return Prepare(lambda: check_index(idx, n_rows, what), ("row indices", idx.ctypes.data, idx.shape, idx.strides,
                                                          n_rows))


def index_error(what: str, n_rows: int) -> IndexError:
    """The error of a row index outside 0..n_rows - 1 (``check_index``'s, and the checked kernels' callers')."""
    return IndexError(f"{what}: row index out of range 0..{n_rows - 1}")


get_rows_plain_par = parallel_build(_get_rows_plain)
get_rows_plain = njit(cache=True)(_get_rows_plain)


get_rows_f16_par = parallel_build(_get_rows_f16)
get_rows_f16 = njit(cache=True)(_get_rows_f16)


set_rows_f16_par = parallel_build(_set_rows_f16)
set_rows_f16 = njit(cache=True)(_set_rows_f16)


@njit(cache=True)
def set_rows_f16_checked(src, idx, n_rows, dst):
    """``check_index``'s test, then ``set_rows_f16``, in one call (a decoded token's V row into an F16 cache): False,
    with nothing stored, where an index is outside 0..n_rows - 1."""
    for i3 in range(idx.shape[0]):
        for i2 in range(idx.shape[1]):
            for v in idx[i3, i2]:
                if v < 0 or v >= n_rows:
                    return False
    set_rows_f16(src, idx, dst)
    return True


set_rows_same_par = parallel_build(_set_rows_same)
set_rows_same = njit(cache=True)(_set_rows_same)


# CONT and CONCAT of float32, as loops: NumPy's copy of a strided view goes through a temporary (reshape(-1)) and
# concatenate through another, ~30 us of calls for the few thousand values of a decoded token's convolution window
# (Mamba-2, LFM2: a CONCAT with a transposed source and a CONT of the window's tail per layer). Rows are walked as
# nested loops (a flat row index costs three integer divisions per row, more than a short row's copy).
@njit(inline="always")
def _cont_plane(src, out, i3, i2):
    s = src[i3, i2]
    o = out[i3, i2]
    for i1 in range(s.shape[0]):
        for j in range(s.shape[1]):
            o[i1, j] = s[i1, j]


@njit(cache=True)
def cont_f32(src, out):
    """out (C-contiguous) = src, both 4-D of one shape; src of any strides."""
    for i3 in range(src.shape[0]):
        for i2 in range(src.shape[1]):
            _cont_plane(src, out, i3, i2)


@njit(parallel=True, cache=True)
def cont_f32_par(src, out):
    """``cont_f32`` with the planes on all threads, or the rows when there is one plane."""
    n3, n2 = src.shape[0], src.shape[1]
    if n3 * n2 == 1:
        s = src[0, 0]
        o = out[0, 0]
        for i1 in prange(s.shape[0]):
            for j in range(s.shape[1]):
                o[i1, j] = s[i1, j]
        return
    for r in prange(n3 * n2):
        _cont_plane(src, out, r // n2, r % n2)


def _cont_f16(src, out):
    """out (uint16, C-contiguous) = the F16 bits of src (float32 bit patterns as uint32; rows contiguous, any other
    strides), both 4-D of one shape: ggml's CPY of F32 into F16 (an encoder's K and V cast for flash attention).
    Rows over the threads, 16 values at a time (vcvtps2ph's rounding, as f32_to_f16_bits)."""
    n2, n1, n0 = src.shape[1], src.shape[2], src.shape[3]
    n16 = n0 - n0 % 16
    for r in prange(src.shape[0] * n2 * n1):
        s = src[r // (n2 * n1), (r // n1) % n2, r % n1]
        o = out[r // (n2 * n1), (r // n1) % n2, r % n1]
        for j in range(0, n16, 16):
            v16_f16_copy(o, s, j)
        for j in range(n16, n0):
            o[j] = f32_to_f16_bits(s[j])


cont_f32_f16 = njit(cache=True)(_cont_f16)
cont_f32_f16_par = parallel_build(_cont_f16)


@njit(inline="always")
def _concat_rows(a, b, out, i3, i2, i0, i1):
    x = a[i3, i2]
    y = b[i3, i2]
    o = out[i3, i2]
    na = x.shape[1]
    for r in range(i0, i1):
        for j in range(na):
            o[r, j] = x[r, j]
        for j in range(y.shape[1]):
            o[r, na + j] = y[r, j]


@njit(cache=True)
def concat0_f32(a, b, out):
    """out = a and b side by side along the last axis (ggml's dim 0), all 4-D; a and b of any strides."""
    for i3 in range(a.shape[0]):
        for i2 in range(a.shape[1]):
            _concat_rows(a, b, out, i3, i2, 0, a.shape[2])


@njit(parallel=True, cache=True)
def concat0_f32_par(a, b, out):
    """``concat0_f32`` in blocks of 64 rows on all threads."""
    n3, n2, n1 = a.shape[0], a.shape[1], a.shape[2]
    nblk = (n1 + 63) // 64
    for q in prange(n3 * n2 * nblk):
        p = q // nblk
        i0 = (q % nblk) * 64
        _concat_rows(a, b, out, p // n2, p % n2, i0, min(i0 + 64, n1))
