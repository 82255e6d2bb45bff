"""Prompt-sized activation batches are quantized on all threads (act_quant.q8_0_split_par, q8_k_split_par): every
row must come out as the one-thread quantizer makes it."""
from __future__ import annotations

import numpy as np
import pytest

from llampy.ggml.backends.cpu import act_quant as A
from llampy.ggml.types import GGMLType as T


@pytest.mark.parametrize("vdt", [T.Q8_0, T.Q8_1, T.Q8_K])
def test_parallel_quantizers_match_the_serial_ones(vdt):
    rng = np.random.default_rng(int(vdt))
    n, k = A.PAR_ROWS + 13, 512
    x = (rng.standard_normal((n, k)) * 10.0 ** rng.integers(-3, 4, (n, 1))).astype(np.float32)
    x[3] = 0                                   # an all-zero row
    x[5, :40] = -x[5, :40]
    got = A.act_split(x, vdt, A.ActScratch(n, k, vdt))
    want = A.ActScratch(n, k, vdt)              # separate buffers (scratch_for shares one set per shape)
    if vdt == T.Q8_K:
        A.q8_k_split(x, want.xq, want.xd, want.xs)
    else:
        A.q8_0_split(x, want.xq, want.xd, want.xs, vdt == T.Q8_1)
    for a, b in ((got.xq, want.xq), (got.xd, want.xd), (got.xs, want.xs)):
        assert np.array_equal(a, b)
