"""Placing tensors for backend tests without the allocator: one host buffer per leaf."""
from __future__ import annotations

import numpy as np
import pytest

from llampy.ggml.backend import tensor_alloc, tensor_data
from llampy.ggml.graph import Graph
from llampy.ggml.sched import Scheduler
from llampy.ggml.tensor import Tensor
from llampy.ggml.types import GGMLType
from llampy.ggml.backends.cpu import simd as _simd

# for tests against the host's own llama.cpp build: they hold when llampy reproduces the host's float order
# (LLAMPY_FLOAT_ORDER=host, or an AVX-512 host at the default); elsewhere llampy keeps the AVX-512 build's order
HOST_ORDER_ONLY = pytest.mark.skipif(_simd.F16_VEC_LANES != _simd.HOST_VEC_LANES,
                                     reason="llampy reproduces another build's float order than this host's llama.cpp")


def leaf(backend, type, shape_np, value=None, rng=None) -> Tensor:
    """A placed leaf with NumPy-order shape ``shape_np`` (ne reversed), filled with ``value`` or random data."""
    t = Tensor(type, tuple(reversed(shape_np)))
    buf = backend.alloc_buffer(max(t.nbytes, 1))
    tensor_alloc(buf, t, 0)
    if value is None:
        rng = rng or np.random.default_rng(0)
        value = rng.standard_normal(shape_np).astype(np.float32)
    d = tensor_data(t)
    if type == GGMLType.F16:
        d[...] = np.asarray(value, np.float32).astype(np.float16)
    elif type == GGMLType.BF16:         # the values' BF16 bits (rounded to nearest even), not an integer cast
        from llampy.ggml.backends.cpu.act_quant import f32_to_bf16_bits
        d[...] = f32_to_bf16_bits(np.asarray(value, np.float32)).reshape(d.shape)
    elif d.dtype == np.uint8:
        from llampy.ggml.quants import QUANTIZE_TYPES, quantize
        if type in QUANTIZE_TYPES:
            d[...] = quantize(np.asarray(value, np.float32), type).reshape(d.shape)
        else:
            d[...] = random_blocks(type, d.shape, rng or np.random.default_rng(0))
    else:
        d[...] = np.asarray(value).astype(d.dtype)
    return t


def run(backend, *outs):
    for o in outs:
        o.set_output()
    g = Graph.build(*outs)
    Scheduler([backend]).graph_compute(g)
    return [np.array(tensor_data(o)) for o in outs]


# byte offsets of the F16 scale fields per block, so that random blocks hold sane scales
_SCALE_FIELDS = {GGMLType.Q4_K: (0, 2), GGMLType.Q5_K: (0, 2), GGMLType.Q2_K: (80, 82), GGMLType.Q6_K: (208,),
                 GGMLType.Q3_K: (108,), GGMLType.IQ4_XS: (0,), GGMLType.TQ2_0: (64,),
                 GGMLType.TQ1_0: (52,)}


def random_blocks(type, shape, rng) -> np.ndarray:
    """Random block bytes of a type with its F16 scales set to small positive values."""
    from llampy.ggml.types import TYPE_TRAITS
    ts = TYPE_TRAITS[type].type_size
    b = rng.integers(0, 256, shape, dtype=np.uint8).reshape(-1, ts)
    for off in _SCALE_FIELDS.get(type, (0,)):
        b[:, off:off + 2] = np.full((len(b), 1), 0.01, np.float16).view(np.uint8)
    return b.reshape(shape)
