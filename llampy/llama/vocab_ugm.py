"""Unigram (T5 / SentencePiece "UGM") tokenization as llama.cpp runs it (llama-vocab.cpp ``llm_tokenizer_ugm``).

Normalization walks the UTF-8 bytes: a prefix of a user-defined token passes unchanged (llama.cpp takes the longest
path in its trie of user-defined tokens, whether or not a token ends there); else the longest prefix found in the
precompiled charsmap (SentencePiece's XOR-compressed double array) is replaced by its string; else one UTF-8
character passes (an invalid byte becomes U+FFFD). Spaces become U+2581 (``escape_whitespaces``), one goes in front
(``add_space_prefix``), runs of them merge (``remove_extra_whitespaces``).

Tokenization is Viterbi over byte offsets: from the start of each code point every vocabulary token (normal,
user-defined, unused; user-defined ones score 0) that matches extends the best path ending there; a code point no
single token covers may become the unknown token at ``min_score - 10``. Scores add up in double precision, a later
path replaces an earlier one only when strictly better, and consecutive unknown tokens merge into one.
"""
from __future__ import annotations

import numpy as np


def _utf8_len(b: int) -> int:
    return (1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 2, 2, 3, 4)[b >> 4]


class UgmTokenizer:
    def __init__(self, tokens: list[str], attr: np.ndarray, scores, charsmap, unk: int | None,
                 escape_whitespaces: bool = True, add_space_prefix: bool = True, remove_extra_whitespaces: bool = False,
                 treat_whitespace_as_suffix: bool = False):
        from .vocab import ATTR_NORMAL, ATTR_UNUSED, ATTR_USER_DEFINED
        self.unk = unk if unk is not None else -1
        n = len(tokens)
        scores = np.zeros(n, np.float32) if scores is None else np.asarray(scores, np.float32)
        normal = (attr & ATTR_NORMAL) != 0
        user = (attr & ATTR_USER_DEFINED) != 0
        matchable = normal | user | ((attr & ATTR_UNUSED) != 0)
        min_score = np.float32(scores[normal].min()) if normal.any() else np.float32(np.finfo(np.float32).max)
        self.unk_score = float(np.float32(min_score - np.float32(10.0)))
        score = [0.0 if u else float(s) for u, s in zip(user.tolist(), scores.tolist())]
        self.matcher: dict[bytes, tuple[int, float]] = {}
        for i in np.flatnonzero(matchable).tolist():           # a repeated text: the trie keeps the last id
            self.matcher[tokens[i].encode("utf-8", "surrogatepass")] = (i, score[i])
        self.max_len = max((len(k) for k in self.matcher), default=0)
        self.user_prefixes = {b""}
        for i in np.flatnonzero(user).tolist():
            t = tokens[i].encode("utf-8", "surrogatepass")
            self.user_prefixes.update(t[:k] for k in range(1, len(t) + 1))
        self.user_max = max(len(p) for p in self.user_prefixes)
        self.space = "\u2581".encode() if escape_whitespaces else b" "
        self.prepend = not treat_whitespace_as_suffix and add_space_prefix
        self.append = treat_whitespace_as_suffix and add_space_prefix
        self.merge_spaces = remove_extra_whitespaces
        self.xcda: list[int] = []
        self.replacements = b""
        if charsmap is not None and len(charsmap):
            blob = bytes(np.asarray(charsmap).astype(np.uint8))
            size = int.from_bytes(blob[:4], "little")
            if size + 4 >= len(blob):
                from .vocab import VocabError     # (here: vocab imports this module)
                raise VocabError("tokenizer.ggml.precompiled_charsmap: index out of bounds")
            self.xcda = np.frombuffer(blob[4:4 + size], "<u4").tolist()
            self.replacements = blob[4 + size:]

    # ------------------------------------------------------------------------------------------------ normalize
    def _node(self, i: int) -> int:
        if i >= len(self.xcda):
            from .vocab import VocabError     # (here: vocab imports this module)
            raise VocabError("Index out of array bounds in XCDA array!")
        return self.xcda[i]

    def _normalize_prefix(self, b: bytes, off: int) -> tuple[bytes, int]:
        """(the replacement, bytes consumed) at ``off``."""
        n = len(b)
        k = 0
        for m in range(min(self.user_max, n - off), 0, -1):
            if b[off:off + m] in self.user_prefixes:
                k = m
                break
        if k:
            return b[off:off + k], k
        longest, value = 0, 0
        if self.xcda:
            node = self._node(0)
            idx = (node >> 10) << ((node & (1 << 9)) >> 6)
            for p in range(off, n):
                c = b[p]
                if c == 0:
                    break
                idx ^= c
                node = self._node(idx)
                if node & ((1 << 31) | 0xFF) != c:
                    break
                leaf = (node >> 8) & 1
                idx ^= (node >> 10) << ((node & (1 << 9)) >> 6)
                if leaf:
                    longest = p - off + 1
                    value = self._node(idx) & ((1 << 31) - 1)
        if longest:
            if value >= len(self.replacements):
                from .vocab import VocabError     # (here: vocab imports this module)
                raise VocabError("Index out of array bounds in precompiled charsmap!")
            end = self.replacements.find(b"\0", value)
            if end < 0:
                from .vocab import VocabError     # (here: vocab imports this module)
                raise VocabError("Unterminated string in precompiled charsmap!")
            return self.replacements[value:end], longest
        k = _utf8_len(b[off])
        try:
            b[off:off + k].decode("utf-8")
            return b[off:off + k], k
        except UnicodeDecodeError:
            return "\ufffd".encode(), 1

    def normalize(self, text: str) -> bytes:
        b = text.encode("utf-8", "surrogatepass")
        out = bytearray()
        prepended = non_ws = False
        off = 0
        while off < len(b):
            rep, used = self._normalize_prefix(b, off)
            for c in rep:
                if c != 0x20:
                    if not non_ws:
                        non_ws = True
                        if (self.prepend and not prepended) or self.merge_spaces:
                            out += self.space
                            prepended = True
                    out.append(c)
                else:
                    non_ws = False
                    if not self.merge_spaces:
                        out += self.space
            off += used
        if self.append:
            out += self.space
        return bytes(out)

    # ------------------------------------------------------------------------------------------------ tokenize
    def tokenize(self, text: str) -> list[int]:
        s = self.normalize(text)
        n = len(s)
        if n == 0:
            return []
        unk = self.unk
        best_tok = [unk] * (n + 1)
        best_from = [0] * (n + 1)
        best_score = [-1.7976931348623157e308] * (n + 1)
        best_score[0] = 0.0
        get = self.matcher.get
        off = 0
        while off < n:
            k = min(_utf8_len(s[off]), n - off)
            cur = best_score[off]
            single = False
            for end in range(off + 1, min(n, off + self.max_len) + 1):
                hit = get(s[off:end])
                if hit is None:
                    continue
                if end - off == k:
                    single = True
                tid, sc = hit
                if cur + sc > best_score[end]:
                    best_tok[end], best_from[end], best_score[end] = tid, off, cur + sc
            if not single:
                end = off + k
                if cur + self.unk_score > best_score[end]:
                    best_tok[end], best_from[end], best_score[end] = unk, off, cur + self.unk_score
            off += k
        out: list[int] = []
        pos, prev_unk = n, False
        while True:
            t = best_tok[pos]
            is_unk = t == unk
            if not (prev_unk and is_unk):
                out.append(t)
            if best_from[pos] == 0:
                break
            prev_unk = is_unk
            pos = best_from[pos]
        out.reverse()
        return out
