"""The tokenizer, built from the GGUF vocabulary as llama.cpp's llama-vocab.cpp does.

- BPE (``tokenizer.ggml.model`` = gpt2): GPT-2 byte-to-unicode mapping, the pre-tokenizer regexes llama.cpp uses
  for ``tokenizer.ggml.pre``, merges by rank. The merging runs in HF's ``tokenizers`` (Rust) for speed.
- SPM (``llama``, e.g. Gemma): spaces become U+2581, adjacent symbols merge by the best vocabulary score, pieces
  missing from the vocabulary fall back to <0xXX> byte tokens.
- Special tokens (control and user-defined) are split out first when ``parse_special`` is on (user-defined ones
  always, as llama.cpp does); BOS/EOS are added per ``tokenizer.ggml.add_bos_token`` / ``add_eos_token``.
Detokenization is streaming-safe through ``StreamDecoder``: it never emits half a UTF-8 character.
"""
from __future__ import annotations

import heapq
import re

import numpy as np

NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6

# llama.cpp's pre-tokenizer regexes, by tokenizer.ggml.pre
_R_GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"
_R_LLAMA3 = (r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
             r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_R_QWEN2 = (r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
            r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
PRE_REGEXES = {
    "default": [r"[\p{P}\$\+<=>\^~\|]+", _R_GPT2, r"\p{N}+", "[0-9][0-9][0-9]"],
    "llama3": [_R_LLAMA3], "llama-bpe": [_R_LLAMA3], "llama-v3": [_R_LLAMA3], "falcon3": [_R_LLAMA3],
    "pixtral": [_R_LLAMA3], "dbrx": [_R_LLAMA3], "smaug-bpe": [_R_LLAMA3],
    "qwen2": [_R_QWEN2], "stablelm2": [_R_QWEN2], "hunyuan": [_R_QWEN2],
    "gpt-2": [_R_GPT2], "gpt2": [_R_GPT2], "mpt": [_R_GPT2], "olmo": [_R_GPT2], "jais": [_R_GPT2],
    "starcoder": [r"\p{N}", _R_GPT2], "refact": [r"\p{N}", _R_GPT2], "command-r": [r"\p{N}", _R_GPT2],
    "smollm": [r"\p{N}", _R_GPT2], "codeshell": [r"\p{N}", _R_GPT2], "exaone": [r"\p{N}", _R_GPT2],
    "falcon": [r"[\p{P}\$\+<=>\^~\|`]+", _R_GPT2, "[0-9][0-9][0-9]"],
    "deepseek-coder": ["[\r\n]", r"\s?\p{L}+", r"\s?\p{P}+", "[一-龥ࠀ-一가-퟿]+", r"\p{N}"],
}
IGNORE_MERGES = {"llama3", "llama-bpe", "llama-v3", "falcon3", "pixtral", "dbrx", "smaug-bpe"}
EOG_TEXTS = {"<|eot_id|>", "<|im_end|>", "<|end|>", "<end_of_turn>", "<|endoftext|>", "<|return|>", "<EOT>",
             "_<EOT>", "<|end_of_text|>", "<｜end▁of▁sentence｜>", "<|eom_id|>", "<|call|>"}


def _bytes_to_unicode() -> dict[int, str]:
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, map(chr, cs)))


BYTE_TO_UNICODE = _bytes_to_unicode()
UNICODE_TO_BYTE = {v: k for k, v in BYTE_TO_UNICODE.items()}


class Vocab:
    def __init__(self, tokens: list[str], types: np.ndarray, scores: np.ndarray | None, model: str, pre: str,
                 merges: list[str] | None, bos, eos, eot, unk, pad, add_bos: bool, add_eos: bool,
                 add_space_prefix: bool):
        self.tokens = tokens
        self.n_tokens = len(tokens)
        self.types = np.asarray(types, dtype=np.int32)
        self.scores = scores
        self.type = model
        self.pre = pre
        self.bos, self.eos, self.eot, self.unk, self.pad = bos, eos, eot, unk, pad
        self.add_bos, self.add_eos = add_bos, add_eos
        self.add_space_prefix = add_space_prefix
        self.token_to_id = {t: i for i, t in enumerate(tokens)}
        self.eog = {t for t in (eos, eot) if t is not None}
        for i in np.flatnonzero((self.types == CONTROL) | (self.types == USER_DEFINED)):
            if tokens[i] in EOG_TEXTS:
                self.eog.add(int(i))
        # special tokens, longest first (tokenizer_st_partition)
        sp = np.flatnonzero((self.types == CONTROL) | (self.types == USER_DEFINED) | (self.types == UNKNOWN))
        sp = [int(i) for i in sp if tokens[i]]
        sp.sort(key=lambda i: -len(tokens[i]))
        self._special = sp
        self._special_re = {}
        self._piece_cache: dict[int, bytes] = {}
        if model == "gpt2":
            self._init_bpe(merges or [])
        elif model == "llama":
            self._byte_tokens = {}
            for i in np.flatnonzero(self.types == BYTE):
                t = tokens[i]
                if len(t) == 6 and t.startswith("<0x"):
                    self._byte_tokens[int(t[3:5], 16)] = int(i)
        else:
            raise ValueError(f"unsupported tokenizer model {model!r} (tokenizer.ggml.model): supported gpt2, llama")

    @classmethod
    def from_metadata(cls, md: dict) -> "Vocab":
        model = md.get("tokenizer.ggml.model")
        if model is None:
            raise ValueError("missing metadata key 'tokenizer.ggml.model'")
        tokens = md.get("tokenizer.ggml.tokens")
        if tokens is None:
            raise ValueError("missing metadata key 'tokenizer.ggml.tokens'")
        n = len(tokens)
        types = md.get("tokenizer.ggml.token_type")
        types = np.asarray(types, dtype=np.int32) if types is not None else np.full(n, NORMAL, np.int32)
        if len(types) != n:
            raise ValueError(f"tokenizer.ggml.token_type has {len(types)} entries for {n} tokens")
        scores = md.get("tokenizer.ggml.scores")
        pre = str(md.get("tokenizer.ggml.pre", "default"))
        if model == "gpt2" and pre not in PRE_REGEXES:
            pre = "default"   # llama.cpp warns and falls back to the default pre-tokenizer
        get = lambda k: (int(md[k]) if k in md and 0 <= int(md[k]) < n else None)
        default_bos = model == "llama"
        return cls(list(tokens), types, None if scores is None else np.asarray(scores, np.float32), str(model), pre,
                   md.get("tokenizer.ggml.merges"), get("tokenizer.ggml.bos_token_id"),
                   get("tokenizer.ggml.eos_token_id"), get("tokenizer.ggml.eot_token_id"),
                   get("tokenizer.ggml.unknown_token_id"), get("tokenizer.ggml.padding_token_id"),
                   bool(md.get("tokenizer.ggml.add_bos_token", default_bos)),
                   bool(md.get("tokenizer.ggml.add_eos_token", False)),
                   bool(md.get("tokenizer.ggml.add_space_prefix", model == "llama")))

    # ------------------------------------------------------------------ BPE
    def _init_bpe(self, merges: list[str]) -> None:
        from tokenizers import Regex, Tokenizer, models, pre_tokenizers
        pairs = []
        for m in merges:
            a, sep, b = m.partition(" ")
            if sep:
                pairs.append((a, b))
        vocab = {t: i for i, t in enumerate(self.tokens) if self.types[i] in (NORMAL, UNUSED, BYTE, UNKNOWN)}
        bpe = models.BPE(vocab=vocab, merges=pairs, ignore_merges=self.pre in IGNORE_MERGES)
        tk = Tokenizer(bpe)
        tk.pre_tokenizer = pre_tokenizers.Sequence(
            [pre_tokenizers.Split(Regex(r), behavior="isolated") for r in PRE_REGEXES[self.pre]]
            + [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
        self._hf = tk

    def _bpe(self, text: str) -> list[int]:
        if not text:
            return []
        return self._hf.encode(text, add_special_tokens=False).ids

    # ------------------------------------------------------------------ SPM
    def _spm(self, text: str) -> list[int]:
        if not text:
            return []
        text = text.replace(" ", "\u2581")
        syms = list(text)
        n = len(syms)
        prev = list(range(-1, n - 1))
        nxt = list(range(1, n + 1))
        nxt[-1] = -1
        alive = [True] * n
        heap = []
        tid = self.token_to_id
        scores = self.scores

        def push(i, j):
            s = syms[i] + syms[j]
            t = tid.get(s)
            if t is not None:
                heapq.heappush(heap, (-float(scores[t]) if scores is not None else 0.0, i, s))

        for i in range(n - 1):
            push(i, i + 1)
        while heap:
            _, i, s = heapq.heappop(heap)
            j = nxt[i]
            if not alive[i] or j < 0 or syms[i] + syms[j] != s:
                continue
            syms[i] = s
            alive[j] = False
            nxt[i] = nxt[j]
            if nxt[j] >= 0:
                prev[nxt[j]] = i
            if prev[i] >= 0:
                push(prev[i], i)
            if nxt[i] >= 0:
                push(i, nxt[i])
        out = []
        i = 0
        while i >= 0 and i < n:
            if alive[i]:
                t = tid.get(syms[i])
                if t is not None:
                    out.append(t)
                else:
                    for b in syms[i].encode("utf-8"):
                        bt = self._byte_tokens.get(b)
                        if bt is None:
                            if self.unk is not None:
                                out.append(self.unk)
                        else:
                            out.append(bt)
            i = nxt[i]
        return out

    # ------------------------------------------------------------------ public
    def _partition(self, text: str, parse_special: bool) -> list:
        """Split text on special tokens: a list of str fragments and int ids."""
        cands = [i for i in self._special if parse_special or self.types[i] == USER_DEFINED]
        if not cands:
            return [text]
        key = parse_special
        rx = self._special_re.get(key)
        if rx is None:
            rx = re.compile("|".join(re.escape(self.tokens[i]) for i in cands))
            self._special_re[key] = rx
        out, pos = [], 0
        for m in rx.finditer(text):
            if m.start() > pos:
                out.append(text[pos:m.start()])
            out.append(self.token_to_id[m.group(0)])
            pos = m.end()
        if pos < len(text):
            out.append(text[pos:])
        return out

    def tokenize(self, text: str, add_special: bool = False, parse_special: bool = False) -> list[int]:
        ids: list[int] = []
        if add_special and self.add_bos and self.bos is not None:
            ids.append(self.bos)
        encode = self._bpe if self.type == "gpt2" else self._spm
        first = True
        for frag in self._partition(text, parse_special):
            if isinstance(frag, int):
                ids.append(frag)
            else:
                if self.type == "llama" and self.add_space_prefix and first:
                    frag = " " + frag
                ids.extend(encode(frag))
            first = False
        if add_special and self.add_eos and self.eos is not None:
            ids.append(self.eos)
        return ids

    def token_to_piece(self, id: int, special: bool = True) -> bytes:
        id = int(id)
        if not 0 <= id < self.n_tokens:
            raise ValueError(f"token id {id} is outside the vocabulary (0..{self.n_tokens - 1})")
        t = self.types[id]
        text = self.tokens[id]
        if t == CONTROL:
            return text.encode("utf-8") if special else b""
        if t == UNUSED:
            return b""
        if t == USER_DEFINED:
            return text.encode("utf-8")
        if self.type == "gpt2":
            p = self._piece_cache.get(id)
            if p is None:
                try:
                    p = bytes(UNICODE_TO_BYTE[c] for c in text)
                except KeyError:
                    p = text.encode("utf-8")
                self._piece_cache[id] = p
            return p
        if t == BYTE and len(text) == 6:
            return bytes([int(text[3:5], 16)])
        return text.replace("\u2581", " ").encode("utf-8")

    def detokenize(self, ids, special: bool = True) -> str:
        return b"".join(self.token_to_piece(i, special) for i in ids).decode("utf-8", errors="replace")

    def is_eog(self, id: int) -> bool:
        return int(id) in self.eog

    def is_control(self, id: int) -> bool:
        return self.types[int(id)] == CONTROL

    def token_text(self, id: int) -> str:
        return self.tokens[int(id)]


class StreamDecoder:
    """Incremental detokenizer: feed ids, get text that never ends inside a UTF-8 character."""

    def __init__(self, vocab: Vocab, special: bool = True):
        self.vocab = vocab
        self.special = special
        self.pending = b""

    def feed(self, id: int) -> str:
        self.pending += self.vocab.token_to_piece(id, self.special)
        b = self.pending
        # keep back an incomplete trailing UTF-8 sequence
        cut = len(b)
        for k in range(1, min(4, len(b)) + 1):
            c = b[-k]
            if c & 0xC0 == 0x80:
                continue
            need = 1 if c < 0x80 else 2 if c >> 5 == 6 else 3 if c >> 4 == 14 else 4 if c >> 3 == 30 else 1
            if need > k:
                cut = len(b) - k
            break
        out, self.pending = b[:cut], b[cut:]
        return out.decode("utf-8", errors="replace")

    def flush(self) -> str:
        out, self.pending = self.pending, b""
        return out.decode("utf-8", errors="replace")
