"""Flash attention over a BF16 KV cache (llampy/ggml/backends/cpu/attention.py ``_fa_vec16`` with BF16 K and/or V)
against llama.cpp's own CPU kernel (ggml_compute_forward_flash_attn_ext_f16_one_chunk, which every BF16 K takes,
at any number of queries), run through ctypes as a one-node ggml graph in the libggml-cpu of the build from the
sdist: Q rounded to BF16, ggml_vec_dot_bf16 per cell, a float32 accumulator for a BF16 V (an F16 one for an F16 V).
llampy reproduces ggml_vec_dot_bf16's AVX2 form (as its BF16 matrix products do); a build for AVX-512 sums in
other lanes (AVX512F) or pairs (AVX512-BF16's vdpbf16ps), so the bits are compared where the host's build is an
AVX2 one. An F16 K also needs llampy's F16 order to be the host's (tests/ggml/helpers.py HOST_ORDER_ONLY)."""
from __future__ import annotations

import numpy as np
import pytest

from llampy.ggml.backends.cpu import attention
from llampy.ggml.backends.cpu import simd
from tests import llamacpp

F32, F16, BF16 = 0, 1, 30

pytestmark = pytest.mark.skipif(simd.HOST_VEC_LANES != 8, reason="llama.cpp's build here runs an AVX-512 form of "
                                "ggml_vec_dot_bf16, whose order llampy does not reproduce")


@pytest.fixture(scope="module")
def ggml():
    return llamacpp.libggml_graph()


def _bits(x, t):
    from llampy.ggml.backends.cpu.act_quant import f32_to_bf16_bits
    return f32_to_bf16_bits(x) if t == BF16 else x.astype(np.float16).view(np.uint16)


# head sizes: leftovers past ggml_vec_dot_bf16's steps of 32 (44, 72) and past eight lanes (44), none (64); 70
# queries: ggml's tiled path would take them for F16, a BF16 K stays on one_chunk
@pytest.mark.parametrize("kt,vt,n_q,d,softcap,max_bias,sinks", [
    (BF16, BF16, 3, 64, 0.0, 0.0, False),
    (BF16, BF16, 5, 44, 20.0, 0.0, True),
    (BF16, BF16, 70, 72, 0.0, 8.0, False),
    (BF16, F16, 4, 64, 0.0, 0.0, False),
    (F16, BF16, 4, 72, 0.0, 0.0, False),
])
def test_bf16_cache_attention_gives_ggml_bits(ggml, kt, vt, n_q, d, softcap, max_bias, sinks):
    if kt == F16 and simd.F16_VEC_LANES != simd.HOST_VEC_LANES:
        pytest.skip("an F16 K's dot follows another build's order than this host's (LLAMPY_FLOAT_ORDER=host)")
    rng = np.random.default_rng(n_q * d)
    n_head, n_head_kv, n_kv = 4, 2, n_q + 37
    q = (rng.standard_normal((1, n_head, n_q, d)) * 2).astype(np.float32)
    k = _bits((rng.standard_normal((1, n_head_kv, n_kv, d)) * 2).astype(np.float32), kt)
    v = _bits(rng.standard_normal((1, n_head_kv, n_kv, d)).astype(np.float32), vt)
    m = np.zeros((n_q, n_kv), np.float32)
    m[np.arange(n_kv)[None, :] > n_kv - n_q + np.arange(n_q)[:, None]] = -np.inf   # causal: the last n_q cells
    m[:, 3] = -np.inf
    m[1, 5] = -2.5
    m16 = m.astype(np.float16).view(np.uint16)[None, None]
    s = (rng.standard_normal(n_head) * 3).astype(np.float32) if sinks else None
    scale = float(np.float32(1.0 / np.sqrt(d)))
    want = llamacpp.ggml_flash_attn(ggml, q, k, v, m16, scale, max_bias, softcap, s, kt, vt)
    got = np.empty_like(want)
    attention.flash_attn(q, k, v, m[None, None], got, scale, max_bias, softcap, kt == F16, vt == F16, sinks=s,
                         k_bf16=kt == BF16, v_bf16=vt == BF16)
    assert np.array_equal(got.view(np.uint32), want.view(np.uint32)), np.abs(got - want).max()
