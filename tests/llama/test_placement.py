"""Weight placement across devices (llama.cpp's n_gpu_layers / tensor_split / split_mode 'layer'), with two extra
cpu backends standing in for accelerators: the layers land where llama.cpp's llama_model::load_tensors puts them
(the last n_gpu_layers of the n_layer + 1 units, the output head being the last unit; each device a contiguous
run in tensor_split's proportions; the input embeddings on the CPU), every layer's weights and KV cache live in
its device's buffers, and the logits equal a single-device run bit for bit (the scheduler copies activations
between devices, nothing else changes). The stand-ins run over host memory, and over device memory that only the
buffer interface reaches (``DeviceCPU``: the cpu kernels over tests/ggml/fakes.DeviceBuffer, where tensor_data
raises), so the engine must move every input, output, weight and cache row through tensor_set/get/copy."""
from __future__ import annotations

import numpy as np
import pytest

from llampy.ggml.backend import tensor_data
from llampy.ggml.backends.cpu.backend import CPUBackend
from llampy.llama.batch import Batch
from llampy.llama.context import Context
from llampy.llama.model import Model
from tests.ggml.fakes import DeviceBuffer, DeviceBufferType
from tests.paths import TINY

TINY_LLAMA = TINY / "llama-F32.gguf"


class DeviceCPU(CPUBackend):
    """The cpu kernels over device memory: its plans bind views of its own DeviceBuffers (as a GPU backend's
    kernels read its own memory); nobody else can."""

    def __init__(self, device, **kw):
        super().__init__(device, **kw)
        self._buft = DeviceBufferType(device, device)

    def _view(self, t):
        buf = t.storage.buffer
        assert isinstance(buf, DeviceBuffer) and buf.buft is self._buft, f"{t!r} is not in {self!r}'s memory"
        return buf.device_view(t)


def stand_ins(memory):
    return [CPUBackend("dev0"), CPUBackend("dev1")] if memory == "host" else [DeviceCPU("dev0"), DeviceCPU("dev1")]


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


@pytest.mark.parametrize("memory", ["host", "device"])
@pytest.mark.parametrize("n_gpu_layers,split", [(3, [1, 1]), (1, [1, 1]), (2, [1, 3]), (0, [1, 1])])
def test_tiny_llama_split_over_two_devices(n_gpu_layers, split, memory):
    ref, _ = logits(Model(TINY_LLAMA))
    devs = stand_ins(memory)
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
    on_device = [il for il in range(n_layer) if m.layer_backend[il] is not m.cpu]
    if memory == "device" and on_device:
        with pytest.raises(TypeError, match="not host memory"):
            tensor_data(ctx.kv.k[on_device[0]])


@pytest.mark.parametrize("use_mmap", [True, False])
def test_device_memory_state_save_load_and_k_shift(use_mmap):
    """State save/load and the K-shift graph on a cache in device memory give what they give on the CPU."""
    def run(m):
        ctx = Context(m, n_ctx=64)
        ctx.decode(Batch.from_tokens([1, 5, 9, 13, 2, 7]))
        state = ctx.state_save()
        ctx.seq_add(0, 2, -1, 3)
        ctx.decode(Batch.from_tokens([4], pos0=9))
        shifted = ctx.get_logits_ith(-1).copy()
        ctx2 = Context(m, n_ctx=64)
        ctx2.state_load(state)
        ctx2.decode(Batch.from_tokens([4], pos0=6))
        return state, shifted, ctx2.get_logits_ith(-1).copy()
    want = run(Model(TINY_LLAMA))
    devs = stand_ins("device")
    got = run(Model(TINY_LLAMA, n_gpu_layers=99, devices=devs, use_mmap=use_mmap))
    assert got[0] == want[0]
    assert np.array_equal(got[1], want[1]) and np.array_equal(got[2], want[2])


@pytest.mark.parametrize("memory", ["host", "device"])
def test_split_mode_row_splits_each_matrix_across_the_devices(memory):
    """llama.cpp's split_mode 'row': the offloaded layers run on main_gpu, which holds their norms and KV cache,
    and each matrix of a layer's products is split by rows in tensor_split's shares (ggml/split.py): every device
    computes its rows (in device memory, only it can read them) and the main device gathers them. The logits
    equal a single-device run bit for bit."""
    ref, _ = logits(Model(TINY_LLAMA))
    devs = stand_ins(memory)
    m = Model(TINY_LLAMA, n_gpu_layers=-1, devices=devs, split_mode="row", tensor_split=[1, 3], main_gpu=1)
    assert all(b is devs[1] for b in m.layer_backend)
    w = m.tensors["blk.0.ffn_up.weight"]
    assert [(b.device, r0, r1) for b, _, r0, r1 in w.buffer.parts_of(w)] == [("dev0", 0, 64), ("dev1", 64, 256)]
    assert m.tensors["blk.0.attn_norm.weight"].buffer.buft.device == "dev1"
    got, ctx = logits(m)
    assert np.array_equal(got, ref)
    assert all(k.buffer.buft.device == "dev1" for k in ctx.kv.k)
    p = ctx.sched._last
    on = {n.name: sp.backend.device for sp in p.splits for n in sp.nodes}
    slices = [k for k in on if "]@dev" in k]
    assert len(slices) == 2 * 7 * m.hparams.n_layer          # q k v output gate up down, on both devices
    assert all(on[k] == k.rsplit("@", 1)[1] for k in slices)


def test_split_mode_none_uses_the_first_device():
    devs = [CPUBackend("dev0"), CPUBackend("dev1")]
    m = Model(TINY_LLAMA, n_gpu_layers=99, devices=devs, split_mode="none")
    assert all(b is devs[0] for b in m.layer_backend)


def test_bad_tensor_split_is_an_error():
    with pytest.raises(ValueError, match="tensor_split"):
        Model(TINY_LLAMA, n_gpu_layers=2, devices=[CPUBackend("dev0"), CPUBackend("dev1")], tensor_split=[1, 1, 1])


@pytest.mark.slow
@pytest.mark.parametrize("memory", ["host", "device"])
def test_smollm2_three_quarters_offloaded(smollm2_path, memory):
    devs = stand_ins(memory)
    m = Model(smollm2_path, n_gpu_layers=23, devices=devs, tensor_split=[3, 1])
    want = llamacpp_layers(m.hparams.n_layer, 23, [3, 1])
    assert [None if b is m.cpu else devs.index(b) for b in m.layer_backend] == want
    ctx = Context(m, n_ctx=64)
    ctx.decode(Batch.from_tokens([1, 504, 3458, 282, 4649, 314]))
    split_logits = ctx.get_logits_ith(-1).copy()
    ctx1 = Context(Model(smollm2_path), n_ctx=64)
    ctx1.decode(Batch.from_tokens([1, 504, 3458, 282, 4649, 314]))
    assert np.array_equal(split_logits, ctx1.get_logits_ith(-1))
