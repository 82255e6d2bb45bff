"""The tokenizer, built from the GGUF vocabulary as llama.cpp's llama-vocab.cpp builds it.

- Loading follows ``llama_vocab::impl::load``: per-type defaults for BOS/EOS/UNK and add_bos/add_space_prefix,
  overridden by the ``tokenizer.ggml.*`` keys; token attributes from the token types, then llama.cpp's text-based
  fix-ups (EOT/EOM/FIM tokens forced to control, "unused" control tokens, the end-of-generation set, the phi-3
  rstrip attributes).
- ``tokenize`` splits out special tokens first (``tokenizer_st_partition``: longest token first, each one over all
  remaining text; control and unknown tokens only with ``parse_special``, user-defined ones always), then runs the
  model on each text fragment: BPE (vocab_bpe.py: byte-level with every llama.cpp pre-tokenizer, gemma4's raw-UTF-8
  BPE, the whitespace and hybriddna variants), SPM (vocab_spm.py), WPM/BERT (vocab_wpm.py), UGM/T5 (vocab_ugm.py),
  RWKV (vocab_rwkv.py) or PLaMo-2 (vocab_plamo2.py). Where llama.cpp picks among tokens by iterating its hash map,
  vocab_order.py gives libstdc++'s order.
- ``token_to_piece`` / ``detokenize`` give llama.cpp's bytes (``clean_spaces`` clean-up, leading-space removal).
  ``StreamDecoder`` turns a stream of ids into text that never ends inside a UTF-8 character.
"""
from __future__ import annotations

import codecs
import re

import numpy as np

from .vocab_bpe import PRE_TYPES, UNICODE_TO_BYTE, UNSUPPORTED_PRE, BpeMerger, byte_encode, pre_tokenizer
from .vocab_plamo2 import Plamo2Tokenizer
from .vocab_rwkv import RwkvTokenizer, rwkv_unescape
from .vocab_spm import spm_tokenize
from .vocab_ugm import UgmTokenizer
from .vocab_wpm import wpm_tokenize

# GGUF token types (tokenizer.ggml.token_type)
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6
# llama_token_attr bits
ATTR_UNKNOWN, ATTR_UNUSED, ATTR_NORMAL, ATTR_CONTROL, ATTR_USER_DEFINED, ATTR_BYTE = 1, 2, 4, 8, 16, 32
ATTR_LSTRIP, ATTR_RSTRIP = 128, 256
_TYPE_TO_ATTR = np.array([0, ATTR_NORMAL, ATTR_UNKNOWN, ATTR_CONTROL, ATTR_USER_DEFINED, ATTR_UNUSED, ATTR_BYTE],
                         np.int32)

_K = "tokenizer.ggml."
# llama.cpp's list of model types: the ones llampy implements, and the rest it knows by name
_MODELS = {"llama": "spm", "gpt2": "bpe", "gemma4": "bpe", "whitespace": "bpe", "hybriddna": "bpe", "bert": "wpm",
           "t5": "ugm", "rwkv": "rwkv", "plamo2": "plamo2"}
_KNOWN_MODELS = {"no_vocab", "none", "test"}
_DNA_MARKER = "\ue000"     # hybriddna: the suffix that keeps k-mer tokens apart from the same text in the BPE part

# token texts llama.cpp recognises (load(): "auto-detect special tokens by text")
_EOT_TEXTS = ("<|eot_id|>", "<|im_end|>", "<|end|>", "<end_of_turn>", "<|endoftext|>", "<|end_of_text|>", "<EOT>",
              "_<EOT>", "[EOT]", "<｜end▁of▁sentence｜>", "<end_of_utterance>")
_FIM_TEXTS = {
    "fim_pre": ("<|fim_prefix|>", "<fim-prefix>", "<fim_prefix>", "<｜fim▁begin｜>", "<PRE>", "▁<PRE>",
                "<|code_prefix|>", "<|prefix|>"),
    "fim_suf": ("<|fim_suffix|>", "<fim-suffix>", "<fim_suffix>", "<｜fim▁hole｜>", "<SUF>", "▁<SUF>",
                "<|code_suffix|>", "<|suffix|>"),
    "fim_mid": ("<|fim_middle|>", "<fim-middle>", "<fim_middle>", "<｜fim▁end｜>", "<MID>", "▁<MID>",
                "<|code_middle|>", "<|middle|>"),
    "fim_pad": ("<|fim_pad|>", "<fim-pad>", "<fim_pad>", "<PAD>", "[PAD]"),
    "fim_rep": ("<|fim_repo|>", "<|repo_name|>", "<fim-repo>", "<REPO>", "<reponame>"),
    "fim_sep": ("<|file_sep|>",),
}
_EOG_TEXTS = ("<|eot_id|>", "<|im_end|>", "<|end|>", "<|return|>", "<|call|>", "<|flush|>", "<|calls|>",
              "<end_of_turn>", "<|endoftext|>", "</s>", "<|eom_id|>", "<EOT>", "_<EOT>", "[EOT]", "[EOS]",
              "<|end_of_text|>", "<end_of_utterance>", "<eos>", "<turn|>", "<|tool_response>",
              "<｜end▁of▁sentence｜>", "[e~[")
_C_SPACE = " \t\n\v\f\r"   # C isspace, for the lstrip/rstrip attributes


def _hex_byte(s: str) -> int:
    """A byte token's byte as llama.cpp's token_to_byte reads it from "<0xNN>": strtol(s, 16) into a uint8_t, so
    the leading hex digits, or 0 when there are none (a token marked BYTE whose text is something else)."""
    n = 0
    for c in s:
        d = "0123456789abcdef".find(c.lower())
        if d < 0:
            break
        n = n * 16 + d
    return n & 0xFF


class VocabError(ValueError):
    """A vocabulary the file describes that cannot be used (a missing or malformed tokenizer key), or text it
    cannot encode."""


class Vocab:
    """A GGUF vocabulary. Build it with ``Vocab.from_metadata(reader.metadata)``."""

    n_tokens: int
    type: str               # 'spm' | 'bpe'
    model: str              # tokenizer.ggml.model: 'llama' | 'gpt2'
    pre: str
    bos: int | None
    eos: int | None
    eom: int | None
    unk: int | None
    pad: int | None
    eog: set[int]
    add_bos: bool
    add_eos: bool

    # ------------------------------------------------------------------------------------------------ loading
    @classmethod
    def from_metadata(cls, md: dict) -> "Vocab":
        self = cls()
        model = md.get(_K + "model")
        if model is None:
            raise VocabError(f"missing metadata key '{_K}model' (the tokenizer type)")
        if not isinstance(model, str):
            raise VocabError(f"'{_K}model' must be a string, not {type(model).__name__}")
        if model not in _MODELS:
            what = "not implemented in llampy" if model in _KNOWN_MODELS else "unknown to llama.cpp"
            raise VocabError(f"unsupported tokenizer model {model!r} in '{_K}model' ({what}; "
                             f"llampy reads {', '.join(sorted(_MODELS))})")
        self.model, self.type = str(model), _MODELS[model]
        tokens = md.get(_K + "tokens")
        if tokens is None:
            raise VocabError(f"missing metadata key '{_K}tokens' (the vocabulary)")
        if not isinstance(tokens, (list, tuple)) or (len(tokens) and not isinstance(tokens[0], str)):
            raise VocabError(f"'{_K}tokens' must be an array of strings")
        tokens = list(tokens)
        n = self.n_tokens = len(tokens)
        if "" in tokens:       # llama.cpp renames empty tokens so that every text maps back to one id
            tokens = [t or f"[EMPTY_{i}]" for i, t in enumerate(tokens)]
        self.tokens = self._lookup_texts = tokens
        if model == "hybriddna" and "<oov>" in tokens:
            # the k-mers after <oov> are looked up with their marker but read without it (llama.cpp erases it from
            # id_to_token once token_to_id is built)
            k = n - 1 - tokens[::-1].index("<oov>")
            self.tokens = tokens[:k + 1] + [t[:-1] if len(t) > 1 and t.endswith(_DNA_MARKER) else t
                                            for t in tokens[k + 1:]]
        self._token_to_id = None

        types = md.get(_K + "token_type")
        if types is None:
            self.attr = np.full(n, ATTR_NORMAL, np.int32)
        else:
            types = np.asarray(types)
            if types.ndim != 1 or len(types) < n or not np.issubdtype(types.dtype, np.integer):
                raise VocabError(f"'{_K}token_type' must be an integer array with one entry per token ({n})")
            types = types[:n].astype(np.int64)
            self.attr = np.where((types >= 0) & (types < 7), _TYPE_TO_ATTR[np.clip(types, 0, 6)], 0).astype(np.int32)
        scores = md.get(_K + "scores")
        if scores is not None:
            scores = np.asarray(scores)
            if len(scores) < n:
                raise VocabError(f"'{_K}scores' has {len(scores)} entries for {n} tokens")
            scores = scores[:n].astype(np.float32)
        self.scores = scores

        # per-type defaults (load(): "determine vocab type"), then the pre-tokenizer's own settings
        self.add_eos = False
        self.escape_whitespaces, self.byte_encode = True, True
        if self.type == "spm":
            self.pre, opts = "default", {}
            ids = dict(bos=1, eos=2, unk=0)
            self.add_bos, self.add_space_prefix, self.clean_spaces = True, True, False
        elif self.type == "wpm":
            self.pre, opts = "default", {}
            ids = dict(bos=101, eos=None, unk=100, sep=102, pad=0, mask=103)
            self.add_bos, self.add_space_prefix, self.clean_spaces = True, False, True
        elif self.type == "ugm":
            self.pre, opts = "default", {}
            ids = dict(bos=None, eos=1, unk=2, pad=0)
            self.add_bos, self.add_eos, self.add_space_prefix, self.clean_spaces = False, True, False, False
        elif self.type == "rwkv":
            self.pre, opts = "default", {}
            ids = dict(bos=None, eos=None, unk=None)
            self.add_bos, self.add_space_prefix, self.clean_spaces = False, False, False
        elif self.type == "plamo2":
            self.pre, opts = "default", {}
            ids = dict(bos=1, eos=2, unk=0, pad=3)
            self.add_bos, self.add_space_prefix, self.clean_spaces = False, False, False
        else:
            # gemma4's model type is BPE over raw UTF-8 with its own pre-tokenizer, whatever the file's pre says
            pre = md.get(_K + "pre", "")
            if not isinstance(pre, str):
                raise VocabError(f"'{_K}pre' must be a string, not {type(pre).__name__}")
            pre = "gemma4" if model == "gemma4" else (pre or "default")   # '' -> 'default'
            if pre in UNSUPPORTED_PRE:
                raise VocabError(f"pre-tokenizer {pre!r} ('{_K}pre') is not implemented in llampy")
            if pre not in PRE_TYPES:       # llama.cpp refuses the model: "unknown pre-tokenizer type"
                raise VocabError(f"unknown pre-tokenizer type {pre!r} in '{_K}pre'")
            self.pre, opts = pre, PRE_TYPES[pre][1]
            ids = dict(bos=None if opts.get("no_bos") else 11, eos=11, unk=None)
            if model == "gemma4":
                ids = dict(bos=None, eos=None, unk=None)
            self.add_bos, self.add_space_prefix = opts.get("add_bos", False), False
            self.clean_spaces = opts.get("clean_spaces", True)
            self.escape_whitespaces = opts.get("escape_whitespaces", False)
            self.byte_encode = opts.get("byte_encode", True)
        self.ignore_merges = opts.get("ignore_merges", False)
        def flag(key: str, default: bool) -> bool:
            v = md.get(_K + key, default)
            if not isinstance(v, (bool, np.bool_)):
                raise VocabError(f"'{_K}{key}' must be a boolean, not {type(v).__name__}")
            return bool(v)

        self.add_space_prefix = flag("add_space_prefix", self.add_space_prefix)
        self.remove_extra_whitespaces = flag("remove_extra_whitespaces", False)
        # BertNormalizer options (WPM): strip_accents follows lowercase unless the file says
        self.lowercase = flag("normalizer.lowercase", opts.get("lowercase", True))
        self.strip_accents = flag("normalizer.strip_accents", self.lowercase)

        def special_id(key: str, default):
            default = default if default is not None and 0 <= default < n else None
            v = md.get(_K + key)
            if v is None:
                return default
            if isinstance(v, np.generic):
                v = v.item()
            if isinstance(v, bool) or not isinstance(v, int):
                raise VocabError(f"'{_K}{key}' must be a token id (an integer), not {type(v).__name__}")
            return v if 0 <= v < n else default          # llama.cpp: "bad special token ... using default id"

        self.bos = special_id("bos_token_id", ids["bos"])
        self.eos = special_id("eos_token_id", ids["eos"])
        self.eot = special_id("eot_token_id", None)
        self.eom = special_id("eom_token_id", None)
        self.unk = special_id("unknown_token_id", ids["unk"])
        self.sep = special_id("seperator_token_id", ids.get("sep"))      # sic: the GGUF key is spelt so
        self.pad = special_id("padding_token_id", ids.get("pad"))
        self.mask = special_id("mask_token_id", ids.get("mask"))
        fim = {k: special_id(k + "_token_id", None) for k in _FIM_TEXTS}
        for old, new in (("prefix", "fim_pre"), ("suffix", "fim_suf"), ("middle", "fim_mid")):
            fim[new] = special_id(old + "_token_id", fim[new])
        self.add_bos = flag("add_bos_token", self.add_bos)
        self.add_eos = flag("add_eos_token", self.add_eos)
        if opts.get("force_bos"):      # llama.cpp overrides a false add_bos_token for Gemma 4's pre-tokenizer type
            self.add_bos = True

        self._detect_special_tokens(fim)
        self._set_name_attrs(md)
        self.fim = fim
        self._build_special_cache()
        self._piece_cache: dict[tuple[int, bool], bytes] = {}
        # The text -> id map (used above, then let go) and the BPE merger are made again on first use (tokenize):
        # a program that only decodes (llampy bench) keeps neither (SmolLM2: ~30 MiB with the HF tokenizer, Gemma 3:
        # ~15 MiB of peak RSS).
        self._token_to_id = None
        self._bpe_merger = self._byte_id_list = None
        if self.type == "bpe":
            merges = md.get(_K + "merges")
            if merges is None:
                raise VocabError(f"missing metadata key '{_K}merges' (BPE merges)")
            if not isinstance(merges, list) or (merges and not isinstance(merges[0], str)):
                raise VocabError(f"'{_K}merges' must be an array of strings")
            self._merges = merges
            self._pre = pre_tokenizer(self.pre)
        elif self.type == "ugm":
            self._charsmap = md.get(_K + "precompiled_charsmap")
            self._ugm = None
        elif self.type == "wpm":
            self._wpm_ids = None
        elif self.type in ("rwkv", "plamo2"):
            self._rwkv = None           # the RWKV or PLaMo-2 tokenizer, made on first use
        elif self.type == "spm":
            self._spm_scores = None                             # a list of floats, made on first use
        return self

    _eot = None
    _eot_pending = None

    @property
    def eot(self) -> int | None:
        if self._eot_pending:
            self._eot, self._eot_pending = self._map_first(self._eot_pending), None
        return self._eot

    @eot.setter
    def eot(self, value: int | None) -> None:
        self._eot, self._eot_pending = value, None

    def _map_first(self, ids: list[int]) -> int:
        """Of ids whose texts llama.cpp matched while iterating its token_to_id, the one it met first (the iteration
        order of libstdc++'s unordered_map, replayed by vocab_order)."""
        if len(ids) == 1:
            return ids[0]
        from .vocab_order import iteration_order
        order = iteration_order(self.tokens, distinct=len(self.token_to_id) == self.n_tokens)
        pos = np.empty(self.n_tokens, np.int64)
        pos[order] = np.arange(len(order))
        return min(ids, key=lambda i: int(pos[self.tokens.index(self.tokens[i])]))     # a text's node: its first id

    @property
    def token_to_id(self) -> dict[str, int]:
        if self._token_to_id is None:    # a repeated text maps to its last id, as in llama.cpp
            self._token_to_id = dict(zip(self._lookup_texts, range(self.n_tokens)))
        return self._token_to_id

    @property
    def _bpe(self) -> BpeMerger:
        if self._bpe_merger is None:
            self._bpe_merger = BpeMerger(self.token_to_id, list(self._merges), self.ignore_merges, self.byte_encode)
        return self._bpe_merger

    @property
    def _byte_ids(self) -> list:
        if self._byte_id_list is None:
            tid = self.token_to_id
            self._byte_id_list = [tid.get(f"<0x{b:02X}>", tid.get(chr(b)) if b < 0x80 else None) for b in range(256)]
        return self._byte_id_list

    def _detect_special_tokens(self, fim: dict) -> None:
        """llama.cpp finds EOT/EOM/FIM tokens by their text when the file names none, forces them to be control
        tokens, and collects the end-of-generation set the same way. Where several texts match, llama.cpp takes
        whichever its hash map (libstdc++'s unordered_map) yields first: vocab_order replays that order."""
        tid, attr = self.token_to_id, self.attr

        def find(texts):
            return sorted(tid[t] for t in texts if t in tid)

        def force_control(i):
            attr[i] |= ATTR_CONTROL

        if self.eot is None and (found := find(_EOT_TEXTS)):
            # every EOT text is also an EOG text (forced to control below), so which one is EOT changes nothing else:
            # where several match, the choice waits for the first read of .eot
            self._eot_pending = found if len(found) > 1 else None
            self._eot = found[0]
            force_control(self._eot)
        if self.eom is None and "<|eom_id|>" in tid:
            self.eom = tid["<|eom_id|>"]
            force_control(self.eom)
        for k, texts in _FIM_TEXTS.items():
            if fim[k] is None and (found := find(texts)):
                fim[k] = self._map_first(found)
                force_control(fim[k])
        for i in np.flatnonzero(attr & ATTR_CONTROL):            # control tokens named "unused..."
            if "unused" in self.tokens[i]:
                attr[i] |= ATTR_UNUSED

        eog = {fim[k] for k in ("fim_pad", "fim_rep", "fim_sep") if fim[k] is not None}
        for i in find(_EOG_TEXTS):
            eog.add(i)
            force_control(i)
        for t in ("<|channel|>", "<|message|>", "<|start|>", "<|constrain|>"):   # gpt-oss: always rendered
            if t in tid:
                attr[tid[t]] = ATTR_USER_DEFINED
        eog |= {i for i in (self.eos, self.eot, self.eom) if i is not None}
        texts = {self.tokens[i]: i for i in eog}
        # o200k_harmony / solar-open: "<|end|>" ends a message, not the generation
        if "<|end|>" in texts and (("<|return|>" in texts and "<|call|>" in texts)
                                   or (("<|call|>" in texts or "<|calls|>" in texts) and "<|flush|>" in texts)):
            eog.discard(texts["<|end|>"])
            attr[texts["<|end|>"]] = ATTR_USER_DEFINED
        # gemma4 / plamo: "</s>" is a normal token there
        if "</s>" in texts and ("<|tool_response>" in texts or "<|plamo:eos|>" in texts):
            eog.discard(texts["</s>"])
            attr[texts["</s>"]] = ATTR_NORMAL
        self.eog = eog

    def _set_name_attrs(self, md: dict) -> None:
        """llama.cpp's per-model token attributes, chosen by model name, pre-tokenizer or architecture."""
        name = str(md.get("general.name", "")).lower()
        pre, arch = str(md.get(_K + "pre", "")), str(md.get("general.architecture", ""))
        tid, attr = self.token_to_id, self.attr
        if any(s in pre for s in ("jina-v2-de", "jina-v2-es", "jina-v2-code")) or arch in ("nomic-bert-moe",
                                                                                          "jina-bert-v3"):
            if "<mask>" in tid:
                attr[tid["<mask>"]] |= ATTR_LSTRIP
        elif "phi-3" in name or "phi3" in name:
            attr[(attr & (ATTR_CONTROL | ATTR_USER_DEFINED | ATTR_UNKNOWN)) != 0] |= ATTR_RSTRIP
            if "</s>" in tid:
                attr[tid["</s>"]] |= ATTR_RSTRIP
            for t in ("<unk>", "<s>", "<|endoftext|>"):
                if t in tid:
                    attr[tid[t]] &= ~ATTR_RSTRIP
        elif "modern-bert" in name and "[MASK]" in tid:
            attr[tid["[MASK]"]] |= ATTR_LSTRIP

    def _build_special_cache(self) -> None:
        """Special tokens (control, user-defined, unknown), longest first, indexed by their first two characters
        so that a text is only searched for the tokens that can occur in it."""
        ids = np.flatnonzero(self.attr & (ATTR_CONTROL | ATTR_USER_DEFINED | ATTR_UNKNOWN))
        ids = sorted(ids.tolist(), key=lambda i: (-len(self.tokens[i]), i))
        self._special_rank = {i: r for r, i in enumerate(ids)}
        by_prefix: dict[str, list[int]] = {}
        for i in ids:
            by_prefix.setdefault(self.tokens[i][:2], []).append(i)
        self._special_by_prefix = by_prefix
        firsts = {p[0] for p in by_prefix}
        self._special_first = re.compile("[" + "".join(re.escape(c) for c in sorted(firsts)) + "]") if firsts \
            else None

    # ------------------------------------------------------------------------------------------------ tokenize
    def _specials_in(self, text: str, parse_special: bool) -> list[int]:
        """The special tokens that occur in ``text`` (and apply), in llama.cpp's order: longest first."""
        if self._special_first is None:
            return []
        grams = {text[m.start():m.start() + 2] for m in self._special_first.finditer(text)}
        keys = grams | {g[0] for g in grams}
        skip = 0 if parse_special else (ATTR_CONTROL | ATTR_UNKNOWN)
        found = set()
        for k in keys:
            for i in self._special_by_prefix.get(k, ()):
                if not (self.attr[i] & skip) and self.tokens[i] in text:
                    found.add(i)
        return sorted(found, key=self._special_rank.__getitem__)

    def _partition(self, text: str, parse_special: bool) -> list:
        """tokenizer_st_partition: each special token in turn (longest first) splits every remaining text
        fragment at all its occurrences. Returns str fragments and int ids."""
        frags: list = [text]
        for sid in self._specials_in(text, parse_special):
            tok, a = self.tokens[sid], int(self.attr[sid])
            out = []
            for f in frags:
                if isinstance(f, int) or tok not in f:
                    out.append(f)
                    continue
                pos = 0
                while True:
                    m = f.find(tok, pos)
                    if m < 0:
                        if pos < len(f):
                            out.append(f[pos:])
                        break
                    left = f[pos:m]
                    if a & ATTR_LSTRIP:
                        left = left.rstrip(_C_SPACE)
                    if left:
                        out.append(left)
                    out.append(sid)
                    pos = m + len(tok)
                    if a & ATTR_RSTRIP:
                        while pos < len(f) and f[pos] in _C_SPACE:
                            pos += 1
            frags = out
        return frags

    def tokenize(self, text: str, add_special: bool = False, parse_special: bool = False) -> list[int]:
        """llama_tokenize: ``add_special`` adds BOS/EOS as the vocabulary asks; ``parse_special`` lets control
        tokens written in the text become their ids."""
        frags = self._partition(text, parse_special) if text else []
        out: list[int] = []
        # WPM always wraps in [CLS] ... [SEP] (BOS, SEP); RWKV and PLaMo-2 add nothing; the others as add_bos/add_eos
        bare = self.type in ("rwkv", "plamo2")
        add_bos = add_special and (self.type == "wpm" or (self.add_bos and not bare))
        add_eos = add_special and self.type != "wpm" and self.add_eos and not bare
        if add_bos:
            if self.bos is None:
                raise VocabError("the vocabulary asks for a BOS token but has none")
            out.append(self.bos)
        if self.type in ("wpm", "ugm", "rwkv", "plamo2"):
            run = self._word_tokenizer()
            for f in frags:
                if isinstance(f, int):
                    out.append(f)
                else:
                    out += run(f)
        elif self.type == "spm":
            if self._spm_scores is None:
                self._spm_scores = self.scores.tolist() if self.scores is not None else [0.0] * self.n_tokens
            prev_special = True             # a space prefix goes before the first text and after special tokens
            for f in frags:
                if isinstance(f, int):
                    out.append(f)
                    prev_special = True
                    continue
                if self.add_space_prefix and prev_special:
                    f = " " + f
                out += spm_tokenize(f.replace(" ", "\u2581"), self.token_to_id, self._spm_scores, self._byte_ids)
                prev_special = False
        else:
            for f in frags:
                if isinstance(f, int):
                    out.append(f)
                elif self.model == "hybriddna":
                    out += self._dna_tokenize(f)
                elif self.model == "whitespace":    # segments between whitespace, lowercased, each pre-tokenized
                    for seg in _whitespace_segments(f, self.lowercase):
                        out += self._bpe.merge(self._pre.split(seg))
                elif self.byte_encode:
                    out += self._bpe.merge([byte_encode(w) for w in self._pre.split(f)])
                else:       # SPM-style BPE (gemma4): spaces escaped, merges over the raw UTF-8 of each line
                    if self.escape_whitespaces:
                        f = f.replace(" ", "\u2581")
                    out += self._bpe.merge(self._pre.split(f))
        if add_special and self.type == "wpm":
            if self.sep is None:
                raise VocabError("the vocabulary has no SEP token to end the text with")
            out.append(self.sep)
        if add_eos:
            if self.eos is None:
                raise VocabError("the vocabulary asks for an EOS token but has none")
            out.append(self.eos)
        return out

    def _bpe_text(self, text: str) -> list[int]:
        return self._bpe.merge([byte_encode(w) for w in self._pre.split(text)]) if text else []

    def _dna_tokenize(self, text: str) -> list[int]:
        """llm_tokenizer_hybriddna_session: BPE outside <dna>...</dna>; inside, the sequence upper-cased (ASCII) in
        6-byte k-mers, the last padded with 'A', each the token of its text and marker, else <oov>."""
        tid = self.token_to_id
        begin, end_, oov = tid.get("<dna>"), tid.get("</dna>"), tid.get("<oov>")
        if begin is None or end_ is None or oov is None:
            return self._bpe_text(text)
        out: list[int] = []
        pos = 0
        while pos < len(text):
            start = text.find("<dna>", pos)
            if start < 0:
                out += self._bpe_text(text[pos:])
                break
            out += self._bpe_text(text[pos:start])
            out.append(begin)
            c0 = start + len("<dna>")
            stop = text.find("</dna>", c0)
            seq = (text[c0:] if stop < 0 else text[c0:stop]).encode("utf-8", "surrogatepass")
            seq = bytes(b - 32 if 0x61 <= b <= 0x7A else b for b in seq)
            for i in range(0, len(seq), 6):
                kmer = seq[i:i + 6].ljust(6, b"A")
                try:
                    out.append(tid.get(kmer.decode("utf-8") + _DNA_MARKER, oov))
                except UnicodeDecodeError:
                    out.append(oov)
            if stop < 0:
                break
            out.append(end_)
            pos = stop + len("</dna>")
        return out

    def _word_tokenizer(self):
        """The WPM, UGM, RWKV or PLaMo-2 tokenizer of one text fragment (its tables made on first use)."""
        if self.type == "wpm":
            if self._wpm_ids is None:
                self._wpm_ids = {t.encode("utf-8", "surrogatepass"): i for i, t in enumerate(self.tokens)}
                self._wpm_max = max(map(len, self._wpm_ids))
            return lambda f: wpm_tokenize(f, self._wpm_ids, self.unk, self._wpm_max, self.lowercase,
                                          self.strip_accents)
        if self.type == "ugm":
            if self._ugm is None:
                self._ugm = UgmTokenizer(self.tokens, self.attr, self.scores, self._charsmap, self.unk,
                                         self.escape_whitespaces, self.add_space_prefix,
                                         self.remove_extra_whitespaces)
            return self._ugm.tokenize
        if self._rwkv is None:
            self._rwkv = RwkvTokenizer(self.tokens, self.unk) if self.type == "rwkv" else \
                Plamo2Tokenizer(self.tokens, self.attr, self.scores)
        return self._rwkv.tokenize

    # ------------------------------------------------------------------------------------------------ detokenize
    def token_to_piece(self, id: int, special: bool = True) -> bytes:
        """The bytes of one token (llama_token_to_piece with lstrip 0). Control and unknown tokens give their text
        only when ``special``; unused/undefined tokens give nothing."""
        key = (int(id), bool(special))
        p = self._piece_cache.get(key)
        if p is not None:
            return p
        i = key[0]
        if not 0 <= i < self.n_tokens:
            raise VocabError(f"token id {i} is outside the vocabulary (0..{self.n_tokens - 1})")
        a, text = int(self.attr[i]), self.tokens[i]
        if not special and a & (ATTR_UNKNOWN | ATTR_CONTROL):
            p = b""
        elif self.type == "rwkv":         # every RWKV token is its escaped bytes
            p = rwkv_unescape(text)
        elif self.type == "plamo2":       # byte tokens their byte, every other token its text as it is
            p = bytes([_hex_byte(text[3:5])]) if a & ATTR_BYTE and len(text) == 6 and text.startswith("<0x") \
                else text.encode("utf-8", "surrogatepass")
        elif a & (ATTR_UNKNOWN | ATTR_CONTROL | ATTR_USER_DEFINED):
            p = text.encode("utf-8", "surrogatepass")
        elif a & ATTR_NORMAL:
            p = _bpe_decode(text) if self.type == "bpe" and not self.escape_whitespaces \
                else text.replace("\u2581", " ").encode("utf-8")
        elif a & ATTR_BYTE:
            p = bytes([_hex_byte(text[3:5])])
        else:
            p = b""
        self._piece_cache[key] = p
        return p

    def detokenize_bytes(self, ids, special: bool = True, remove_special: bool = False) -> bytes:
        """llama_detokenize: pieces joined, the first one's leading space dropped where the vocabulary adds a space
        prefix, BOS/EOS dropped with ``remove_special``, and BPE's ``clean_spaces`` tidy-up."""
        ids = [int(i) for i in ids]
        remove_space = self.add_space_prefix
        if remove_special and self.add_bos and ids and ids[0] == self.bos:
            remove_space = False
            ids = ids[1:]
        if remove_special and self.add_eos and ids and ids[-1] == self.eos:
            ids = ids[:-1]
        pieces = [self.token_to_piece(i, special) for i in ids]
        if remove_space and pieces and pieces[0][:1] == b" ":
            pieces[0] = pieces[0][1:]
        text = b"".join(pieces)
        if self.clean_spaces:
            text = re.sub(rb" (?=[?!.,])", b"", text)           # " ?", " !", " .", " ,"
            text = re.sub(rb" ' ", b"'", text)                   # a lone apostrophe between spaces
            text = re.sub(rb" '(?=[sm]|re|ve)", b"'", text)       # " 's", " 'm", " 're", " 've"
        return text

    def detokenize(self, ids, special: bool = True, remove_special: bool = False) -> str:
        return self.detokenize_bytes(ids, special, remove_special).decode("utf-8", errors="replace")

    # ------------------------------------------------------------------------------------------------ queries
    def is_eog(self, id) -> bool:
        return int(id) in self.eog

    def is_control(self, id) -> bool:
        return bool(self.attr[int(id)] & ATTR_CONTROL)

    def token_text(self, id: int) -> str:
        return self.tokens[int(id)]

    def __repr__(self) -> str:
        return (f"Vocab({self.model}/{self.pre}, {self.n_tokens} tokens, bos={self.bos}, eos={self.eos}, "
                f"eog={sorted(self.eog)}, add_bos={self.add_bos})")


def _whitespace_segments(text: str, lowercase: bool) -> list[str]:
    """llm_tokenizer_whitespace_session: the runs between llama.cpp's whitespace code points, lowercased with its
    one-to-one map."""
    from .vocab_bpe import cpt_flags
    from .vocab_wpm import lowercase_map
    white = cpt_flags()[1]
    lower = lowercase_map() if lowercase else {}
    segs, cur = [], []
    for ch in text:
        if ord(ch) in white:
            if cur:
                segs.append("".join(cur))
                cur = []
        else:
            cur.append(chr(lower.get(ord(ch), ord(ch))) if lowercase else ch)
    if cur:
        segs.append("".join(cur))
    return segs


def _bpe_decode(text: str) -> bytes:
    """A byte-level BPE token back to bytes. A character outside GPT-2's byte map comes out as llama.cpp writes
    it: ``[UNK_BYTE_0x<its utf-8 in hex><the token's text>]``."""
    try:
        return bytes(UNICODE_TO_BYTE[c] for c in text)
    except KeyError:
        out = bytearray()
        for c in text:
            b = UNICODE_TO_BYTE.get(c)
            if b is not None:
                out.append(b)
            else:
                out += b"[UNK_BYTE_0x" + c.encode("utf-8").hex().encode() + text.encode("utf-8") + b"]"
        return bytes(out)


class StreamDecoder:
    """Incremental detokenizer: ``feed`` ids one at a time and get text that never ends inside a UTF-8 character
    (an incomplete sequence waits for the next token); ``flush`` at the end. The pieces concatenate to the
    token pieces decoded at once (llama.cpp's server streams the same way: pieces, no clean_spaces)."""

    def __init__(self, vocab: Vocab, special: bool = True, keep: frozenset = frozenset()):
        """``keep``: token ids whose text comes out even when ``special`` is off (llama.cpp's preserved tokens:
        the control tokens that mark a tool call or a thinking block)."""
        self.vocab = vocab
        self.special = special
        self.keep = keep
        self._dec = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def feed(self, id: int) -> str:
        return self._dec.decode(self.vocab.token_to_piece(id, self.special or id in self.keep))

    def flush(self) -> str:
        return self._dec.decode(b"", final=True)
