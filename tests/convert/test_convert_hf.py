"""llampy convert on tiny Hugging Face checkpoints written here (safetensors by hand, a BPE tokenizer.json trained
with the tokenizers library): the file's metadata and vocabulary, logits against a NumPy forward pass written the
way transformers computes these models, and libllama loading the file and agreeing with llampy. (The checkpoint's
directory is never named after its architecture: libllama gives models named phi3 special-token rules that look
up SentencePiece tokens.)"""
from __future__ import annotations

import json
import struct

import numpy as np
import pytest

from llampy.cli import main
from llampy.ggml.types import GGMLType
from llampy.gguf import GGUFReader
from llampy.convert.files import read_safetensors
from llampy.llama.batch import Batch
from llampy.llama.context import Context
from llampy.llama.model import Model

N_EMBD, N_HEAD, N_HEAD_KV, N_FF, N_LAYER = 64, 4, 2, 128, 2
LN_BIAS = ("starcoder2", "phi2")      # LayerNorm with biases, a plain GELU MLP with biases
HEAD_DIM = N_EMBD // N_HEAD
CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
TEXT = "the quick brown fox jumps over the lazy dog while the cat sleeps in the sun"


def write_safetensors(path, tensors: dict[str, np.ndarray], dtype: str = "F32"):
    header, blobs, off = {}, [], 0
    for name, a in tensors.items():
        if dtype == "BF16":
            raw = (np.ascontiguousarray(a, np.float32).view(np.uint32) >> 16).astype("<u2").tobytes()
        else:
            raw = np.ascontiguousarray(a, {"F32": "<f4", "F16": "<f2"}[dtype]).tobytes()
        header[name] = {"dtype": dtype, "shape": list(a.shape), "data_offsets": [off, off + len(raw)]}
        blobs.append(raw)
        off += len(raw)
    h = json.dumps(header).encode()
    h += b" " * ((-len(h)) % 8)
    path.write_bytes(struct.pack("<Q", len(h)) + h + b"".join(blobs))


def write_tokenizer(d):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    tr = trainers.BpeTrainer(vocab_size=400, special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
                             initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator([TEXT] * 20 + ["Hello, world! 123 4567 ... ok?"] * 5, tr)
    tok.save(str(d / "tokenizer.json"))
    (d / "tokenizer_config.json").write_text(json.dumps({
        "bos_token": None, "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>", "unk_token": "<|endoftext|>",
        "add_bos_token": False, "chat_template": CHATML}))
    return tok


GEMMA = ("gemma2", "gemma3")
HF_ARCH = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM",
           "gemma2": "Gemma2ForCausalLM", "gemma3": "Gemma3ForCausalLM", "phi3": "Phi3ForCausalLM",
           "qwen3moe": "Qwen3MoeForCausalLM", "granite": "GraniteForCausalLM", "starcoder2": "Starcoder2ForCausalLM",
           "smollm3": "SmolLM3ForCausalLM", "olmo2": "Olmo2ForCausalLM", "mixtral": "MixtralForCausalLM",
           "phi2": "PhiForCausalLM", "command-r": "CohereForCausalLM",
           "cohere2": "Cohere2ForCausalLM"}
COHERE = ("command-r", "cohere2")
GGUF_ARCH = {"mixtral": "llama"}
MOE = ("qwen3moe", "mixtral")
N_EXPERT, N_USED, N_FF_EXP = 4, 2, 32


def _gguf_py_keys() -> set:
    """Every metadata key gguf-py's constants name ({arch}. for the architecture's prefix): what llama.cpp's
    converter writes and its loader looks up."""
    from gguf.constants import Keys
    return {v for grp in vars(Keys).values() if isinstance(grp, type)
            for k, v in vars(grp).items() if isinstance(v, str) and not k.startswith("_")}


GGUF_PY_KEYS = _gguf_py_keys()


def n_layers(arch: str) -> int:
    # gemma3: five sliding-window layers, then a global one; smollm3: every fourth layer without RoPE
    return {"gemma3": 6, "smollm3": 4, "cohere2": 4}.get(arch, N_LAYER)


def n_kv(arch: str) -> int:
    return N_HEAD if arch == "phi2" else N_HEAD_KV     # llama.cpp writes phi2's KV heads as its heads


def hf_file_name(arch: str, name: str) -> str:
    if arch == "phi2":
        for a, b in ((".self_attn.o_proj.", ".self_attn.dense."), ("model.norm.", "model.final_layernorm."),
                     (".mlp.c_fc.", ".mlp.fc1."), (".mlp.c_proj.", ".mlp.fc2.")):
            name = name.replace(a, b)
    if arch != "mixtral":
        return name
    name = name.replace(".mlp.gate.", ".block_sparse_moe.gate.").replace(".mlp.experts.", ".block_sparse_moe.experts.")
    return name.replace(".gate_proj.", ".w1.").replace(".down_proj.", ".w2.").replace(".up_proj.", ".w3.")


def make_checkpoint(d, arch: str, tied: bool, dtype: str = "F32", seed: int = 0):
    d.mkdir(parents=True, exist_ok=True)
    tok = write_tokenizer(d)
    n_vocab = tok.get_vocab_size()
    rng = np.random.default_rng(seed)

    def lin(n_out, n_in):
        return rng.normal(0, 1 / np.sqrt(n_in), (n_out, n_in)).astype(np.float32)
    one = 0.0 if arch in GEMMA else 1.0       # Gemma's norms hold weight - 1

    def norm(n):
        return (one + rng.normal(0, 0.1, n)).astype(np.float32)
    embd_std = 0.1 if arch in GEMMA else 0.5
    t = {"model.embed_tokens.weight": rng.normal(0, embd_std, (n_vocab, N_EMBD)).astype(np.float32),
         "model.norm.weight": norm(N_EMBD)}
    if not tied:
        t["lm_head.weight"] = lin(n_vocab, N_EMBD)
    if arch in LN_BIAS:
        t["model.norm.bias"] = rng.normal(0, 0.1, N_EMBD).astype(np.float32)
    if arch == "phi2":
        t["lm_head.bias"] = rng.normal(0, 0.1, n_vocab).astype(np.float32)
    for il in range(n_layers(arch)):
        p = f"model.layers.{il}."
        t[p + "input_layernorm.weight"] = norm(N_EMBD)
        t[p + "post_attention_layernorm.weight"] = norm(N_EMBD)
        if arch in GEMMA:
            t[p + "pre_feedforward_layernorm.weight"] = norm(N_EMBD)
            t[p + "post_feedforward_layernorm.weight"] = norm(N_EMBD)
        if arch == "phi3":
            t[p + "self_attn.qkv_proj.weight"] = lin((N_HEAD + 2 * N_HEAD_KV) * HEAD_DIM, N_EMBD)
        else:
            t[p + "self_attn.q_proj.weight"] = lin(N_HEAD * HEAD_DIM, N_EMBD)
            t[p + "self_attn.k_proj.weight"] = lin(n_kv(arch) * HEAD_DIM, N_EMBD)
            t[p + "self_attn.v_proj.weight"] = lin(n_kv(arch) * HEAD_DIM, N_EMBD)
        t[p + "self_attn.o_proj.weight"] = lin(N_EMBD, N_HEAD * HEAD_DIM)
        if arch in LN_BIAS:
            for key, n in (("input_layernorm", N_EMBD), ("post_attention_layernorm", N_EMBD),
                           ("self_attn.o_proj", N_EMBD)):
                t[p + f"{key}.bias"] = rng.normal(0, 0.1, n).astype(np.float32)
            n_ff = 4 * N_EMBD if arch == "phi2" else N_FF
            t[p + "mlp.c_fc.weight"] = lin(n_ff, N_EMBD)
            t[p + "mlp.c_fc.bias"] = rng.normal(0, 0.1, n_ff).astype(np.float32)
            t[p + "mlp.c_proj.weight"] = lin(N_EMBD, n_ff)
            t[p + "mlp.c_proj.bias"] = rng.normal(0, 0.1, N_EMBD).astype(np.float32)
        if arch == "phi2":              # one norm feeds attention and the MLP, in parallel
            del t[p + "post_attention_layernorm.weight"], t[p + "post_attention_layernorm.bias"]
        if arch in COHERE:              # likewise, a LayerNorm without bias
            del t[p + "post_attention_layernorm.weight"]
        if arch in ("qwen2", "starcoder2", "phi2"):
            for x, n in (("q", N_HEAD), ("k", n_kv(arch)), ("v", n_kv(arch))):
                t[p + f"self_attn.{x}_proj.bias"] = rng.normal(0, 0.3, n * HEAD_DIM).astype(np.float32)
        if arch in ("qwen3", "gemma3", "qwen3moe"):
            t[p + "self_attn.q_norm.weight"] = norm(HEAD_DIM)
            t[p + "self_attn.k_norm.weight"] = norm(HEAD_DIM)
        if arch in LN_BIAS:
            continue
        if arch == "olmo2":             # no input norm; Q/K norms over all heads; post-norms on both branches
            del t[p + "input_layernorm.weight"]
            t[p + "self_attn.q_norm.weight"] = norm(N_HEAD * HEAD_DIM)
            t[p + "self_attn.k_norm.weight"] = norm(N_HEAD_KV * HEAD_DIM)
            t[p + "post_feedforward_layernorm.weight"] = norm(N_EMBD)
        if arch in MOE:
            t[p + "mlp.gate.weight"] = rng.normal(0, 4 / np.sqrt(N_EMBD), (N_EXPERT, N_EMBD)).astype(np.float32)
            for e in range(N_EXPERT):
                t[p + f"mlp.experts.{e}.gate_proj.weight"] = lin(N_FF_EXP, N_EMBD)
                t[p + f"mlp.experts.{e}.up_proj.weight"] = lin(N_FF_EXP, N_EMBD)
                t[p + f"mlp.experts.{e}.down_proj.weight"] = lin(N_EMBD, N_FF_EXP)
            continue
        if arch == "phi3":
            t[p + "mlp.gate_up_proj.weight"] = lin(2 * N_FF, N_EMBD)
        else:
            t[p + "mlp.gate_proj.weight"] = lin(N_FF, N_EMBD)
            t[p + "mlp.up_proj.weight"] = lin(N_FF, N_EMBD)
        t[p + "mlp.down_proj.weight"] = lin(N_EMBD, N_FF)
    if dtype == "BF16":     # the reference computes with what the file holds
        t = {k: ((v.view(np.uint32) >> 16).astype(np.uint32) << 16).view(np.float32) for k, v in t.items()}
    # the file's names: Mixtral's block_sparse_moe with w1/w2/w3 (gate/down/up); the reference keeps its own
    on_disk = {k: hf_file_name(arch, k) for k in t}
    names = sorted(t)
    half = len(names) // 2        # two shards with an index, as large checkpoints come
    write_safetensors(d / "model-00001-of-00002.safetensors", {on_disk[k]: t[k] for k in names[:half]}, dtype)
    write_safetensors(d / "model-00002-of-00002.safetensors", {on_disk[k]: t[k] for k in names[half:]}, dtype)
    (d / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {
        on_disk[k]: f"model-0000{1 if i < half else 2}-of-00002.safetensors" for i, k in enumerate(names)}}))
    cfg = {"architectures": [HF_ARCH[arch]],
           "hidden_size": N_EMBD, "intermediate_size": N_FF, "num_hidden_layers": n_layers(arch),
           "num_attention_heads": N_HEAD, "num_key_value_heads": n_kv(arch), "max_position_embeddings": 256,
           "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "vocab_size": n_vocab, "tie_word_embeddings": tied,
           "eos_token_id": 2}
    if arch in ("qwen3", "gemma2", "gemma3", "qwen3moe"):
        cfg["head_dim"] = HEAD_DIM
    if arch == "mixtral":         # Mixtral's intermediate_size is its experts'
        cfg.update(num_local_experts=N_EXPERT, num_experts_per_tok=N_USED, intermediate_size=N_FF_EXP)
    if arch == "qwen3moe":
        cfg.update(num_experts=N_EXPERT, num_experts_per_tok=N_USED, moe_intermediate_size=N_FF_EXP,
                   norm_topk_prob=True)
    if arch == "starcoder2":
        del cfg["rms_norm_eps"]
        cfg.update(norm_epsilon=1e-5, use_bias=True, hidden_act="gelu_pytorch_tanh")
    if arch in COHERE:
        del cfg["rms_norm_eps"]
        cfg.update(layer_norm_eps=1e-5, logit_scale=0.5, model_max_length=512)
    if arch == "cohere2":         # three sliding-window layers (with RoPE) of four; the fourth global, without
        cfg.update(sliding_window=4, sliding_window_pattern=4, rotary_pct=1.0)
    if arch == "phi2":            # phi2's MLP is 4 * n_embd wide (llama.cpp writes that, whatever the config)
        del cfg["rms_norm_eps"]
        cfg.update(layer_norm_eps=1e-5, partial_rotary_factor=0.5, hidden_act="gelu_new",
                   intermediate_size=4 * N_EMBD)
    if arch == "granite":
        cfg.update(attention_multiplier=0.2, embedding_multiplier=3.0, residual_multiplier=0.6, logits_scaling=2.0)
    if arch in GEMMA:
        cfg.update(query_pre_attn_scalar=HEAD_DIM, sliding_window=4, hidden_activation="gelu_pytorch_tanh")
    if arch == "gemma2":
        cfg.update(attn_logit_softcapping=20.0, final_logit_softcapping=15.0)
    if arch == "gemma3":
        cfg.update(rope_theta=1_000_000.0, rope_local_base_freq=10000.0, sliding_window_pattern=6,
                   final_logit_softcapping=None, attn_logit_softcapping=None)
    if arch == "phi3":
        cfg.update(original_max_position_embeddings=256, sliding_window=None)
    (d / "config.json").write_text(json.dumps(cfg))
    return t, cfg, tok


def hf_forward(t: dict, cfg: dict, arch: str, ids: list[int]) -> np.ndarray:
    """Logits [n_tokens, n_vocab] as transformers computes these models (rotate-half RoPE, GQA, SwiGLU), in
    float64."""
    w = {k: v.astype(np.float64) for k, v in t.items()}
    eps = cfg.get("rms_norm_eps", cfg.get("norm_epsilon", cfg.get("layer_norm_eps")))
    gemma = arch in GEMMA

    def rms(x, g, name=None):
        if arch in LN_BIAS + COHERE and name is not None:     # LayerNorm (with a bias where given)
            x = x - x.mean(-1, keepdims=True)
            return x / np.sqrt((x * x).mean(-1, keepdims=True) + eps) * g + w.get(name + ".bias", 0)
        return x / np.sqrt((x * x).mean(-1, keepdims=True) + eps) * (1 + g if gemma else g)
    n = len(ids)

    n_rot = int(cfg.get("partial_rotary_factor", 1.0) * HEAD_DIM)

    def rope(x, base):       # x [n, heads, head_dim], rotate-half over the first n_rot dimensions
        inv = 1.0 / base ** (np.arange(0, n_rot, 2) / n_rot)
        ang = np.arange(n)[:, None] * inv[None, :]
        cos, sin = np.cos(np.concatenate([ang, ang], -1)), np.sin(np.concatenate([ang, ang], -1))
        r, rest = x[..., :n_rot], x[..., n_rot:]
        x1, x2 = r[..., :n_rot // 2], r[..., n_rot // 2:]
        if arch in COHERE:              # Cohere rotates adjacent pairs (rotate_every_two)
            c, sn = np.cos(ang)[:, None], np.sin(ang)[:, None]
            e, o = r[..., 0::2], r[..., 1::2]
            r = np.stack([e * c - o * sn, o * c + e * sn], -1).reshape(r.shape)
        else:
            r = r * cos[:, None] + np.concatenate([-x2, x1], -1) * sin[:, None]
        return np.concatenate([r, rest], -1)

    def gelu_tanh(x):
        return 0.5 * x * (1 + np.tanh(np.sqrt(2 / np.pi) * (x + 0.044715 * x ** 3)))
    h = w["model.embed_tokens.weight"][ids] * (np.sqrt(N_EMBD) if gemma else cfg.get("embedding_multiplier", 1.0))
    res = cfg.get("residual_multiplier", 1.0)
    i, j = np.arange(n)[:, None], np.arange(n)[None, :]
    for il in range(n_layers(arch)):
        p = f"model.layers.{il}."
        sliding = (gemma or arch == "cohere2") and (il % 2 == 0 if arch == "gemma2"
                                                    else (il + 1) % cfg["sliding_window_pattern"] != 0)
        seen = (j <= i) & ((i - j < cfg["sliding_window"]) if sliding else True)
        mask = np.where(seen, 0.0, -np.inf)
        x = h if arch == "olmo2" else rms(h, w[p + "input_layernorm.weight"], p + "input_layernorm")
        proj = {}
        if arch == "phi3":
            qkv = x @ w[p + "self_attn.qkv_proj.weight"].T
            sizes = {"q": N_HEAD * HEAD_DIM, "k": N_HEAD_KV * HEAD_DIM, "v": N_HEAD_KV * HEAD_DIM}
            parts = np.split(qkv, [sizes["q"], sizes["q"] + sizes["k"]], axis=-1)
            proj = {s: y.reshape(n, -1, HEAD_DIM) for s, y in zip("qkv", parts)}
        else:
            for s, nh in (("q", N_HEAD), ("k", n_kv(arch)), ("v", n_kv(arch))):
                y = x @ w[p + f"self_attn.{s}_proj.weight"].T + w.get(p + f"self_attn.{s}_proj.bias", 0)
                if arch == "olmo2" and s != "v":
                    y = rms(y, w[p + f"self_attn.{s}_norm.weight"])
                proj[s] = y.reshape(n, nh, HEAD_DIM)
        if arch in ("qwen3", "gemma3", "qwen3moe"):
            proj["q"] = rms(proj["q"], w[p + "self_attn.q_norm.weight"])
            proj["k"] = rms(proj["k"], w[p + "self_attn.k_norm.weight"])
        base = cfg["rope_local_base_freq"] if arch == "gemma3" and sliding else cfg["rope_theta"]
        q, k, v = rope(proj["q"], base), rope(proj["k"], base), proj["v"]
        if (arch == "smollm3" and (il + 1) % 4 == 0) or (arch == "cohere2" and not sliding):
            q, k = proj["q"], proj["k"]
        rep = N_HEAD // n_kv(arch)
        k, v = np.repeat(k, rep, axis=1), np.repeat(v, rep, axis=1)
        scale = cfg["query_pre_attn_scalar"] ** -0.5 if gemma else cfg.get("attention_multiplier", HEAD_DIM ** -0.5)
        att = np.einsum("ihd,jhd->hij", q, k) * scale
        if cfg.get("attn_logit_softcapping"):
            att = np.tanh(att / cfg["attn_logit_softcapping"]) * cfg["attn_logit_softcapping"]
        att = att + mask
        att = np.exp(att - att.max(-1, keepdims=True))
        att /= att.sum(-1, keepdims=True)
        o = np.einsum("hij,jhd->ihd", att, v).reshape(n, -1) @ w[p + "self_attn.o_proj.weight"].T
        o = o + w.get(p + "self_attn.o_proj.bias", 0)
        if gemma:
            o = rms(o, w[p + "post_attention_layernorm.weight"])
            h = h + o
            x = rms(h, w[p + "pre_feedforward_layernorm.weight"])
        elif arch == "olmo2":
            h = h + rms(o, w[p + "post_attention_layernorm.weight"])
            x = h
        elif arch in ("phi2",) + COHERE:   # parallel: the MLP reads the same normed input as attention
            h = h + o
        else:
            h = h + o * res
            x = rms(h, w[p + "post_attention_layernorm.weight"], p + "post_attention_layernorm")
        if arch in MOE:                 # softmax router, top-k experts, weights renormalised
            probs = np.exp(x @ w[p + "mlp.gate.weight"].T)
            probs /= probs.sum(-1, keepdims=True)
            y = np.zeros_like(h)
            for tok in range(n):
                top = np.argsort(-probs[tok])[:N_USED]
                wt = probs[tok, top] / probs[tok, top].sum()
                for e, we in zip(top, wt):
                    g = x[tok] @ w[p + f"mlp.experts.{e}.gate_proj.weight"].T
                    u = x[tok] @ w[p + f"mlp.experts.{e}.up_proj.weight"].T
                    y[tok] += we * ((g / (1 + np.exp(-g)) * u) @ w[p + f"mlp.experts.{e}.down_proj.weight"].T)
            h = h + y
            continue
        if arch in LN_BIAS:
            u = gelu_tanh(x @ w[p + "mlp.c_fc.weight"].T + w[p + "mlp.c_fc.bias"])
            h = h + u @ w[p + "mlp.c_proj.weight"].T + w[p + "mlp.c_proj.bias"]
            continue
        if arch == "phi3":
            g, u = np.split(x @ w[p + "mlp.gate_up_proj.weight"].T, 2, axis=-1)
        else:
            g, u = x @ w[p + "mlp.gate_proj.weight"].T, x @ w[p + "mlp.up_proj.weight"].T
        act = gelu_tanh(g) if gemma else g / (1 + np.exp(-g))
        y = (act * u) @ w[p + "mlp.down_proj.weight"].T
        h = h + (rms(y, w[p + "post_feedforward_layernorm.weight"]) if gemma or arch == "olmo2" else y * res)
    h = rms(h, w["model.norm.weight"], "model.norm")
    head = w.get("lm_head.weight", w["model.embed_tokens.weight"])
    logits = (h @ head.T + w.get("lm_head.bias", 0)) * cfg.get("logit_scale", 1.0)
    logits = logits / cfg.get("logits_scaling", 1.0)
    if cfg.get("final_logit_softcapping"):
        logits = np.tanh(logits / cfg["final_logit_softcapping"]) * cfg["final_logit_softcapping"]
    return logits


def llampy_logits(path, ids) -> np.ndarray:
    m = Model(path)
    ctx = Context(m, n_ctx=64)
    ctx.decode(Batch.from_tokens(ids, logits_all=True))
    return np.array([ctx.get_logits_ith(i).copy() for i in range(len(ids))])


CASES = [("llama", False, "F32", "f32"), ("qwen2", True, "BF16", "f32"), ("qwen3", False, "F16", "f16"),
         ("gemma2", True, "F32", "f32"), ("gemma3", True, "BF16", "f32"), ("phi3", False, "F32", "f32"),
         ("qwen3moe", False, "F32", "f32"), ("granite", True, "F32", "f32"), ("starcoder2", True, "F32", "f32"),
         ("smollm3", True, "F32", "f32"), ("olmo2", False, "F32", "f32"), ("mixtral", False, "F32", "f32"),
         ("phi2", False, "F32", "f32"), ("command-r", True, "F32", "f32"),
         ("cohere2", True, "F32", "f32")]


@pytest.mark.parametrize("arch,tied,dtype,outtype", CASES, ids=lambda x: str(x))
def test_converted_model_matches_transformers_math(tmp_path, arch, tied, dtype, outtype):
    t, cfg, tok = make_checkpoint(tmp_path / "hf", arch, tied, dtype)
    out = tmp_path / "out.gguf"
    assert main(["convert", str(tmp_path / "hf"), str(out), "--outtype", outtype]) == 0
    with GGUFReader(out) as r:
        md = r.metadata
        assert md["general.architecture"] == GGUF_ARCH.get(arch, arch) and md["tokenizer.ggml.model"] == "gpt2"
        assert md["tokenizer.ggml.pre"] == "gpt-2" and md["tokenizer.chat_template"] == CHATML
        assert md["tokenizer.ggml.eos_token_id"] == tok.token_to_id("<|im_end|>")
        assert md["tokenizer.ggml.padding_token_id"] == md["tokenizer.ggml.unknown_token_id"] == 0
        a = md["general.architecture"]
        assert {k.replace(a + ".", "{arch}.", 1) for k in md} <= GGUF_PY_KEYS, "a key gguf-py does not name"
        assert md["tokenizer.ggml.add_bos_token"] is False
        assert ("output.weight" in r.tensors) == (not tied)
        first_norm = "blk.0.post_attention_norm.weight" if arch == "olmo2" else "blk.0.attn_norm.weight"
        assert r.tensors[first_norm].type == GGMLType.F32
        down = "blk.0.ffn_down_exps.weight" if arch in MOE else "blk.0.ffn_down.weight"
        assert r.tensors[down].type == GGMLType[outtype.upper()]
        if arch in MOE:
            assert r.tensors[down].ne == (N_FF_EXP, N_EMBD, N_EXPERT)
            assert r.tensors["blk.0.ffn_gate_inp.weight"].type == GGMLType.F32
    ids = tok.encode(TEXT).ids[:12]
    m = Model(out)
    assert m.vocab.tokenize(TEXT, add_special=True, parse_special=False) == tok.encode(TEXT).ids
    assert m.vocab.tokenize("<|im_start|>user", add_special=False, parse_special=True)[0] == 1
    ours = llampy_logits(out, ids)
    ref = hf_forward(t, cfg, arch, ids)
    tol = 2e-3 if outtype == "f32" else 3e-2
    assert np.abs(ours - ref).max() <= tol * np.abs(ref).max(), np.abs(ours - ref).max()
    from tests.llamacpp_run import llamacpp_logits      # last: it skips without llama.cpp's build
    theirs = llamacpp_logits(out, ids)
    assert np.abs(ours - theirs).max() <= 2e-3 * np.abs(theirs).max()


def test_outtypes_and_libllama(tmp_path):
    from tests.llamacpp_run import llamacpp_logits
    t, cfg, tok = make_checkpoint(tmp_path / "hf", "llama", True, "BF16", seed=1)
    ids = tok.encode(TEXT).ids[:12]
    ref = hf_forward(t, cfg, "llama", ids)
    for outtype, tol in (("bf16", 3e-2), ("q8_0", 3e-2)):
        out = tmp_path / f"{outtype}.gguf"
        assert main(["convert", str(tmp_path / "hf"), str(out), "--outtype", outtype]) == 0
        with GGUFReader(out) as r:
            assert r.metadata["general.file_type"] == {"bf16": 32, "q8_0": 7}[outtype]
            assert r.tensors["blk.1.attn_q.weight"].type == GGMLType[outtype.upper()]
        ours = llampy_logits(out, ids)
        assert np.abs(ours - ref).max() <= tol * np.abs(ref).max()
        theirs = llamacpp_logits(out, ids)
        assert np.abs(ours - theirs).max() <= 2e-3 * np.abs(theirs).max()


def test_safetensors_reader_and_refusals(tmp_path):
    a = np.arange(12, dtype=np.float32).reshape(3, 4) / 7
    write_safetensors(tmp_path / "x.safetensors", {"b": a, "a": a.T.copy()}, "BF16")
    got = read_safetensors(tmp_path / "x.safetensors")
    assert list(got) == ["a", "b"] and got["b"].dtype == np.float32
    np.testing.assert_allclose(got["b"], a, rtol=1e-2)
    make_checkpoint(tmp_path / "hf", "llama", True)
    cfg = json.loads((tmp_path / "hf" / "config.json").read_text())
    cfg["architectures"] = ["MambaForCausalLM"]
    (tmp_path / "hf" / "config.json").write_text(json.dumps(cfg))
    assert main(["convert", str(tmp_path / "hf"), str(tmp_path / "o.gguf")]) == 1


def test_peft_lora_matches_merged_weights_and_libllama(tmp_path):
    """A PEFT adapter of the tiny llama (Q and K among its targets, whose rows the conversion permutes), converted
    with --lora: llampy with the adapter against the NumPy forward pass on W + alpha/r * B @ A, and libllama."""
    from llampy.llama.lora import LoraAdapter
    from tests.llamacpp_run import llamacpp_logits
    t, cfg, tok = make_checkpoint(tmp_path / "hf", "llama", False, seed=2)
    r, alpha = 4, 6.0
    rng = np.random.default_rng(9)
    peft, merged = {}, dict(t)
    for il in range(N_LAYER):
        for mod in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.down_proj"):
            base = f"model.layers.{il}.{mod}.weight"
            n_out, n_in = t[base].shape
            a = rng.normal(0, 0.5 / np.sqrt(n_in), (r, n_in)).astype(np.float32)
            b = rng.normal(0, 0.5, (n_out, r)).astype(np.float32)
            peft[f"base_model.model.model.layers.{il}.{mod}.lora_A.weight"] = a
            peft[f"base_model.model.model.layers.{il}.{mod}.lora_B.weight"] = b
            merged[base] = t[base] + alpha / r * (b @ a)
    (tmp_path / "lora").mkdir()
    write_safetensors(tmp_path / "lora" / "adapter_model.safetensors", peft)
    (tmp_path / "lora" / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "r": r, "lora_alpha": alpha, "base_model_name_or_path": str(tmp_path / "hf"),
        "target_modules": ["q_proj", "k_proj", "v_proj", "o_proj", "down_proj"]}))
    assert main(["convert", str(tmp_path / "hf"), str(tmp_path / "base.gguf"), "--outtype", "f32"]) == 0
    assert main(["convert", "--lora", str(tmp_path / "lora"), str(tmp_path / "lora.gguf"), "--outtype", "f32"]) == 0
    with GGUFReader(tmp_path / "lora.gguf") as rd:
        assert rd.metadata["general.type"] == "adapter" and rd.metadata["adapter.lora.alpha"] == alpha
        assert rd.tensors["blk.0.attn_q.weight.lora_a"].ne == (N_EMBD, r)
        assert rd.tensors["blk.0.attn_q.weight.lora_b"].ne == (r, N_HEAD * HEAD_DIM)
    ids = tok.encode(TEXT).ids[:12]
    ref = hf_forward(merged, cfg, "llama", ids)
    assert np.abs(ref - hf_forward(t, cfg, "llama", ids)).max() > 0.2 * np.abs(ref).max()
    m = Model(tmp_path / "base.gguf")
    ctx = Context(m, n_ctx=64)
    ctx.set_loras([(LoraAdapter(m, tmp_path / "lora.gguf"), 1.0)])
    ctx.decode(Batch.from_tokens(ids, logits_all=True))
    ours = np.array([ctx.get_logits_ith(i).copy() for i in range(len(ids))])
    assert np.abs(ours - ref).max() <= 2e-3 * np.abs(ref).max()
    theirs = llamacpp_logits(tmp_path / "base.gguf", ids, [(tmp_path / "lora.gguf", 1.0)])
    assert np.abs(ours - theirs).max() <= 2e-3 * np.abs(theirs).max()


def write_spm_model(path, words: list[str]):
    """A SentencePiece model file in protobuf wire format: <unk>, <s>, </s>, the 256 byte pieces, then '▁'-prefixed
    words and their pieces with descending scores (what llama.cpp's SPM tokenizer merges by)."""
    def varint(v):
        out = b""
        while True:
            c, v = v & 0x7F, v >> 7
            out += bytes([c | (0x80 if v else 0)])
            if not v:
                return out

    def piece(text, score, typ):
        t = text.encode()
        body = b"\x0a" + varint(len(t)) + t + b"\x15" + struct.pack("<f", score) + b"\x18" + varint(typ)
        return b"\x0a" + varint(len(body)) + body
    pieces = [("<unk>", 0.0, 2), ("<s>", 0.0, 3), ("</s>", 0.0, 3)]
    pieces += [(f"<0x{i:02X}>", 0.0, 6) for i in range(256)]
    seen, score = set(), -1.0
    for w in words:
        w = "\u2581" + w
        for k in range(2, len(w) + 1):          # every prefix, so that merges can build each word
            if w[:k] not in seen:
                seen.add(w[:k])
                pieces.append((w[:k], score, 1))
                score -= 1.0
    for ch in sorted(set("".join(words)) | {"\u2581"}):
        if ch not in seen:
            pieces.append((ch, score, 1))
            score -= 1.0
    path.write_bytes(b"".join(piece(*p) for p in pieces))
    return len(pieces)


@pytest.mark.slow
def test_sentencepiece_vocabulary(tmp_path):
    """A llama checkpoint with a tokenizer.model and no tokenizer.json: llama.cpp's "llama" vocabulary, the same
    token ids from llampy and libllama, and logits as the transformers-style forward pass gives them."""
    from tests.llamacpp_run import llamacpp_logits, llamacpp_tokenize
    d = tmp_path / "hf"
    t, cfg, _ = make_checkpoint(d, "llama", True, seed=4)
    (d / "tokenizer.json").unlink()
    n = write_spm_model(d / "tokenizer.model", TEXT.split())
    (d / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>",
                                                        "add_bos_token": True, "add_eos_token": False}))
    cfg.update(vocab_size=n, bos_token_id=1, eos_token_id=2)
    t["model.embed_tokens.weight"] = np.random.default_rng(5).normal(0, 0.5, (n, N_EMBD)).astype(np.float32)
    write_safetensors(d / "model-00001-of-00002.safetensors",
                      {**read_safetensors(d / "model-00001-of-00002.safetensors"),
                       "model.embed_tokens.weight": t["model.embed_tokens.weight"]})
    (d / "config.json").write_text(json.dumps(cfg))
    out = tmp_path / "spm.gguf"
    assert main(["convert", str(d), str(out), "--outtype", "f32"]) == 0
    with GGUFReader(out) as r:
        md = r.metadata
        assert md["tokenizer.ggml.model"] == "llama" and md["tokenizer.ggml.pre"] == "default"
        assert md["tokenizer.ggml.bos_token_id"] == 1 and md["tokenizer.ggml.add_bos_token"] is True
        assert md["tokenizer.ggml.token_type"][3] == 6 and len(md["tokenizer.ggml.tokens"]) == n
    texts = [TEXT, "the lazy fox", "quick quick brown dogs", "zebra ß 12"]
    m = Model(out)
    ours = [m.vocab.tokenize(x, add_special=True, parse_special=False) for x in texts]
    assert ours[0][0] == 1 and len(ours[0]) == len(TEXT.split()) + 1     # every word one piece after BOS
    ids = ours[0][:12]
    logits = llampy_logits(out, ids)
    ref = hf_forward(t, cfg, "llama", ids)
    assert np.abs(logits - ref).max() <= 2e-3 * np.abs(ref).max()
    assert llamacpp_tokenize(out, texts) == ours
    theirs = llamacpp_logits(out, ids)
    assert np.abs(logits - theirs).max() <= 2e-3 * np.abs(theirs).max()
