"""Block formats against gguf-py (the oracle): dequantize and quantize, random data and both real models."""
from __future__ import annotations

import numpy as np
import pytest
from gguf import quants as gq
from gguf.constants import GGMLQuantizationType as GQ

from llampy.ggml.quants import DEQUANTIZE_TYPES, QUANTIZE_TYPES, dequantize, quantize, quantize_act
from llampy.ggml.types import GGMLType as T, TYPE_TRAITS
from llampy.gguf import GGUFReader

BLOCK_TYPES = sorted((t for t in DEQUANTIZE_TYPES if TYPE_TRAITS[t].is_quantized and t not in (T.Q8_1, T.Q8_K)),
                     key=int)


@pytest.mark.parametrize("t", BLOCK_TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("rows", [1, 3, 17])
def test_dequantize_equals_gguf_py_on_random_blocks(t, rows):
    tt = TYPE_TRAITS[t]
    raw = np.random.default_rng(rows).integers(0, 256, (rows, 2 * tt.type_size), dtype=np.uint8)
    with np.errstate(all="ignore"):
        ours = dequantize(raw, t)
        theirs = gq.dequantize(raw, GQ(int(t)))
    assert ours.shape == (rows, 2 * tt.blck_size)
    np.testing.assert_array_equal(ours, theirs.reshape(ours.shape))


@pytest.mark.parametrize("t", sorted(QUANTIZE_TYPES - {T.Q8_K, T.Q8_1}, key=int), ids=lambda t: t.name)
@pytest.mark.parametrize("shape", [(1, 256), (5, 512), (2, 3, 256)])
def test_quantize_equals_gguf_py(t, shape):
    x = np.random.default_rng(len(shape)).standard_normal(shape).astype(np.float32) * 3
    ours = quantize(x, t)
    theirs = gq.quantize(x, GQ(int(t)))
    np.testing.assert_array_equal(ours.reshape(-1), np.asarray(theirs).view(np.uint8).reshape(-1))


def test_q8_k_round_trip_and_bsums():
    x = np.random.default_rng(0).standard_normal((3, 512)).astype(np.float32)
    q = quantize(x, T.Q8_K).reshape(3, 2, 292)
    y = dequantize(q.reshape(3, -1), T.Q8_K)
    assert np.abs(y - x).max() <= np.abs(x).max() / 127 * 0.51
    qs = q[:, :, 4:260].view(np.int8).astype(np.int32)
    bsums = q[:, :, 260:292].copy().view(np.int16)
    np.testing.assert_array_equal(bsums, qs.reshape(3, 2, 16, 16).sum(axis=3))


def test_activation_q8_0_is_the_x86_rounding():
    # 127/amax and round-half-even (ggml's AVX quantize_row_q8_0) vs the reference's 1/d and roundf
    x = np.zeros((1, 32), np.float32)
    x[0, 0] = 127.0
    x[0, 1] = 2.5
    act = quantize_act(x, T.Q8_0)[0, 2:].view(np.int8)
    ref = quantize(x, T.Q8_0)[0, 2:].view(np.int8)
    assert act[1] == 2 and ref[1] == 3


@pytest.mark.slow
@pytest.mark.parametrize("name", ["smollm2", "gemma3"])
def test_every_tensor_of_the_real_models_dequantizes_like_gguf_py(name):
    from llampy.models import resolve_model
    r = GGUFReader(resolve_model(name))
    n = 0
    for tname, info in r.tensors.items():
        if not TYPE_TRAITS[info.type].is_quantized:
            continue
        raw = r.tensor_array(tname)
        np.testing.assert_array_equal(dequantize(raw, info.type), gq.dequantize(raw, GQ(int(info.type))).reshape(
            raw.shape[0], -1), err_msg=tname)
        n += 1
    assert n > 100
