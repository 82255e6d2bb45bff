"""The many-query flash attention (n_q >= 64: cpu/attention_tiled.py) against llama.cpp's own CPU kernel
(ggml_compute_forward_flash_attn_ext_tiled), run through ctypes as a one-node ggml graph in the libggml-cpu of the
build from the sdist: the same bits, with F16 and F32 K/V, grouped-query heads, masks (causal, finite biases, rows
and whole tiles that see nothing), soft-capping, ALiBi, a last tile cut short, head sizes that are not a multiple of
the register width. That build is native to the machine running the test, as llampy's choice of register width
(the softmax sum's reduction order) is."""
from __future__ import annotations

import numpy as np
import pytest

from llampy.ggml.backends.cpu import attention
from llampy.ggml.types import GGMLType
from tests import llamacpp

from tests.ggml.helpers import HOST_ORDER_ONLY as pytestmark  # noqa: E402,F401  (against the host's own build)


F32, F16 = 0, 1


@pytest.fixture(scope="module")
def ggml():
    return llamacpp.libggml_graph()


@pytest.mark.parametrize("n_head,n_head_kv,n_q,n_kv,d,f16,softcap,max_bias,masked,sinks", [
    (3, 3, 256, 256, 72, True, 0.0, 0.0, False, False),   # a vision encoder's: no mask, 4 x 4 tiles, d 72
    (4, 2, 70, 150, 64, True, 0.0, 0.0, True, False),     # a prompt after 80 cached cells, the last tile of 22
    (4, 4, 96, 96, 40, False, 0.0, 0.0, True, False),     # F32 K/V
    (4, 2, 64, 130, 32, True, 30.0, 0.0, True, True),     # soft-capping, attention sinks
    (8, 8, 65, 65, 16, True, 0.0, 8.0, True, False),      # ALiBi
])
def test_tiled_flash_attention_gives_ggml_bits(ggml, n_head, n_head_kv, n_q, n_kv, d, f16, softcap, max_bias,
                                               masked, sinks):
    rng = np.random.default_rng(n_q * 1000 + n_kv)
    q = (rng.standard_normal((1, n_head, n_q, d)) * 2).astype(np.float32)
    k = (rng.standard_normal((1, n_head_kv, n_kv, d)) * 2).astype(np.float32)
    v = rng.standard_normal((1, n_head_kv, n_kv, d)).astype(np.float32)
    if f16:
        k, v = k.astype(np.float16).view(np.uint16), v.astype(np.float16).view(np.uint16)
    mask = m16 = None
    if masked:
        m = np.zeros((n_q, n_kv), np.float32)
        m[np.arange(n_kv)[None, :] > n_kv - n_q + np.arange(n_q)[:, None]] = -np.inf    # causal
        m[:, 3] = -np.inf
        m[1, 5] = -2.5
        m[10, :] = -np.inf                  # a row that sees nothing: 0
        m[20, 64:] = -np.inf                # a row that sees nothing past the first tile
        mask, m16 = m[None, None], m.astype(np.float16).view(np.uint16)[None, None]
    scale = float(np.float32(1.0 / np.sqrt(d)))
    sk = (rng.standard_normal(n_head) * 3).astype(np.float32) if sinks else None
    want = llamacpp.ggml_flash_attn(ggml, q, k, v, m16, scale, max_bias, softcap, sk, F16 if f16 else F32)
    got = np.full_like(want, np.nan)
    kv_type = GGMLType.F16 if f16 else GGMLType.F32
    assert attention.use_tiled(kv_type, kv_type, n_q, d)          # the path ggml takes for these shapes
    attention.flash_attn(q, k, v, mask, got, scale, max_bias, softcap, f16, f16, tiled=True, sinks=sk)
    assert np.array_equal(got.view(np.uint32), want.view(np.uint32)), np.abs(got - want).max()
