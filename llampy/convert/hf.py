"""Hugging Face checkpoints (config.json, *.safetensors, tokenizer.json, tokenizer_config.json) to GGUF, with
llama.cpp's tensor names, metadata keys and type rules (convert_hf_to_gguf.py and conversion/*.py), so that
llama.cpp and llampy load the result.

    convert_hf("SmolLM2-135M/", "out.gguf", outtype="q8_0")

Architectures: LlamaForCausalLM (Q and K rows permuted back to ggml's rope layout), Qwen2ForCausalLM,
Qwen3ForCausalLM, Gemma2ForCausalLM and Gemma3ForCausalLM (norm weights + 1), Phi3ForCausalLM (fused QKV and
gate+up; no long-context rope factors yet), Qwen3MoeForCausalLM (experts stacked) and GraniteForCausalLM (its
multipliers as scales), Starcoder2ForCausalLM (LayerNorm with biases, plain GELU MLP), MistralForCausalLM (as
llama), SmolLM3ForCausalLM, Olmo2ForCausalLM. ``convert_peft_lora`` writes a PEFT LoRA adapter of such a model as a
GGUF LoRA (convert_lora_to_gguf.py).

Tokenizers: a SentencePiece tokenizer.model (llama.cpp's "llama" model; the protobuf is read directly), else a
byte-level BPE tokenizer.json (llama.cpp's "gpt2" model, the pre-tokenizer named by llama.cpp's hash table); with
the special tokens, add_bos/add_eos and the chat template of tokenizer_config.json (or chat_template.jinja /
chat_template.json).
"""
from __future__ import annotations

import hashlib
import json
import re
import struct
import warnings
from pathlib import Path

import numpy as np

from ..ggml.quants import quantize
from ..ggml.types import GGMLType
from ..gguf import GGUFWriter
from ..gguf.constants import GGUFValueType as VT
from .pretok_hashes import CHKTXT, PRE_BY_HASH


class ConvertError(ValueError):
    pass


# llama.cpp's LlamaFileType for each --outtype, and the tensor type a matrix gets under it
OUTTYPES = {"f32": (0, GGMLType.F32), "f16": (1, GGMLType.F16), "q8_0": (7, GGMLType.Q8_0),
            "bf16": (32, GGMLType.BF16)}
QUANT_VERSION = 2      # GGML_QNT_VERSION

# HF name (after "model.layers.N.") -> GGUF name (after "blk.N."): llama.cpp's TensorNameMap for these families
LAYER_NAMES = {
    "input_layernorm": "attn_norm",
    "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm",
    "post_attention_layernorm": "ffn_norm",
    "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down",
    "mlp.gate": "ffn_gate_inp",
    # a mixture of experts' weights, stacked from mlp.experts.E.*_proj by the converter
    "mlp.experts.gate_proj": "ffn_gate_exps", "mlp.experts.up_proj": "ffn_up_exps",
    "mlp.experts.down_proj": "ffn_down_exps",
}
GLOBAL_NAMES = {"model.embed_tokens": "token_embd", "model.norm": "output_norm", "lm_head": "output"}

# per-architecture renames on top of LAYER_NAMES: Gemma's four norms per block, Phi-3's fused projections
ARCH_LAYER_NAMES = {
    "gemma2": {"post_attention_layernorm": "post_attention_norm", "pre_feedforward_layernorm": "ffn_norm",
               "post_feedforward_layernorm": "post_ffw_norm"},
    "phi3": {"self_attn.qkv_proj": "attn_qkv", "mlp.gate_up_proj": "ffn_up"},
}
ARCH_LAYER_NAMES["gemma3"] = ARCH_LAYER_NAMES["gemma2"]
ARCH_LAYER_NAMES["starcoder2"] = {"mlp.c_fc": "ffn_up", "mlp.c_proj": "ffn_down"}
ARCH_LAYER_NAMES["olmo2"] = {"post_attention_layernorm": "post_attention_norm",
                             "post_feedforward_layernorm": "post_ffw_norm"}

ARCHITECTURES = {"LlamaForCausalLM": "llama", "Qwen2ForCausalLM": "qwen2", "Qwen3ForCausalLM": "qwen3",
                 "Gemma2ForCausalLM": "gemma2", "Gemma3ForCausalLM": "gemma3", "Phi3ForCausalLM": "phi3",
                 "Qwen3MoeForCausalLM": "qwen3moe", "GraniteForCausalLM": "granite",
                 "Starcoder2ForCausalLM": "starcoder2", "MistralForCausalLM": "llama",
                 "SmolLM3ForCausalLM": "smollm3", "Olmo2ForCausalLM": "olmo2"}
PERMUTED = ("llama", "granite", "smollm3")   # LlamaModel and its subclasses undo HF's Q/K permutation

_ST_DTYPES = {"F32": np.float32, "F16": np.float16, "BF16": np.uint16, "F64": np.float64}


# ---------------------------------------------------------------------------------------------- safetensors
class SafeTensors:
    """A safetensors file: a u64 header length, a JSON header of {name: {dtype, shape, data_offsets}}, then the
    raw little-endian bytes. Memory-mapped; ``load`` reads one tensor (BF16 widened to float32)."""

    def __init__(self, path):
        self.path = Path(path)
        self.raw = np.memmap(self.path, dtype=np.uint8, mode="r")
        n = int(self.raw[:8].view("<u8")[0]) if self.raw.size >= 8 else -1
        if not 0 <= n <= self.raw.size - 8:
            raise ConvertError(f"{self.path}: not a safetensors file (header length {n})")
        self.header = {k: v for k, v in json.loads(bytes(self.raw[8:8 + n]).decode("utf-8")).items()
                       if k != "__metadata__"}
        self.base = 8 + n
        for name, h in self.header.items():
            if h["dtype"] not in _ST_DTYPES:
                raise ConvertError(f"{self.path}: tensor {name!r} has dtype {h['dtype']}, not a float type")

    def names(self) -> list[str]:
        return sorted(self.header)          # safe_open's key order

    def shape(self, name: str) -> tuple:
        return tuple(self.header[name]["shape"])

    def load(self, name: str) -> np.ndarray:
        h = self.header[name]
        a, b = h["data_offsets"]
        arr = self.raw[self.base + a:self.base + b].view(np.dtype(_ST_DTYPES[h["dtype"]]).newbyteorder("<"))
        arr = arr.reshape(h["shape"])
        if h["dtype"] == "BF16":
            arr = (arr.astype(np.uint32) << 16).view(np.float32)
        return arr


def read_safetensors(path) -> dict[str, np.ndarray]:
    """Every tensor of a safetensors file, by name (BF16 as float32)."""
    st = SafeTensors(path)
    return {n: st.load(n) for n in st.names()}


def _checkpoint_tensors(d: Path) -> dict[str, tuple]:
    """name -> (shape, loader) over the checkpoint's safetensors files (one, or the shards of an index)."""
    index = d / "model.safetensors.index.json"
    if index.is_file():
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    else:
        files = sorted(p.name for p in d.glob("*.safetensors"))
    if not files:
        raise ConvertError(f"{d}: no *.safetensors files")
    out: dict[str, tuple] = {}
    for f in files:
        st = SafeTensors(d / f)
        for n in st.names():
            out[n] = (st.shape(n), lambda st=st, n=n: st.load(n))
    return out


# ---------------------------------------------------------------------------------------------- tensors
def _permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """LlamaModel.permute: HF's rotate-half Q/K rows back to ggml's interleaved pairs."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def gguf_name(hf: str, arch: str = "llama") -> str | None:
    """llama.cpp's name for an HF tensor name, or None when it is not one of the mapped tensors."""
    stem, _, suffix = hf.rpartition(".")
    if stem in GLOBAL_NAMES:
        return f"{GLOBAL_NAMES[stem]}.{suffix}"
    m = re.fullmatch(r"model\.layers\.(\d+)\.(.+)", stem)
    if m:
        names = {**LAYER_NAMES, **ARCH_LAYER_NAMES.get(arch, {})}
        if m.group(2) in names:
            return f"blk.{m.group(1)}.{names[m.group(2)]}.{suffix}"
    return None


def _tensor_type(name: str, shape: tuple, matrix_type: GGMLType) -> GGMLType:
    """convert_hf_to_gguf's prepare_tensors: 1-D tensors and norms in F32, every other .weight in the file type;
    a row that is not whole Q8_0 blocks falls back to F16."""
    if (len(shape) <= 1 or name.endswith(("_norm.weight", "ffn_gate_inp.weight"))
            or not name.endswith((".weight", ".lora_a", ".lora_b"))):
        return GGMLType.F32
    if matrix_type == GGMLType.Q8_0 and shape[-1] % 32:
        return GGMLType.F16
    return matrix_type


def _encode(data: np.ndarray, t: GGMLType) -> np.ndarray:
    x = np.asarray(data, np.float32)
    if t == GGMLType.F32:
        return x
    if t == GGMLType.F16:
        return np.asarray(data).astype(np.float16) if data.dtype == np.float16 else x.astype(np.float16)
    q = quantize(x, t)
    return q.view(np.uint16) if t == GGMLType.BF16 else q


# ---------------------------------------------------------------------------------------------- vocabulary
def _load_json(p: Path):
    return json.loads(p.read_text(encoding="utf-8")) if p.is_file() else None


def _looks_special(tok: str) -> bool:
    """TextModel.does_token_look_special."""
    return (tok in ("<pad>", "<mask>", "<2mass>", "[@BOS@]") or (tok.startswith("<|") and tok.endswith("|>"))
            or (tok.startswith("<｜") and tok.endswith("｜>")) or (tok.startswith("<unused") and tok.endswith(">")))


def _pre_tokenizer(tok_path: Path) -> str:
    """get_vocab_base_pre: the hash of CHKTXT's ids names the pre-tokenizer. llama.cpp's convert refuses an
    unknown hash; we take a plain ByteLevel pre-tokenizer (GPT-2's regex) as 'gpt-2', anything else as 'default'
    with a warning."""
    from tokenizers import Tokenizer
    ids = Tokenizer.from_file(str(tok_path)).encode(CHKTXT).ids
    h = hashlib.sha256(str(ids).encode()).hexdigest()
    pre = PRE_BY_HASH.get(h)
    if pre is not None:
        return pre
    pt = (_load_json(tok_path) or {}).get("pre_tokenizer") or {}
    if pt.get("type") == "ByteLevel" and pt.get("use_regex", True):
        return "gpt-2"      # GPT-2's own regex, which llama.cpp implements as 'gpt-2'
    warnings.warn(f"unknown BPE pre-tokenizer (hash {h}): written as 'default'", RuntimeWarning, stacklevel=3)
    return "default"


def vocab_metadata(d: Path, vocab_size: int | None) -> list[tuple[str, object, tuple]]:
    """tokenizer.* keys of a byte-level BPE tokenizer.json (_set_vocab_gpt2 and gguf-py's SpecialVocab)."""
    tj = _load_json(d / "tokenizer.json")
    if tj is None:
        raise ConvertError(f"{d}: no tokenizer.json (llampy converts byte-level BPE tokenizers only)")
    model = tj.get("model", {})
    if model.get("type") != "BPE" or model.get("byte_fallback"):
        raise ConvertError(f"{d}: tokenizer.json is not a byte-level BPE tokenizer (SentencePiece-style tokenizers "
                           f"are not converted yet)")
    cfg = _load_json(d / "tokenizer_config.json") or {}
    vocab: dict[str, int] = dict(model["vocab"])
    added = {a["content"]: a for a in tj.get("added_tokens", [])}
    for a in added.values():
        vocab[a["content"]] = a["id"]
    n = vocab_size or (max(vocab.values()) + 1)
    if max(vocab.values()) >= n:
        raise ConvertError(f"token id {max(vocab.values())} is beyond vocab_size {n}")
    rev = {i: t for t, i in vocab.items()}
    tokens, types = [], []
    for i in range(n):
        t = rev.get(i)
        if t is None:
            tokens.append(f"[PAD{i}]")
            types.append(5)                                    # UNUSED
        elif t in added:
            tokens.append(t)
            types.append(3 if added[t].get("special") or _looks_special(t) else 4)    # CONTROL / USER_DEFINED
        else:
            tokens.append(t)
            types.append(1)                                    # NORMAL
    merges = model.get("merges") or []
    if merges and isinstance(merges[0], list):
        merges = [" ".join("".join(chr(ord(c) + 256) if c == " " else c for c in part) for part in pair)
                  for pair in merges]
    kv = [("tokenizer.ggml.model", "gpt2", (VT.STRING,)),
          ("tokenizer.ggml.pre", _pre_tokenizer(d / "tokenizer.json"), (VT.STRING,)),
          ("tokenizer.ggml.tokens", tokens, (VT.ARRAY, VT.STRING)),
          ("tokenizer.ggml.token_type", np.array(types, np.int32), (VT.ARRAY, VT.INT32)),
          ("tokenizer.ggml.merges", list(merges), (VT.ARRAY, VT.STRING))]
    ids, add = _special_tokens(d, tj, cfg, added)
    kv += [(f"tokenizer.ggml.{typ}_token_id", i, (VT.UINT32,)) for typ, i in ids.items()]
    kv += [(f"tokenizer.ggml.add_{typ}_token", v, (VT.BOOL,)) for typ, v in add.items()]
    kv += _chat_template(d, cfg)
    return kv


def _spm_pieces(path: Path) -> list[tuple[str, float, int]]:
    """(piece, score, type) of a SentencePiece model file: ModelProto's repeated field 1, each a message of
    piece (1, string), score (2, float) and type (3, enum; NORMAL when absent), read from the protobuf wire format
    directly."""
    buf = path.read_bytes()

    def varint(b, i):
        v = shift = 0
        while True:
            if i >= len(b):
                raise ConvertError(f"{path}: truncated protobuf")
            c = b[i]
            i += 1
            v |= (c & 0x7F) << shift
            shift += 7
            if c < 0x80:
                return v, i

    def fields(b):
        i = 0
        while i < len(b):
            key, i = varint(b, i)
            fn, wt = key >> 3, key & 7
            if wt == 0:
                v, i = varint(b, i)
            elif wt == 1:
                v, i = b[i:i + 8], i + 8
            elif wt == 2:
                n, i = varint(b, i)
                v, i = b[i:i + n], i + n
            elif wt == 5:
                v, i = b[i:i + 4], i + 4
            else:
                raise ConvertError(f"{path}: unsupported protobuf wire type {wt}")
            yield fn, wt, v
    out = []
    for fn, wt, v in fields(buf):
        if fn == 1 and wt == 2:
            piece, score, typ = "", 0.0, 1
            for f2, w2, v2 in fields(v):
                if f2 == 1 and w2 == 2:
                    piece = v2.decode("utf-8")
                elif f2 == 2 and w2 == 5:
                    score = struct.unpack("<f", v2)[0]
                elif f2 == 3 and w2 == 0:
                    typ = v2
            out.append((piece, score, typ))
    if not out:
        raise ConvertError(f"{path}: no pieces: not a SentencePiece model")
    return out


def spm_vocab_metadata(d: Path, vocab_size: int | None, arch: str) -> list[tuple[str, object, tuple]]:
    """tokenizer.* keys of a SentencePiece tokenizer.model (_create_vocab_sentencepiece and SpecialVocab):
    llama.cpp's "llama" tokenizer with pieces, scores and types; added_tokens.json and tokenizer_config.json's
    added_tokens_decoder override their ids."""
    pieces = _spm_pieces(d / "tokenizer.model")
    n = vocab_size or len(pieces)
    tokens = [f"[PAD{i}]" for i in range(n)]
    scores = [-10000.0] * n
    types = [5] * n
    for i, (piece, score, typ) in enumerate(pieces[:n]):
        # the processor's IsUnknown/IsControl/IsUnused/IsByte; any other type (USER_DEFINED too) is NORMAL
        tokens[i], scores[i], types[i] = piece, score, typ if typ in (2, 3, 5, 6) else 1
    for key, i in (_load_json(d / "added_tokens.json") or {}).items():
        if i < n:
            tokens[i], scores[i], types[i] = key, -1000.0, 4
    cfg = _load_json(d / "tokenizer_config.json") or {}
    for i, data in (cfg.get("added_tokens_decoder") or {}).items():
        i, tok = int(i), data["content"]
        if i >= n:
            continue
        if data.get("special") or _looks_special(tok):
            types[i] = 3
        else:
            tok = tok.replace("\u2581", " ")
            types[i] = 4
        tokens[i], scores[i] = tok, -1000.0
    kv = [("tokenizer.ggml.model", "llama", (VT.STRING,)), ("tokenizer.ggml.pre", "default", (VT.STRING,)),
          ("tokenizer.ggml.tokens", tokens, (VT.ARRAY, VT.STRING)),
          ("tokenizer.ggml.scores", np.array(scores, np.float32), (VT.ARRAY, VT.FLOAT32)),
          ("tokenizer.ggml.token_type", np.array(types, np.int32), (VT.ARRAY, VT.INT32))]
    tj = _load_json(d / "tokenizer.json") or {}
    added = {t: {"id": i} for i, t in enumerate(tokens) if types[i] in (2, 3, 4)}
    added.update({a["content"]: a for a in tj.get("added_tokens", [])})
    ids, add = _special_tokens(d, tj, cfg, added)
    kv += [(f"tokenizer.ggml.{typ}_token_id", i, (VT.UINT32,)) for typ, i in ids.items()]
    kv += [(f"tokenizer.ggml.add_{typ}_token", v, (VT.BOOL,)) for typ, v in add.items()]
    kv += _chat_template(d, cfg)
    if arch in ("gemma2", "gemma3"):
        kv.append(("tokenizer.ggml.add_space_prefix", False, (VT.BOOL,)))
    elif isinstance(cfg.get("add_prefix_space"), bool):
        kv.append(("tokenizer.ggml.add_space_prefix", cfg["add_prefix_space"], (VT.BOOL,)))
    return kv


def _chat_template(d: Path, cfg: dict) -> list[tuple[str, object, tuple]]:
    kv = []
    tmpl = cfg.get("chat_template")
    if tmpl is None and (d / "chat_template.jinja").is_file():
        tmpl = (d / "chat_template.jinja").read_text(encoding="utf-8")
    elif tmpl is None and (d / "chat_template.json").is_file():
        tmpl = (_load_json(d / "chat_template.json") or {}).get("chat_template")
    if isinstance(tmpl, list):      # named templates: the default one goes to tokenizer.chat_template
        named = {t["name"]: t["template"] for t in tmpl}
        for name, t in named.items():
            if name != "default":
                kv.append((f"tokenizer.chat_template.{name}", t, (VT.STRING,)))
        kv.append(("tokenizer.chat_templates", [k for k in named if k != "default"], (VT.ARRAY, VT.STRING)))
        tmpl = named.get("default")
    if isinstance(tmpl, str):
        kv.append(("tokenizer.chat_template", tmpl, (VT.STRING,)))
    return kv


def _special_tokens(d: Path, tj: dict, cfg: dict, added: dict):
    """SpecialVocab's reading: token ids of bos/eos/unk/sep/pad from tokenizer_config.json (matched against the
    added tokens) or config.json, add_bos/add_eos from the post-processor and tokenizer_config.json."""
    add: dict[str, bool] = {}
    pp = tj.get("post_processor") or {}
    for proc in pp.get("processors", [pp]) if pp else []:
        kind = proc.get("type")
        if kind == "ByteLevel":
            add.setdefault("bos", False)
            add.setdefault("eos", False)
        elif kind == "TemplateProcessing":
            single = proc.get("single", [])
            bos = cfg.get("bos_token")
            bos = bos.get("content") if isinstance(bos, dict) else bos
            eos = cfg.get("eos_token")
            eos = eos.get("content") if isinstance(eos, dict) else eos
            if len(single) > 1:
                first = single[0].get("SpecialToken", {}).get("id")
                if first:
                    add["bos"] = first == bos
                last = single[-1].get("SpecialToken", {}).get("id")
                if last:
                    add["eos"] = last == eos
            else:
                add.setdefault("bos", False)
                add.setdefault("eos", False)
    ids: dict[str, int] = {}
    for typ in ("bos", "eos", "unk", "sep", "pad", "cls", "mask"):
        v = cfg.get(f"add_{typ}_token")
        if isinstance(v, bool) and typ not in add:
            add[typ] = v
        e = cfg.get(f"{typ}_token")
        content = e.get("content") if isinstance(e, dict) else e
        if isinstance(content, str) and content in added:
            ids[typ] = added[content]["id"]
    conf = _load_json(d / "config.json") or {}
    for typ in ("bos", "eos", "unk", "sep", "pad", "cls", "mask"):
        v = conf.get(f"{typ}_token_id")
        if typ not in ids and isinstance(v, int) and v >= 0:
            ids[typ] = v
    order = ("bos", "eos", "unk", "sep", "pad", "cls", "mask")
    return {k: ids[k] for k in order if k in ids}, {k: add[k] for k in order if k in add}


# ---------------------------------------------------------------------------------------------- the model
def _hparams_metadata(arch: str, cfg: dict, n_layer: int, file_type: int) -> list[tuple[str, object, tuple]]:
    """TextModel.set_gguf_parameters (and LlamaModel's additions) for these families."""
    a, U32, F32 = arch, (VT.UINT32,), (VT.FLOAT32,)
    kv = [(f"{a}.block_count", n_layer, U32)]
    for key, hf in (("context_length", "max_position_embeddings"), ("embedding_length", "hidden_size"),
                    ("feed_forward_length", "intermediate_size"), ("attention.head_count", "num_attention_heads"),
                    ("attention.head_count_kv", "num_key_value_heads")):
        if cfg.get(hf) is not None:
            kv.append((f"{a}.{key}", int(cfg[hf]), U32))
    rope = cfg.get("rope_scaling") or {}
    rope_type = rope.get("rope_type", rope.get("type"))
    if rope_type == "linear" and rope.get("factor") is not None:
        kv += [(f"{a}.rope.scaling.type", "linear", (VT.STRING,)),
               (f"{a}.rope.scaling.factor", float(rope["factor"]), F32)]
    elif rope_type == "yarn" and rope.get("factor") is not None:
        kv += [(f"{a}.rope.scaling.type", "yarn", (VT.STRING,)),
               (f"{a}.rope.scaling.factor", float(rope["factor"]), F32),
               (f"{a}.rope.scaling.original_context_length", int(rope["original_max_position_embeddings"]), U32)]
    elif rope_type not in (None, "default", "llama3"):
        raise ConvertError(f"rope_scaling {rope_type!r} is not converted by llampy")
    theta = cfg.get("rope_theta", (cfg.get("rope_parameters") or {}).get("rope_theta"))
    if theta is not None:
        kv.append((f"{a}.rope.freq_base", float(theta), F32))
    if cfg.get("rms_norm_eps") is not None:
        kv.append((f"{a}.attention.layer_norm_rms_epsilon", float(cfg["rms_norm_eps"]), F32))
    eps = next((cfg[k] for k in ("layer_norm_eps", "layer_norm_epsilon", "norm_epsilon") if cfg.get(k) is not None),
               None)
    if eps is not None:
        kv.append((f"{a}.attention.layer_norm_epsilon", float(eps), F32))
    if cfg.get("head_dim") is not None:
        kv += [(f"{a}.attention.key_length", int(cfg["head_dim"]), U32),
               (f"{a}.attention.value_length", int(cfg["head_dim"]), U32)]
    kv.append(("general.file_type", file_type, U32))
    if cfg.get("num_experts") is not None:
        kv += [(f"{a}.expert_count", int(cfg["num_experts"]), U32),
               (f"{a}.expert_used_count", int(cfg["num_experts_per_tok"]), U32)]
    if arch == "qwen3moe" and cfg.get("moe_intermediate_size") is not None:
        kv.append((f"{a}.expert_feed_forward_length", int(cfg["moe_intermediate_size"]), U32))
    if arch == "granite":        # GraniteModel: the multipliers, named as scales
        for key, hf in (("attention.scale", "attention_multiplier"), ("embedding_scale", "embedding_multiplier"),
                        ("residual_scale", "residual_multiplier"), ("logit_scale", "logits_scaling")):
            if cfg.get(hf):
                kv.append((f"{a}.{key}", float(cfg[hf]), F32))
    if arch in PERMUTED:
        kv.append((f"{a}.vocab_size", int(cfg["vocab_size"]), U32))
        kv.append((f"{a}.rope.dimension_count",
                   int(cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]), U32))
    elif arch == "gemma2":       # Gemma2Model.set_gguf_parameters replaces the generic keys
        kv = [(f"{a}.{k}", v, sig) for k, v, sig in (
            ("context_length", int(cfg["max_position_embeddings"]), U32),
            ("embedding_length", int(cfg["hidden_size"]), U32), ("block_count", n_layer, U32),
            ("feed_forward_length", int(cfg["intermediate_size"]), U32),
            ("attention.head_count", int(cfg["num_attention_heads"]), U32),
            ("attention.head_count_kv", int(cfg.get("num_key_value_heads") or cfg["num_attention_heads"]), U32),
            ("attention.layer_norm_rms_epsilon", float(cfg["rms_norm_eps"]), F32),
            ("attention.key_length", int(cfg["head_dim"]), U32), ("attention.value_length", int(cfg["head_dim"]), U32))]
        kv.append(("general.file_type", file_type, U32))
        kv += [(f"{a}.attn_logit_softcapping", float(cfg["attn_logit_softcapping"]), F32),
               (f"{a}.final_logit_softcapping", float(cfg["final_logit_softcapping"]), F32),
               (f"{a}.attention.sliding_window", int(cfg["sliding_window"]), U32)]
    elif arch == "gemma3":       # Gemma3Model's defaults for keys its configs leave out
        kv += [(f"{a}.context_length", int(cfg.get("max_position_embeddings", 131072)), U32),
               (f"{a}.attention.head_count", int(cfg.get("num_attention_heads", 8)), U32),
               (f"{a}.attention.layer_norm_rms_epsilon", float(cfg.get("rms_norm_eps", 1e-6)), F32),
               (f"{a}.attention.key_length", int(cfg.get("head_dim", 256)), U32),
               (f"{a}.attention.value_length", int(cfg.get("head_dim", 256)), U32),
               (f"{a}.rope.freq_base", float(cfg.get("rope_theta", 1_000_000.0)), F32)]
        if cfg.get("rope_local_base_freq") is not None:
            kv.append((f"{a}.rope.freq_base_swa", float(cfg["rope_local_base_freq"]), F32))
        if cfg.get("attn_logit_softcapping") is not None:
            raise ConvertError("gemma3 has no attention soft-capping (attn_logit_softcapping is set)")
        if cfg.get("final_logit_softcapping"):
            kv.append((f"{a}.final_logit_softcapping", float(cfg["final_logit_softcapping"]), F32))
        if cfg.get("sliding_window_pattern") != 1:
            kv.append((f"{a}.attention.sliding_window", int(cfg["sliding_window"]), U32))
        kv.append((f"{a}.attention.head_count_kv", int(cfg.get("num_key_value_heads", 4)), U32))
    elif arch == "phi3":         # Phi3MiniModel.set_gguf_parameters
        if (cfg.get("rope_scaling") or {}).get("long_factor"):
            raise ConvertError("phi3 with long-context rope factors (rope_scaling.long_factor) is not converted yet")
        n_embd, n_head = int(cfg["hidden_size"]), int(cfg["num_attention_heads"])
        rope_dims = int(cfg.get("partial_rotary_factor", 1.0) * n_embd) // n_head
        kv = [(f"{a}.{k}", v, sig) for k, v, sig in (
            ("context_length", int(cfg["max_position_embeddings"]), U32),
            ("rope.scaling.original_context_length",
             int(cfg.get("original_max_position_embeddings", cfg["max_position_embeddings"])), U32),
            ("embedding_length", n_embd, U32), ("feed_forward_length", int(cfg["intermediate_size"]), U32),
            ("block_count", n_layer, U32), ("attention.head_count", n_head, U32),
            ("attention.head_count_kv", int(cfg.get("num_key_value_heads") or n_head), U32),
            ("attention.layer_norm_rms_epsilon", float(cfg["rms_norm_eps"]), F32),
            ("rope.dimension_count", rope_dims, U32), ("rope.freq_base", float(cfg.get("rope_theta", 10000.0)), F32))]
        kv += [("general.file_type", file_type, U32),
               (f"{a}.attention.sliding_window", int(cfg.get("sliding_window") or 0), U32)]
    # gguf-py's writer keeps a key's first place and its last value when a key is added again
    out: dict[str, tuple] = {}
    for k, v, sig in kv:
        out[k] = (v, sig)
    return [(k, v, sig) for k, (v, sig) in out.items()]


def _llama3_rope_factors(cfg: dict) -> np.ndarray | None:
    """LlamaModel.generate_extra_tensors: rope_freqs for rope_scaling type llama3."""
    rope = cfg.get("rope_scaling") or {}
    if rope.get("rope_type", rope.get("type")) != "llama3":
        return None
    base = cfg.get("rope_theta", 10000.0)
    dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    freqs = 1.0 / (base ** (np.arange(0, dim, 2, dtype=np.float32) / dim))
    factor, low, high = rope.get("factor", 8.0), rope.get("low_freq_factor", 1.0), rope.get("high_freq_factor", 4.0)
    old_ctx = rope.get("original_max_position_embeddings", 8192)
    low_wavelen, high_wavelen = old_ctx / low, old_ctx / high
    out = []
    for f in freqs:
        wavelen = 2 * np.pi / f
        if wavelen < high_wavelen:
            out.append(1)
        elif wavelen > low_wavelen:
            out.append(factor)
        else:
            smooth = (old_ctx / wavelen - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(out, np.float32)


def _stack_experts(tensors: dict[str, tuple]) -> dict[str, tuple]:
    """Qwen2MoeModel.modify_tensors: model.layers.N.mlp.experts.E.{gate,up,down}_proj.weight stacked over E into
    model.layers.N.mlp.experts.{gate,up,down}_proj.weight [n_expert, rows, cols] (read when written)."""
    groups: dict[str, dict[int, tuple]] = {}
    out: dict[str, tuple] = {}
    for hf, (shape, load) in tensors.items():
        m = re.fullmatch(r"(model\.layers\.\d+\.mlp\.experts)\.(\d+)\.((?:gate|up|down)_proj\.weight)", hf)
        if m is None:
            out[hf] = (shape, load)
            continue
        groups.setdefault(f"{m.group(1)}.{m.group(3)}", {})[int(m.group(2))] = (shape, load)
    for name, experts in groups.items():
        if sorted(experts) != list(range(len(experts))):
            raise ConvertError(f"experts of {name} are not numbered 0..{len(experts) - 1}")
        parts = [experts[e] for e in range(len(experts))]
        shape = (len(parts),) + tuple(parts[0][0])
        out[name] = (shape, lambda parts=parts: np.stack([np.asarray(load()) for _, load in parts]))
    return out


def convert_hf(src, dst, outtype: str = "f16", name: str | None = None, log=None, progress=None) -> Path:
    """Writes the GGUF of the checkpoint in directory ``src`` to ``dst``; returns ``dst``. One tensor at a time is
    read, converted and written; ``progress(i, n, name)`` is called before each."""
    log = log or (lambda s: None)
    d, dst = Path(src), Path(dst)
    if outtype not in OUTTYPES:
        raise ConvertError(f"--outtype must be one of {', '.join(OUTTYPES)}, not {outtype!r}")
    file_type, matrix_type = OUTTYPES[outtype]
    cfg = _load_json(d / "config.json")
    if cfg is None:
        raise ConvertError(f"{d}: no config.json")
    hf_arch = (cfg.get("architectures") or [None])[0]
    arch = ARCHITECTURES.get(hf_arch)
    if arch is None:
        raise ConvertError(f"{d}: architecture {hf_arch!r} is not converted by llampy "
                           f"(supported: {', '.join(ARCHITECTURES)})")
    if arch == "granite":
        cfg = {k: v for k, v in cfg.items() if k != "head_dim"}     # GraniteModel ignores it
    n_layer = int(cfg["num_hidden_layers"])
    n_head = int(cfg["num_attention_heads"])
    n_head_kv = int(cfg.get("num_key_value_heads") or n_head)
    tensors = _stack_experts(_checkpoint_tensors(d))

    w = GGUFWriter(dst)
    w.add("general.architecture", arch)
    w.add("general.type", "model")
    w.add("general.name", name or d.resolve().name)
    w.add("general.quantization_version", QUANT_VERSION, VT.UINT32)
    for k, v, sig in _hparams_metadata(arch, cfg, n_layer, file_type):
        w.add(k, v, sig)
    vocab = vocab_metadata
    if (d / "tokenizer.model").is_file():
        tc = _load_json(d / "tokenizer_config.json") or {}
        if not (arch == "phi3" and tc.get("tokenizer_class") == "GPT2Tokenizer"):
            vocab = lambda d, n: spm_vocab_metadata(d, n, arch)    # noqa: E731  (llama.cpp tries SentencePiece first)
    vkv = vocab(d, cfg.get("vocab_size"))
    if arch in PERMUTED and cfg.get("vocab_size") == 49152:     # LlamaModel.set_vocab: granite's small models
        vkv = [x for x in vkv if x[0] != "tokenizer.ggml.add_bos_token"]
        vkv.append(("tokenizer.ggml.add_bos_token", False, (VT.BOOL,)))
    for k, v, sig in vkv:
        w.add(k, v, sig)

    factors = _llama3_rope_factors(cfg) if arch in PERMUTED else None
    if factors is not None:
        w.add_tensor("rope_freqs.weight", factors)
    n_vocab_real = None
    if arch == "gemma3":      # Gemma3Model drops the embedding's rows past the tokenizer's tokens
        tj = _load_json(d / "tokenizer.json") or {}
        n_vocab_real = len(tj.get("model", {}).get("vocab", {})) + len(tj.get("added_tokens", []))
    for hf, (shape, load) in tensors.items():
        if hf == "lm_head.weight" and (cfg.get("tie_word_embeddings") or arch in ("gemma2", "gemma3")):
            continue
        if re.search(r"\.rotary_emb\.inv_freq$", hf):
            continue
        gn = gguf_name(hf, arch)
        if gn is None:
            raise ConvertError(f"{d}: cannot map tensor {hf!r} to a llama.cpp name")
        if n_vocab_real is not None and hf == "model.embed_tokens.weight":
            shape = (min(shape[0], n_vocab_real),) + tuple(shape[1:])
        t = _tensor_type(gn, shape, matrix_type)
        w.add_tensor_lazy(gn, t, tuple(reversed(shape)),
                          lambda hf=hf, load=load, shape=shape, t=t: _encode(_prepare(hf, load(), shape), t))
        log(f"{gn:32s} -> {t.name}, shape = {{{', '.join(map(str, reversed(shape)))}}}")

    def _prepare(hf: str, data: np.ndarray, shape: tuple) -> np.ndarray:
        """modify_tensors: the rows kept, Gemma's norm shift, llama's Q/K permutation."""
        data = data[:shape[0]] if data.shape != shape else data
        if arch in ("gemma2", "gemma3") and hf.endswith("norm.weight"):
            data = np.asarray(data, np.float32) + 1.0      # Gemma's RMSNorm multiplies by (1 + weight)
        if arch in PERMUTED:
            if hf.endswith(("q_proj.weight", "q_proj.bias")):
                data = _permute(np.asarray(data), n_head)
            elif hf.endswith(("k_proj.weight", "k_proj.bias")):
                data = _permute(np.asarray(data), n_head_kv)
        return data
    w.write(progress=progress)
    return dst


# ---------------------------------------------------------------------------------------------- PEFT LoRA
def convert_peft_lora(src, dst, base=None, outtype: str = "f16", log=None) -> Path:
    """A PEFT adapter (adapter_config.json, adapter_model.safetensors) to llama.cpp's GGUF LoRA: for each adapted
    weight W, ``W.lora_a`` [n_in, r] and ``W.lora_b`` [r, n_out] (ggml order), ``adapter.lora.alpha`` from
    lora_alpha. ``base``: the base model's directory (its config.json), else adapter_config's
    base_model_name_or_path when that is a local directory."""
    log = log or (lambda s: None)
    d, dst = Path(src), Path(dst)
    if outtype not in OUTTYPES:
        raise ConvertError(f"--outtype must be one of {', '.join(OUTTYPES)}, not {outtype!r}")
    file_type, matrix_type = OUTTYPES[outtype]
    acfg = _load_json(d / "adapter_config.json")
    if acfg is None:
        raise ConvertError(f"{d}: no adapter_config.json (not a PEFT adapter)")
    if acfg.get("peft_type", "LORA") != "LORA" or acfg.get("use_dora"):
        raise ConvertError(f"{d}: only plain LoRA adapters are converted (peft_type {acfg.get('peft_type')!r}"
                           f"{', DoRA' if acfg.get('use_dora') else ''})")
    base = Path(base) if base else Path(str(acfg.get("base_model_name_or_path") or ""))
    cfg = _load_json(base / "config.json") if str(base) else None
    if cfg is None:
        raise ConvertError(f"{d}: the base model's config.json was not found (give --base DIR)")
    arch = ARCHITECTURES.get((cfg.get("architectures") or [None])[0])
    if arch is None:
        raise ConvertError(f"base architecture {(cfg.get('architectures') or [None])[0]!r} is not converted by "
                           f"llampy (supported: {', '.join(ARCHITECTURES)})")
    r = int(acfg.get("r", 0))
    alpha = float(acfg.get("lora_alpha", r))
    if acfg.get("use_rslora"):
        # rank-stabilised LoRA scales by alpha / sqrt(r); llama.cpp scales by alpha / r, so alpha is written as
        # alpha * sqrt(r) to keep the adapter's meaning
        alpha *= float(np.sqrt(r))
    n_head = int(cfg["num_attention_heads"])
    n_head_kv = int(cfg.get("num_key_value_heads") or n_head)
    st = d / "adapter_model.safetensors"
    if not st.is_file():
        raise ConvertError(f"{d}: no adapter_model.safetensors")
    pairs: dict[str, dict[str, np.ndarray]] = {}
    for name, data in read_safetensors(st).items():
        m = re.fullmatch(r"(?:base_model\.model\.)?(.+)\.lora_([AB])(?:\.default)?\.weight", name)
        if m is None:
            raise ConvertError(f"{d}: tensor {name!r} is not a lora_A/lora_B weight (embeddings, DoRA magnitudes "
                               f"and extra modules are not converted)")
        pairs.setdefault(m.group(1) + ".weight", {})[m.group(2)] = data
    w = GGUFWriter(dst)
    w.add("general.architecture", arch)
    w.add("general.type", "adapter")
    w.add("adapter.type", "lora")
    w.add("general.name", d.resolve().name)
    w.add("general.quantization_version", QUANT_VERSION, VT.UINT32)
    w.add("adapter.lora.alpha", alpha, VT.FLOAT32)
    w.add("general.file_type", file_type, VT.UINT32)
    for hf in sorted(pairs):
        ab = pairs[hf]
        if set(ab) != {"A", "B"}:
            raise ConvertError(f"{d}: {hf} has lora_{'A' if 'A' not in ab else 'B'} missing")
        gn = gguf_name(hf, arch)
        if gn is None or gn.startswith(("token_embd", "output.")):
            raise ConvertError(f"{d}: cannot convert a LoRA of {hf!r}")
        a, b = np.asarray(ab["A"], np.float32), np.asarray(ab["B"], np.float32)
        if arch in PERMUTED:          # the product's rows are permuted as the base weight's are: B's rows
            if hf.endswith("q_proj.weight"):
                b = _permute(b, n_head)
            elif hf.endswith("k_proj.weight"):
                b = _permute(b, n_head_kv)
        for suffix, data in ((".lora_a", a), (".lora_b", b)):
            t = _tensor_type(gn + suffix, data.shape, matrix_type)
            w.add_tensor(gn + suffix, _encode(data, t), t)
            log(f"{gn + suffix:40s} -> {t.name}, shape = {{{', '.join(map(str, reversed(data.shape)))}}}")
    w.write()
    return dst
