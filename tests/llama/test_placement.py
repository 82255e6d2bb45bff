"""Weight placement across devices (llama.cpp's n_gpu_layers / tensor_split / split_mode 'layer'), with two extra
cpu backends standing in for accelerators: the layers land where llama.cpp's llama_model::load_tensors puts them
(the last n_gpu_layers of the n_layer + 1 units, the output head being the last unit; each device a contiguous
run in tensor_split's proportions; the input embeddings on the CPU), every layer's weights and KV cache live in
its device's buffers, and the logits equal a single-device run bit for bit (the scheduler copies activations
between devices, nothing else changes)."""
from __future__ import annotations

import numpy as np
import pytest

from llampy.ggml.backends.cpu.backend import CPUBackend
from llampy.llama.batch import Batch
from llampy.llama.context import Context
from llampy.llama.model import Model
from tests.paths import TINY

TINY_LLAMA = TINY / "llama-F32.gguf"


def logits(model):
    ctx = Context(model, n_ctx=64)
    ctx.decode(Batch.from_tokens([1, 5, 9, 13, 2, 7], logits_all=True))
    out = [ctx.get_logits_ith(i).copy() for i in range(6)]
    ctx.decode(Batch.from_tokens([4], pos0=6))
    out.append(ctx.get_logits_ith(-1).copy())
    return np.array(out), ctx


def llamacpp_layers(n_layer, n_gpu_layers, split):
    """llama.cpp's assignment (llama-model.cpp, get_layer_buft_list): index -> device number or None (CPU)."""
    i_start = max(n_layer + 1 - n_gpu_layers, 0)
    act = min(n_gpu_layers, n_layer + 1)
    cum = np.cumsum(split) / sum(split)
    return [None if il < i_start or il - i_start >= act
            else int(np.searchsorted(cum, (il - i_start) / act, side="right")) for il in range(n_layer + 1)]


@pytest.mark.parametrize("n_gpu_layers,split", [(3, [1, 1]), (1, [1, 1]), (2, [1, 3]), (0, [1, 1])])
def test_tiny_llama_split_over_two_devices(n_gpu_layers, split):
    ref, _ = logits(Model(TINY_LLAMA))
    devs = [CPUBackend("dev0"), CPUBackend("dev1")]
    m = Model(TINY_LLAMA, n_gpu_layers=n_gpu_layers, devices=devs, tensor_split=split)
    n_layer = m.hparams.n_layer
    want = llamacpp_layers(n_layer, n_gpu_layers, split)
    assert [None if b is m.cpu else devs.index(b) for b in m.layer_backend] == want
    for name, t in m.tensors.items():
        if name.startswith("blk."):
            il = int(name.split(".")[1])
            assert t.buffer.buft.device == m.layer_backend[il].device, name
        elif name.startswith("token_embd"):
            assert t.buffer.buft.device == "cpu"          # the input layer stays on the CPU, as in llama.cpp
    got, ctx = logits(m)
    for il in range(n_layer):
        assert ctx.kv.k[il].buffer.buft.device == m.layer_backend[il].device
    assert np.array_equal(got, ref)


def test_split_mode_none_uses_the_first_device():
    devs = [CPUBackend("dev0"), CPUBackend("dev1")]
    m = Model(TINY_LLAMA, n_gpu_layers=99, devices=devs, split_mode="none")
    assert all(b is devs[0] for b in m.layer_backend)


def test_bad_tensor_split_is_an_error():
    with pytest.raises(ValueError, match="tensor_split"):
        Model(TINY_LLAMA, n_gpu_layers=2, devices=[CPUBackend("dev0"), CPUBackend("dev1")], tensor_split=[1, 1, 1])


@pytest.mark.slow
def test_smollm2_three_quarters_offloaded(smollm2_path):
    devs = [CPUBackend("dev0"), CPUBackend("dev1")]
    m = Model(smollm2_path, n_gpu_layers=23, devices=devs, tensor_split=[3, 1])
    want = llamacpp_layers(m.hparams.n_layer, 23, [3, 1])
    assert [None if b is m.cpu else devs.index(b) for b in m.layer_backend] == want
    ctx = Context(m, n_ctx=64)
    ctx.decode(Batch.from_tokens([1, 504, 3458, 282, 4649, 314]))
    split_logits = ctx.get_logits_ith(-1).copy()
    ctx1 = Context(Model(smollm2_path), n_ctx=64)
    ctx1.decode(Batch.from_tokens([1, 504, 3458, 282, 4649, 314]))
    assert np.array_equal(split_logits, ctx1.get_logits_ith(-1))
