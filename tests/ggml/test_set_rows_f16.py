"""SET_ROWS into an F16 cache converts sixteen values at a time; the bits are those of the one-value conversion
``rows.f32_to_f16_bits`` (ggml's GGML_FP32_TO_FP16) for every float32 bit pattern tried."""
from __future__ import annotations

import numpy as np

from llampy.ggml.backends.cpu import rows as R


def test_vector_conversion_matches_the_scalar_one_bit_for_bit():
    rng = np.random.default_rng(5)
    bits = rng.integers(0, 2 ** 32, (3, 5, 100), dtype=np.uint64).astype(np.uint32)   # 100: six vectors + 4
    edge = [0, 0x80000000, 0x7F800000, 0xFF800000, 0x7FC00000, 0xFFC00001, 0x7F800001, 0x477FEFFF, 0x477FF000,
            0xC77FF000, 0x38800000, 0x387FFFFF, 0x33000000, 0x33000001, 0x32FFFFFF, 0x3F801000, 0x3F803000]
    bits[0, 0, :len(edge)] = edge
    bits[0, 1, 96:] = edge[:4]                                  # edge values in the scalar tail as well
    src = bits.reshape(1, 3, 5, 100)
    idx = np.array([[[4, 0, 2, 1, 3]] * 3], np.int64)           # rows written out of order
    dst = np.zeros((1, 3, 6, 100), np.uint16)
    R.set_rows_f16(src, idx, dst)
    want = np.zeros_like(dst)
    for j2 in range(3):
        for j1 in range(5):
            want[0, j2, idx[0, j2, j1]] = [R.f32_to_f16_bits(b) for b in bits[j2, j1]]
    assert np.array_equal(dst, want)
