"""LoRA adapters applied at run time: against libllama applying the same adapters (llama_set_adapters_lora), and
against a model whose weights hold the merged product W + s * B @ A."""
from __future__ import annotations

import numpy as np
import pytest

from llampy.ggml.types import GGMLType
from llampy.gguf import GGUFReader, GGUFWriter
from llampy.llama.api import Llama
from llampy.llama.batch import Batch
from llampy.llama.context import Context
from llampy.llama.lora import LoraAdapter, LoraError
from llampy.llama.model import Model

from tests.paths import TINY

TOKENS = [1, 5, 9, 13, 2, 7, 300, 4000, 17, 12]
TARGETS = ["attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down"]


def log_softmax(x):
    x = x.astype(np.float64)
    m = x.max(axis=-1, keepdims=True)
    return x - m - np.log(np.exp(x - m).sum(axis=-1, keepdims=True))


def random_pairs(model_path, rank: int, seed: int, std: float = 0.3, embd: bool = True) -> dict:
    """{weight name: (A, B)} in NumPy order (A [rank, n_in], B [n_out, rank]; the token embedding's flipped:
    A [n_vocab, rank], B [n_embd, rank]) for every targeted weight of the model."""
    rng = np.random.default_rng(seed)
    out = {}
    with GGUFReader(model_path) as r:
        for name, t in r.tensors.items():
            if name.split(".")[-2] in TARGETS and name.endswith(".weight"):
                n_in, n_out = t.ne[0], t.ne[1]
                out[name] = (rng.normal(0, std / np.sqrt(n_in), (rank, n_in)).astype(np.float32),
                             rng.normal(0, 1.0 / np.sqrt(rank), (n_out, rank)).astype(np.float32))
        if embd:
            n_embd, n_vocab = r.tensors["token_embd.weight"].ne[:2]
            out["token_embd.weight"] = (rng.normal(0, 0.02, (n_vocab, rank)).astype(np.float32),
                                        rng.normal(0, 1.0, (n_embd, rank)).astype(np.float32))
    return out


def write_lora(path, arch: str, pairs: dict, alpha: float = 0.0, type=GGMLType.F32):
    w = GGUFWriter(path)
    w.add("general.architecture", arch)
    w.add("general.type", "adapter")
    w.add("adapter.type", "lora")
    w.add("adapter.lora.alpha", float(alpha))
    for name, (a, b) in pairs.items():
        dt = np.float16 if type == GGMLType.F16 else np.float32
        w.add_tensor(f"{name}.lora_a", a.astype(dt))
        w.add_tensor(f"{name}.lora_b", b.astype(dt))
    w.write()
    return path


def llampy_logits(model, loras=()) -> np.ndarray:
    ctx = Context(model, n_ctx=64)
    ctx.set_loras(loras)
    ctx.decode(Batch.from_tokens(TOKENS, logits_all=True))
    return np.array([ctx.get_logits_ith(i).copy() for i in range(len(TOKENS))])


def test_two_adapters_match_libllama(tmp_path):
    from tests.llamacpp_run import llamacpp_logits
    src = TINY / "qwen2-Q8_0.gguf"
    # no token_embd pair: with the head tied to the embedding libllama would apply it to the head too, flipped,
    # and abort (ggml_can_mul_mat)
    a1 = write_lora(tmp_path / "a1.gguf", "qwen2", random_pairs(src, 4, 1, embd=False), alpha=8.0)
    a2 = write_lora(tmp_path / "a2.gguf", "qwen2", random_pairs(src, 2, 2, embd=False), type=GGMLType.F16)
    model = Model(src)
    loras = [(LoraAdapter(model, a1), 0.7), (LoraAdapter(model, a2), 1.5)]
    ours = log_softmax(llampy_logits(model, loras))
    ref = log_softmax(llamacpp_logits(src, TOKENS, [(a1, 0.7), (a2, 1.5)]))
    base = log_softmax(llamacpp_logits(src, TOKENS))
    assert np.abs(ref - base).max() > 1.0               # the adapters change the model a lot
    top = np.argsort(-ref, axis=-1)[:, :10]
    err = np.abs(np.take_along_axis(ours, top, -1) - np.take_along_axis(ref, top, -1)).max()
    assert err <= 1e-3, f"max |dlogprob| over the top 10: {err:.2e}"


def write_merged(src, pairs: dict, k: float, path):
    """``src`` with W + k * B @ A written into its weights (the output head, tied to the embedding, kept as it was)."""
    with GGUFReader(src) as r:
        w = GGUFWriter(path)
        for key, v in r.metadata.items():
            w.add(key, v, r.value_types[key])
        for name in r.tensors:
            arr = r.tensor_array(name).astype(np.float32)
            if name in pairs:
                a, b = pairs[name]
                arr = arr + k * (a @ b.T if name == "token_embd.weight" else b @ a)
            w.add_tensor(name, arr)
        w.add_tensor("output.weight", r.tensor_array("token_embd.weight").copy())
        w.write()
    return path


def test_adapter_equals_merged_weights(tmp_path):
    """llama-F32 with an adapter at scale s against the same model with W + s * alpha/rank * B @ A written into
    its weights (the output head, tied to the embedding, is kept as it was)."""
    src, rank, alpha, s = TINY / "llama-F32.gguf", 4, 6.0, 0.8
    pairs = random_pairs(src, rank, 3)
    path = write_lora(tmp_path / "a.gguf", "llama", pairs, alpha=alpha)
    write_merged(src, pairs, s * alpha / rank, tmp_path / "merged.gguf")
    model = Model(src)
    ours = llampy_logits(model, [(LoraAdapter(model, path), s)])
    merged = llampy_logits(Model(tmp_path / "merged.gguf"))
    base = llampy_logits(model)
    assert np.abs(merged - base).max() > 1.0
    np.testing.assert_allclose(ours, merged, atol=2e-3 * np.abs(merged).max())


def test_perplexity_and_bench_lora_flags(tmp_path, capsys):
    """`perplexity --lora-scaled` scores as the merged model does (not as the base); `bench --lora` loads the adapter
    for the model (a file that is not one is refused) and runs with it."""
    import json
    import re
    from llampy.cli import main
    src, s = TINY / "llama-F32.gguf", 0.5
    pairs = random_pairs(src, 4, 7, std=0.1)
    path = write_lora(tmp_path / "a.gguf", "llama", pairs)
    merged = write_merged(src, pairs, s, tmp_path / "merged.gguf")
    text = tmp_path / "t.txt"
    text.write_text("The quick brown fox jumps over the lazy dog. " * 12)
    ppl = {}
    for name, model, extra in (("lora", src, ["--lora-scaled", str(path), str(s)]), ("merged", merged, []),
                               ("base", src, [])):
        assert main(["perplexity", str(model), "-f", str(text), "-c", "32", "--chunks", "2", "-ngl", "0",
                     *extra]) == 0
        ppl[name] = float(re.search(r"PPL = ([0-9.]+)", capsys.readouterr().out).group(1))
    assert abs(ppl["lora"] - ppl["merged"]) < 1e-3 * ppl["merged"]
    assert abs(ppl["base"] - ppl["merged"]) > 1e-2 * ppl["merged"]
    assert main(["bench", str(src), "-p", "8", "-n", "2", "-r", "1", "-ngl", "0", "--json", "--lora", str(path)]) == 0
    assert [r["n_prompt"] + r["n_gen"] for r in json.loads(capsys.readouterr().out)] == [8, 2]
    assert main(["bench", str(src), "-p", "8", "-n", "0", "-r", "1", "-ngl", "0", "--lora", str(src)]) == 1
    assert "general.type" in capsys.readouterr().err


def test_output_head_pair_matches_libllama(tmp_path):
    """An untied output head takes its adapter pair (build_lora_mm on model.output), as libllama does."""
    from tests.llamacpp_run import llamacpp_logits
    src, untied = TINY / "llama-F32.gguf", tmp_path / "untied.gguf"
    with GGUFReader(src) as r:
        w = GGUFWriter(untied)
        for key, v in r.metadata.items():
            w.add(key, v, r.value_types[key])
        for name in r.tensors:
            w.add_tensor(name, r.tensor_array(name))
        emb = r.tensor_array("token_embd.weight").astype(np.float32)
        w.add_tensor("output.weight", emb * np.float32(0.5) + np.float32(0.01))
        w.write()
    rng = np.random.default_rng(6)
    n_vocab, n_embd = emb.shape
    pairs = {"output.weight": (rng.normal(0, 0.05, (4, n_embd)).astype(np.float32),
                               rng.normal(0, 0.1, (n_vocab, 4)).astype(np.float32))}
    path = write_lora(tmp_path / "head.gguf", "llama", pairs, alpha=4.0)
    model = Model(untied)
    # what the adapter adds to the logits, each side against its own base (the base logits of this F32 fixture
    # already differ by ~2e-3 between the two)
    ours = llampy_logits(model, [(LoraAdapter(model, path), 0.9)]) - llampy_logits(model)
    ref = llamacpp_logits(untied, TOKENS, [(path, 0.9)]) - llamacpp_logits(untied, TOKENS)
    assert np.abs(ref).max() > 1.0
    np.testing.assert_allclose(ours, ref, atol=1e-3 * np.abs(ref).max())


def test_llama_api_and_scales(tmp_path):
    src = TINY / "qwen2-Q8_0.gguf"
    path = write_lora(tmp_path / "a.gguf", "qwen2", random_pairs(src, 4, 5))
    base = Llama(str(src), n_ctx=64, tune_process=False)
    llm = Llama(str(src), n_ctx=64, tune_process=False, lora_path=str(path), lora_scale=0.5)
    model = Model(src)
    want = llampy_logits(model, [(LoraAdapter(model, path), 0.5)])

    def last_logits(l):
        l.reset()
        l.ctx.decode(Batch.from_tokens(TOKENS))
        return l.ctx.get_logits_ith(-1).copy()
    np.testing.assert_array_equal(last_logits(llm), want[-1])
    llm.set_lora_scales([0.0])
    np.testing.assert_array_equal(last_logits(llm), last_logits(base))
    with pytest.raises(ValueError):
        llm.set_lora_scales([1.0, 2.0])


def test_bad_adapters_are_refused(tmp_path):
    src = TINY / "qwen2-Q8_0.gguf"
    model = Model(src)
    pairs = random_pairs(src, 4, 6, embd=False)
    with pytest.raises(LoraError, match="adapter for 'llama'"):
        LoraAdapter(model, write_lora(tmp_path / "arch.gguf", "llama", pairs))
    bad = dict(pairs)
    bad["blk.7.attn_q.weight"] = bad.pop("blk.0.attn_q.weight")
    with pytest.raises(LoraError, match="does not exist in the base model"):
        LoraAdapter(model, write_lora(tmp_path / "missing.gguf", "qwen2", bad))
    a, b = pairs["blk.0.attn_q.weight"]
    with pytest.raises(LoraError, match="incorrect shape"):
        LoraAdapter(model, write_lora(tmp_path / "shape.gguf", "qwen2", {"blk.0.attn_q.weight": (a[:, :32], b)}))
    with pytest.raises(LoraError, match="general.type"):
        LoraAdapter(model, src)


def test_cli_lora_flags(tmp_path, capsys):
    import json
    from llampy.cli import main
    src = TINY / "qwen2-Q8_0.gguf"
    path = write_lora(tmp_path / "a.gguf", "qwen2", random_pairs(src, 4, 5))
    runs = {}
    for name, extra in (("lora", ["--lora-scaled", str(path), "1.0"]), ("lora1", ["--lora", str(path)]),
                        ("base", [])):
        assert main(["run", str(src), "-p", "hello there", "-n", "6", "--temp", "0", "-ngl", "0", "--json",
                     *extra]) == 0
        runs[name] = json.loads(capsys.readouterr().out.strip().splitlines()[-1])["tokens"]
    assert runs["lora"] == runs["lora1"] != runs["base"]
    llm = Llama(str(src), n_ctx=64, tune_process=False, lora_path=str(path))
    want = llm.create_completion("hello there", max_tokens=6, temperature=0)["choices"][0]["text"]
    assert llm.detokenize(runs["lora"]).decode("utf-8", "replace") == want
    assert main(["run", str(src), "-p", "x", "-n", "1", "-ngl", "0", "--lora", str(src)]) == 1
    assert "general.type" in capsys.readouterr().err
