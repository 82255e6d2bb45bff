"""Vocabularies for llampy convert: a SentencePiece tokenizer.model (its protobuf read directly) as llama.cpp's
"llama" tokenizer, or a byte-level BPE tokenizer.json as its "gpt2" one (pre-tokenizer named by llama.cpp's hash
table); special tokens, add_bos/add_eos and the chat template as gguf-py's SpecialVocab reads them."""
from __future__ import annotations

import hashlib
import struct
import warnings
from pathlib import Path

import numpy as np

from ..gguf.constants import GGUFValueType as VT
from .files import ConvertError, load_json as _load_json
from .pretok_hashes import CHKTXT, PRE_BY_HASH


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
    kv += _special_kv(*_special_tokens(d, tj, cfg, added))
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
    # SpecialVocab matches tokenizer_config.json's special tokens against tokenizer.json's added tokens only: with
    # a tokenizer.model alone, the ids come from config.json (<unk> named in tokenizer_config.json gets none)
    tj = _load_json(d / "tokenizer.json") or {}
    kv += _special_kv(*_special_tokens(d, tj, cfg, {a["content"]: a for a in tj.get("added_tokens", [])}))
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


# SpecialVocab.add_to_gguf writes a token type's id through GGUFWriter.add_<type>_token_id, under these keys (sic:
# "seperator"); cls has no such method and is left out. Only bos, eos and sep have add_add_<type>_token.
_ID_KEYS = {"bos": "bos_token_id", "eos": "eos_token_id", "unk": "unknown_token_id", "sep": "seperator_token_id",
            "pad": "padding_token_id", "mask": "mask_token_id"}
_ADD_KEYS = ("bos", "eos", "sep")


def _special_kv(ids: dict, add: dict) -> list:
    return ([(f"tokenizer.ggml.{_ID_KEYS[typ]}", i, (VT.UINT32,)) for typ, i in ids.items() if typ in _ID_KEYS]
            + [(f"tokenizer.ggml.add_{typ}_token", v, (VT.BOOL,)) for typ, v in add.items() if typ in _ADD_KEYS])


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
