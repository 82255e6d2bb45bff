"""PLaMo-2 tokenization as llama.cpp runs it (llama-vocab.cpp ``llm_tokenizer_plamo2``).

A unigram-style dynamic program over code points, from the end: the cost of position i is the least, over the
vocabulary tokens that start there, of the cost after the token minus its score (``round(score * 1e4)`` as an
integer), or of the next position plus 10^7 for one unknown character (spelt in ``<0xXX>`` byte tokens). Ties go to
the longer token, and the unknown character last (llama.cpp's table holds a suffix's pieces longest first, then the
unknown row, and takes a candidate only when strictly better). A leading BOM is dropped; byte tokens never match
text. Every byte must have a ``<0xXX>`` token.
"""
from __future__ import annotations

import math

import numpy as np

_UNKNOWN_SCORE = -10_000_000
_INVALID_SCORE = -20_000_000


def _score_int(score: float) -> int:
    """static_cast<int32_t>(std::round(score * 1e4)): halves away from zero; out of range gives INT32_MIN (x86's
    cvttsd2si, as the build llama.cpp is checked against)."""
    x = score * 1e4
    r = int(math.floor(x + 0.5)) if x >= 0 else -int(math.floor(-x + 0.5))
    return r if -2**31 <= r < 2**31 else -2**31


class Plamo2Tokenizer:
    def __init__(self, tokens: list[str], attr: np.ndarray, scores):
        from .vocab import ATTR_BYTE
        scores = np.zeros(len(tokens), np.float32) if scores is None else np.asarray(scores, np.float32)
        last_id = {t: i for i, t in enumerate(tokens)}      # llama.cpp's token_to_id: a repeated text, its last id
        self.byte_ids = [0] * 256
        self.pieces: dict[str, tuple[int, int]] = {}
        for i, t in enumerate(tokens):
            if attr[i] & ATTR_BYTE:
                if len(t) == 6 and t.startswith("<0x") and t.endswith(">"):
                    try:
                        self.byte_ids[int(t[3:5], 16)] = i
                    except ValueError:
                        pass
                continue
            s = float(scores[i])
            sc = _score_int(s) if math.isfinite(s) else _INVALID_SCORE
            if sc > _INVALID_SCORE:          # llama.cpp skips pieces at or below INVALID_SCORE (and non-finite ones)
                self.pieces[t] = (last_id[t], sc)
            else:
                self.pieces.pop(t, None)
        for b in range(256):
            if self.byte_ids[b] == 0:
                from .vocab import VocabError     # (here: vocab imports this module)
                raise VocabError(f"PLaMo-2 vocabulary: byte token <0x{b:02X}> is not set")
        self.max_len = max(map(len, self.pieces), default=0)

    def tokenize(self, text: str) -> list[int]:
        if text[:1] == "\ufeff":
            text = text[1:]
        n = len(text)
        if n == 0:
            return []
        cost = [1 << 60] * (n + 1)
        cost[n] = 0
        step = [0] * (n + 1)
        tok = [-1] * (n + 1)
        get = self.pieces.get
        for i in range(n - 1, -1, -1):
            best, bl, bt = cost[i], 0, -1
            for m in range(min(self.max_len, n - i), 0, -1):
                hit = get(text[i:i + m])
                if hit is not None:
                    c = cost[i + m] - hit[1]
                    if c < best:
                        best, bl, bt = c, m, hit[0]
            c = cost[i + 1] - _UNKNOWN_SCORE
            if c < best:
                best, bl, bt = c, 1, -1
            cost[i], step[i], tok[i] = best, bl, bt
        out: list[int] = []
        pos = 0
        while pos < n:
            if tok[pos] >= 0:
                out.append(tok[pos])
            else:
                out += [self.byte_ids[b] for b in text[pos].encode("utf-8", "surrogatepass")]
            pos += step[pos]
        return out
