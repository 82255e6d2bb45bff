"""Models on the CUDA backend: the tiny random-weight models of ../shared/fixtures/tiny with every layer offloaded
(and half of them) against llama.cpp's own log-probs, the KV cache of each layer on its layer's device, -ot
overrides, automatic fit, and on a GPU the real models' greedy tokens equal to the CPU backend's."""
from __future__ import annotations

import json

import numpy as np
import pytest

from llampy.ggml.types import GGMLType
from llampy.llama.batch import Batch
from llampy.llama.context import Context
from llampy.llama.devices import fit_layers
from llampy.llama.model import Model

from tests.paths import TINY

# the architectures whose graphs differ most: plain llama (F32 weights), GQA + biases (qwen2), q/k norms (qwen3),
# softcapping and sliding windows (gemma2), MoE experts (qwen3moe)
MODELS = ["llama-F32", "qwen2-Q8_0", "qwen3-Q8_0", "gemma2-Q8_0", "qwen3moe-Q8_0"]
# The GPU rounds activations before quantized products as llama.cpp does, so a first token (attention over one
# cell) gives the CPU backend's logits. Over several cells ggml-cpu's attention accumulates V in F16 after every
# multiply-add (its one_chunk path, which made the fixtures); the GPU's attention accumulates in float32 (as
# ggml-cuda's). The tiny models' peaked logits (std 6, final norm weights 15-75) magnify that 3e-4 relative
# difference in attention output to up to 0.4 nats; greedy steps with a clear margin must still agree.
TOL_FIRST = 1e-3
TOL = 0.6
CLEAR = 1.0


def log_softmax(x):
    x = x.astype(np.float64)
    m = x.max(axis=-1, keepdims=True)
    return x - m - np.log(np.exp(x - m).sum(axis=-1, keepdims=True))


def worst_logprob_error(model, ref) -> float:
    """The largest log-prob difference from llama.cpp's over one prompt, teacher-forced; the argmax
    must equal llama.cpp's greedy token wherever its top two are CLEAR apart."""
    worst = 0.0
    for p in ref["prompts"][1:2]:          # the 21-token story opening
        toks = p["prompt_ids"] + p["ids"]
        ctx = Context(model, n_ctx=256, n_batch=256, n_ubatch=256)
        ctx.decode(Batch.from_tokens(toks, logits_all=True))
        lp = log_softmax(ctx.get_logits())
        n_p = len(p["prompt_ids"])
        for k, step in enumerate(p["steps"]):
            row = lp[n_p - 1 + k]
            for tid, ref_lp in step["top"]:
                worst = max(worst, abs(row[tid] - ref_lp))
            top = step["top"]
            if top[0][1] - top[1][1] > CLEAR:
                assert int(np.argmax(row)) == step["id"], f"step {k}: argmax differs"
    return worst


def first_token_logits(model, tok=5):
    ctx = Context(model, n_ctx=64)
    ctx.decode(Batch.from_tokens([tok]))
    return ctx.get_logits_ith(-1).astype(np.float64)


@pytest.mark.parametrize("name,ngl", [(m, "all") for m in MODELS] + [("qwen2-Q8_0", "half"), ("gemma2-Q8_0", "half")])
def test_tiny_models_offloaded_match_llamacpp(name, ngl):
    ref = json.loads((TINY / f"{name}.json").read_text())
    probe = Model(TINY / f"{name}.gguf", vocab_only=True)
    n = -1 if ngl == "all" else probe.hparams.n_layer // 2
    m = Model(TINY / f"{name}.gguf", n_gpu_layers=n)
    assert m.devices and m.devices[0].name == "cuda"
    on_gpu = [il for il, b in enumerate(m.layer_backend) if b is m.devices[0]]
    assert len(on_gpu) == (m.hparams.n_layer + 1 if ngl == "all" else n)
    cpu = first_token_logits(Model(TINY / f"{name}.gguf"))
    gpu = first_token_logits(m)
    assert np.abs(log_softmax(gpu) - log_softmax(cpu)).max() <= TOL_FIRST
    err = worst_logprob_error(m, ref)
    print(f"{name} ngl={ngl}: max |dlogprob| {err:.4f}")
    assert err <= TOL, f"{name} ngl={ngl}: max |dlogprob| {err:.4f}"


def test_kv_cache_and_weights_live_on_their_layers_device():
    m = Model(TINY / "qwen2-Q8_0.gguf", n_gpu_layers=2)          # the output head and the last layer
    ctx = Context(m, n_ctx=64)
    last = m.hparams.n_layer - 1
    dev = m.devices[0]
    for name, t in m.tensors.items():
        want = dev if name.startswith((f"blk.{last}.", "output")) else m.cpu
        assert want.supports_buffer(t.storage.buffer), name
    # the head is tied to the token embedding: a copy of it lives on the device, the embedding stays on the CPU
    assert m.output is not m.tok_embd and dev.supports_buffer(m.output.storage.buffer)
    assert m.cpu.supports_buffer(m.tok_embd.storage.buffer)
    for il in range(m.hparams.n_layer):
        k = ctx.kv.k[il]
        assert (dev if il == last else m.cpu).supports_buffer(k.storage.buffer)


def test_override_tensor_keeps_matching_weights_on_the_cpu():
    m = Model(TINY / "qwen3moe-Q8_0.gguf", n_gpu_layers=-1, override_tensor="ffn_.*_exps=CPU")
    exps = [n for n in m.tensors if "_exps" in n]
    assert exps
    for name, t in m.tensors.items():
        on_cpu = m.cpu.supports_buffer(t.storage.buffer)
        assert on_cpu == ("_exps" in name or name == "token_embd.weight"), name
    assert m.devices[0].supports_buffer(m.output.storage.buffer)
    ref = json.loads((TINY / "qwen3moe-Q8_0.json").read_text())
    assert worst_logprob_error(m, ref) <= TOL


def test_bad_override_is_a_clear_error():
    with pytest.raises(ValueError, match="REGEX=BUFTYPE"):
        Model(TINY / "qwen2-Q8_0.gguf", n_gpu_layers=-1, override_tensor="no-equals-sign")
    with pytest.raises(ValueError, match="unknown buffer type"):
        Model(TINY / "qwen2-Q8_0.gguf", n_gpu_layers=-1, override_tensor="attn=TPU0")


def test_auto_fit_counts_layers_from_the_top():
    m = Model(TINY / "qwen2-Q8_0.gguf", vocab_only=True)
    n_layer = m.hparams.n_layer
    sizes = {}
    for name, info in m.reader.tensors.items():
        if name.startswith("blk."):
            il = int(name.split(".")[1])
            sizes[il] = sizes.get(il, 0) + info.nbytes
    everything = fit_layers(m.reader, n_layer, 1000, 1 << 40)
    assert everything.n_gpu_layers == n_layer + 1
    head = everything.layer_bytes - sum(sizes.values()) - 1000 * n_layer
    # room for the head and exactly one layer (plus the compute reserve)
    from llampy.llama.devices import COMPUTE_RESERVE
    one = fit_layers(m.reader, n_layer, 1000, COMPUTE_RESERVE + head + sizes[n_layer - 1] + 1000)
    assert one.n_gpu_layers == 2
    none = fit_layers(m.reader, n_layer, 1000, COMPUTE_RESERVE)
    assert none.n_gpu_layers == 0
    auto = Model(TINY / "qwen2-Q8_0.gguf", n_gpu_layers="auto")
    assert auto.n_gpu_layers == n_layer + 1           # the interpreter's "device" (or a GPU) holds a tiny model


def real_model_path(which: str):
    """The real model's file: from LLAMPY_REAL_MODELS (the folder benchmarks/gpu_carry.py assembles the files in on a
    GPU machine: smollm2.gguf, gemma3.gguf) where set, else from its package."""
    import os
    from pathlib import Path
    from llampy.models import ModelNotFound, resolve_model
    carried = os.environ.get("LLAMPY_REAL_MODELS")
    if carried:
        path = Path(carried) / f"{which}.gguf"
        if not path.is_file():
            pytest.skip(f"{path} was not carried (benchmarks/gpu_carry.py)")
        return path
    try:
        return resolve_model(which)
    except ModelNotFound as e:
        pytest.skip(str(e))


@pytest.mark.skipif(not __import__("torch").cuda.is_available(), reason="real models in the Triton interpreter "
                    "would take hours: run on a GPU (make test-cuda there)")
@pytest.mark.parametrize("which", ["smollm2", "gemma3"])
def test_real_models_greedy_tokens_equal_the_cpu_backends(which):
    path = real_model_path(which)
    prompt = "The capital of France is"

    def greedy(model, n=24):
        ctx = Context(model, n_ctx=256)
        toks = model.vocab.tokenize(prompt, add_special=True, parse_special=True)
        ctx.decode(Batch.from_tokens(toks))
        out, lps = [], []
        for i in range(n):
            row = ctx.get_logits_ith(-1)
            t = int(np.argmax(row))
            out.append(t)
            lps.append(log_softmax(row)[t])
            ctx.decode(Batch.from_tokens([t], pos0=len(toks) + i))
        return out, np.array(lps)

    cpu_toks, cpu_lp = greedy(Model(path))
    gpu_toks, gpu_lp = greedy(Model(path, n_gpu_layers=-1))
    from benchmarks.gpu_targets import real_model_line
    # the line benchmarks/gpu_targets.py reads (gpu_check.sh runs this with -s)
    print("\n" + real_model_line(which, [a == b for a, b in zip(gpu_toks, cpu_toks)], np.abs(gpu_lp - cpu_lp).max()))
    assert gpu_toks == cpu_toks
    assert np.abs(gpu_lp - cpu_lp).max() <= 0.05


def test_quantized_kv_cache_on_the_gpu_follows_the_cpu(tmp_path):
    """A block-format KV cache (-ctk/-ctv) lives on the GPU with its layers: the prompt (attention over dense
    copies) and decode steps (attention reading the blocks in place) give the CPU backend's top log-probs within
    the offload tolerance (the same as an F16 cache's; see TOL), with the same cache types, and its argmax where
    the CPU's top two are clear apart. A type
    the device cannot store is a clear error. (A random llama with heads of 32: the fixtures' heads of 16 are not
    whole blocks: the tiny qwen2 read as 2 heads of 32 over 1 KV head.)"""
    from llampy.ggml.types import GGMLType
    from llampy.gguf import GGUFReader, GGUFWriter
    from llampy.llama.context import ContextError
    path = tmp_path / "heads32.gguf"
    r = GGUFReader(TINY / "qwen2-Q8_0.gguf")
    w = GGUFWriter.from_reader(r, path)
    heads = {"qwen2.attention.head_count": 2, "qwen2.attention.head_count_kv": 1}
    w.kv = [(k, heads.get(k, v), ty) for k, v, ty in w.kv]
    emb = r.tensors["token_embd.weight"]            # an untied head, so that -ot keeps it on the CPU (the
    w.add_tensor_raw("output.weight", emb.type, emb.ne, emb.data)   # interpreter's 49152-row products are slow)
    w.write()
    ref = json.loads((TINY / "qwen2-Q8_0.json").read_text())
    toks = ref["prompts"][1]["prompt_ids"] + ref["prompts"][1]["ids"]
    runs = {}
    for ngl in (0, -1):         # the layers (and their cache) offloaded, the head kept on the CPU
        m = Model(path, n_gpu_layers=ngl, override_tensor="output=CPU")
        ctx = Context(m, n_ctx=64, type_k=GGMLType.Q8_0, type_v=GGMLType.Q4_0)
        if ngl:
            assert all(m.devices[0].supports_buffer(k.storage.buffer) for k in ctx.kv.k + ctx.kv.v if k is not None)
        ctx.decode(Batch.from_tokens(toks[:20], logits_all=True))
        rows = [log_softmax(ctx.get_logits())]
        for i in range(20, 24):            # one token at a time: the decode kernel
            ctx.decode(Batch.from_tokens([toks[i]], pos0=i))
            rows.append(log_softmax(ctx.get_logits()))
        runs[ngl] = np.concatenate(rows)
    cpu, gpu = runs[0], runs[-1]
    top = np.argsort(cpu, axis=-1)[:, -5:]
    assert np.abs(np.take_along_axis(gpu, top, -1) - np.take_along_axis(cpu, top, -1)).max() <= TOL
    top2 = np.sort(cpu, axis=-1)[:, -2:]
    clear = top2[:, 1] - top2[:, 0] > CLEAR
    assert clear.sum() >= 4 and (np.argmax(gpu, -1) == np.argmax(cpu, -1))[clear].all()
    m = Model(path, n_gpu_layers=-1)
    with pytest.raises(ContextError, match="IQ4_NL KV cache is not supported on cuda"):
        Context(m, n_ctx=64, type_k=GGMLType.IQ4_NL, type_v=GGMLType.IQ4_NL)


def test_norms_quantize_for_their_decode_products(monkeypatch):
    """In a decode step, an RMS norm whose integer-kernel products all take one block size writes their int8
    activations itself (one launch less per norm): the logits are the unfused step's, bit for bit, and the
    products' own quantization launches are gone."""
    from llampy.ggml.backends.cuda import backend as CB
    from llampy.ggml.backends.cuda import mmvq as MMVQ
    from .helpers import count_launches
    launches = count_launches(monkeypatch, MMVQ, "quantize_act")
    out = {}
    for fused in (True, False):
        if not fused:
            monkeypatch.setattr(CB.CUDABackend, "_norm_quant_plan", lambda self, nodes: {})
        m = Model(TINY / "qwen2-Q8_0.gguf", n_gpu_layers=-1)
        ctx = Context(m, n_ctx=64)
        ctx.decode(Batch.from_tokens([5, 6, 7]))
        launches.clear()
        ctx.decode(Batch.from_tokens([8], pos0=3))
        out[fused] = ctx.get_logits_ith(-1).copy(), len(launches)
    np.testing.assert_array_equal(out[True][0], out[False][0])
    # per layer the attention norm (q, k, v) and the FFN norm (gate, up), then the output norm: 5 fewer
    assert out[False][1] - out[True][1] == 2 * 2 + 1


def test_rope_writes_k_into_the_cache(monkeypatch):
    """K's rope rotates each new row straight into the KV cache (one launch for the rope and the store of K, not
    two; here a BF16 K, rounded as set_rows rounds), for a prompt and a decode step: the logits and the cache's
    bytes are the unfused graph's, bit for bit, and each layer's K store launch is gone. (The output head stays on
    the CPU: the interpreter's time.)"""
    from llampy.ggml.backend import tensor_get_bytes
    from llampy.ggml.backends.cuda import backend as CB
    from llampy.ggml.backends.cuda import kernels as K
    from .helpers import count_launches
    stores = count_launches(monkeypatch, K, "set_rows")
    out = {}
    m = Model(TINY / "qwen2-Q8_0.gguf", n_gpu_layers=-1, override_tensor="token_embd|output=CPU")
    for fused in (True, False):
        if not fused:
            monkeypatch.setattr(CB, "_rope_stores", lambda nodes: {})
        ctx = Context(m, n_ctx=64, type_k=GGMLType.BF16)
        ctx.decode(Batch.from_tokens([5, 6]))
        stores.clear()
        ctx.decode(Batch.from_tokens([8], pos0=2))
        out[fused] = (ctx.get_logits_ith(-1).copy(), len(stores),
                      [tensor_get_bytes(k).copy() for k in ctx.kv.k])
    np.testing.assert_array_equal(out[True][0], out[False][0])
    for a, b in zip(out[True][2], out[False][2]):
        np.testing.assert_array_equal(a, b)
    n_layer = len(out[True][2])
    assert out[False][1] == 2 * n_layer and out[True][1] == n_layer      # K and V stores; V's alone
