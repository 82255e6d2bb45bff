"""DRY ("Don't Repeat Yourself", Koboldcpp's, as llama.cpp's llama_sampler_dry): penalise the tokens that would
extend a repeat of the recent context, multiplier * base ** (repeat length - allowed length), where a repeat may
not cross a sequence breaker.

Sequence breakers are strings; a token "breaks" when its text contains one, or ends with the start of one whose
rest, tokenized, follows it (``dry_breakers``, llama.cpp's get_overlapping_token_sequences, on the token texts of
``detokenize([id], special=True)``). Step for step this is llama.cpp's code: the restart-sequence scan, the
reversed Z-algorithm (quirks kept: inside a Z-box the copied length is clamped to the restart limit), the longest
repeat per next token, the clamped exponent, and the float/double rounding of the penalty.
"""
from __future__ import annotations

import math
import weakref
from collections import deque

import numpy as np
from numba import njit

from .sampling import _F32, Sampler, _scalar_logf

MAX_CHAR_LEN = 40          # a breaker's bytes beyond this are dropped
MAX_SEQ_LEN = 20           # a breaker's tail is at most this many tokens
DEFAULT_BREAKERS = ("\n", ":", "\"", "*")
FLOAT_MAX_LOG = _F32(88.7228391)

_texts: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()       # vocab -> [bytes of each token]
_processed: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()   # vocab -> {breakers: table}


def _token_texts(vocab) -> list:
    t = _texts.get(vocab)
    if t is None:
        t = _texts[vocab] = [vocab.detokenize_bytes([i], special=True) for i in range(vocab.n_tokens)]
    return t


def dry_breakers(vocab, breakers) -> dict:
    """{head token: [tail token tuples]}: the tokens that start a sequence breaker; a head whose text holds a whole
    breaker has the empty tail. Cached per vocabulary and breaker list."""
    key = tuple(breakers)
    per = _processed.setdefault(vocab, {})
    if key in per:
        return per[key]
    table: dict[int, list] = {}
    texts = _token_texts(vocab)
    for b in key:
        s = b.encode("utf-8")[:MAX_CHAR_LEN]
        if not s:
            continue
        for tid, word in enumerate(texts):
            if s in word:
                tails = table.setdefault(tid, [])
                if () not in tails:
                    tails.append(())
                continue
            pos = word.find(s[:1])
            while pos >= 0:
                i = 1
                match = True
                while i < len(s) and pos + i < len(word):
                    if word[pos + i] != s[i]:
                        match = False
                        break
                    i += 1
                if match:       # the word ends with s[:i]: the rest of the breaker, tokenized, is the tail
                    rest = s[i:].decode("utf-8", errors="replace")
                    tail = tuple(vocab.tokenize(rest, add_special=False, parse_special=False)[:MAX_SEQ_LEN])
                    tails = table.setdefault(tid, [])
                    if tail not in tails:
                        tails.append(tail)
                pos = word.find(s[:1], pos + 1)
    per[key] = table
    return table


@njit(cache=True)
def _repeat_counts(last, rep_limit):
    """Step 2, the reversed Z-algorithm over ``last`` (last[i]: the i-th token from the end): counts[j] is the
    length (clamped to rep_limit) of the context's suffix that also ends at position last_n - 1 - j."""
    n_rep = last.size
    counts = np.zeros(n_rep, np.int64)
    end = n_rep - 1
    rt = 0
    lt = 0
    for k in range(1, n_rep):
        if k > rt:
            n = 0
            while n + k < n_rep and last[n] == last[n + k]:
                n += 1
            counts[end - k] = min(n, rep_limit)
            if n > 0:
                lt = k
                rt = k + n - 1
        else:
            p = k - lt
            right_part_len = rt - k + 1
            if counts[end - p] < right_part_len:
                counts[end - k] = min(counts[end - p], rep_limit)
            else:
                i = rt + 1
                while i < n_rep and last[i] == last[i - k]:
                    i += 1
                counts[end - k] = min(i - k, rep_limit)
                lt = k
                rt = i - 1
    return counts


class DRY(Sampler):
    """llama_sampler_dry. ``breakers``: the sequence-breaker table (``dry_breakers(vocab, strings)``, or {head:
    [tails]} of token ids directly, as llama.cpp's test wrapper takes them). penalty_last_n < 0 is the whole
    history (llama.cpp's common layer maps -1 to the context size); 0, a multiplier of 0 or a base below 1
    disable it."""

    def __init__(self, multiplier: float, base: float = 1.75, allowed_length: int = 2, penalty_last_n: int = -1,
                 breakers: dict | None = None):
        self.multiplier, self.base, self.allowed_length = multiplier, base, allowed_length
        self.penalty_last_n = penalty_last_n
        self.breakers = {int(k): [tuple(t) for t in v] for k, v in (breakers or {}).items()}
        self._single = np.fromiter((k for k, v in self.breakers.items() if () in v), dtype=np.int64)
        self._last: deque = deque(maxlen=None if penalty_last_n < 0 else penalty_last_n)

    @property
    def disabled(self) -> bool:
        return self.multiplier == 0 or self.base < 1 or self.penalty_last_n == 0

    def accept(self, token):
        if not self.disabled:
            self._last.append(int(token))

    def reset(self):
        self._last.clear()

    def apply(self, c):
        if self.disabled:
            return
        n_hist = len(self._last)
        n_rep = n_hist if self.penalty_last_n < 0 else min(n_hist, self.penalty_last_n)
        if n_rep <= self.allowed_length:
            return
        last = np.fromiter(reversed(self._last), dtype=np.int64, count=n_hist)[:n_rep]   # last[i]: rat(i)
        # Step 1: the nearest restart sequence bounds the repeat length
        rep_limit = n_rep
        for i in range(n_rep):
            tails = self.breakers.get(int(last[i]))
            if tails is None:
                continue
            longest = -1
            for tail in tails:
                n = len(tail)
                if longest < n <= i and all(tail[o] == last[i - o - 1] for o in range(n)):
                    longest = n
            if longest >= 0:
                rep_limit = i - longest
                break
        if rep_limit < self.allowed_length:
            return
        # Step 2: repeat lengths of the context's suffix
        counts = _repeat_counts(last, rep_limit)
        # Step 3: the longest repeat each next token would extend
        longest_for: dict[int, int] = {}
        for i in np.flatnonzero(counts[:n_rep - 1] >= self.allowed_length):
            tok, n = int(last[n_rep - 2 - i]), int(counts[i])
            if longest_for.get(tok, -1) < n:
                longest_for[tok] = n
        # Step 4: the penalties, except on single-token breakers
        for s in self._single:
            longest_for.pop(int(s), None)
        if longest_for:
            max_exp = 0
            if self.base > 1.000001:
                max_exp = int(FLOAT_MAX_LOG / _F32(_scalar_logf(_F32(self.base))))
            toks = np.fromiter(longest_for.keys(), dtype=np.int64, count=len(longest_for))
            exps = np.fromiter(longest_for.values(), dtype=np.int64, count=len(longest_for)) - self.allowed_length
            if max_exp > 0:
                exps = np.minimum(exps, max_exp)
            pens = np.array([float(_F32(self.multiplier)) * math.pow(float(_F32(self.base)), int(e)) for e in exps],
                            dtype=np.float64).astype(_F32)
            pos, which = c.positions_of(toks)
            c.logits[pos] = c.logits[pos] - pens[which]
        c.sorted = False
