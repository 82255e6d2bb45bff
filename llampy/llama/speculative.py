"""Speculative decoding: cheap guesses of the next tokens, checked by the target model in one batch.

Two drafters, as llama.cpp's common/speculative.cpp names them:
- ``draft-simple`` (DraftModel): a small model with the target's vocabulary drafts greedily, a token at a time, all
  sequences in one batch per step; it stops where its top token's probability (over its 10 best) falls below
  ``p_min``, and a draft shorter than ``n_min`` is dropped.
- ``ngram-simple`` (NgramSimple): prompt lookup, no model: the last ``size_n`` tokens are searched for earlier in the
  sequence, and the (up to ``size_m``) tokens that followed them there are the draft.

Verification is the caller's (the server's engine): the target decodes the sampled token and the draft together,
then samples position by position with its own sampler and keeps each drafted token only while it equals the token
sampled there (llama.cpp's common_sampler_sample_and_accept_n). Every output token is still one draw of the target's
sampler from the target's logits given the true prefix: greedy output, and seeded sampling, are the same as without
a draft.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .batch import Batch

TYPES = ("none", "draft-simple", "ngram-simple")
# llama.cpp's limits for a draft vocabulary (common/speculative.cpp)
VOCAB_MAX_SIZE_DIFFERENCE = 128
VOCAB_CHECK_START_TOKEN_ID = 5


class SpeculativeError(ValueError):
    """A draft model that cannot serve the target (another vocabulary), or bad settings."""


def check_compatible(vocab_tgt, vocab_dft) -> None:
    """llama.cpp's common_speculative_are_compatible: same tokenizer type, BOS/EOS, sizes within 128 and the same
    token texts from id 5 on. Raises SpeculativeError naming the first difference."""
    if vocab_tgt.type != vocab_dft.type:
        raise SpeculativeError(f"the draft model's tokenizer is {vocab_dft.type}, the target's {vocab_tgt.type}")
    for what in ("bos", "eos"):
        add = f"add_{what}"
        if getattr(vocab_tgt, add) != getattr(vocab_dft, add) or (
                getattr(vocab_tgt, add) and getattr(vocab_tgt, what) != getattr(vocab_dft, what)):
            raise SpeculativeError(f"the draft model's {what.upper()} token differs from the target's")
    n_t, n_d = vocab_tgt.n_tokens, vocab_dft.n_tokens
    if abs(n_t - n_d) > VOCAB_MAX_SIZE_DIFFERENCE:
        raise SpeculativeError(f"the draft model has {n_d} tokens, the target {n_t} (at most "
                               f"{VOCAB_MAX_SIZE_DIFFERENCE} apart)")
    for i in range(VOCAB_CHECK_START_TOKEN_ID, min(n_t, n_d)):
        if vocab_tgt.tokens[i] != vocab_dft.tokens[i]:
            raise SpeculativeError(f"token {i} is {vocab_dft.tokens[i]!r} in the draft model, "
                                   f"{vocab_tgt.tokens[i]!r} in the target")


@dataclass
class SpecParams:
    """The settings of llama.cpp's --spec-type, --spec-draft-n-max/n-min/p-min and --spec-ngram-simple-size-n/m,
    with its defaults."""
    types: tuple = ("none",)
    n_max: int = 3
    n_min: int = 0
    p_min: float = 0.0
    ngram_size_n: int = 12
    ngram_size_m: int = 48

    def __post_init__(self):
        self.types = tuple(self.types)
        bad = [t for t in self.types if t not in TYPES]
        if bad:
            raise SpeculativeError(f"unknown speculative type {bad[0]!r} (llampy has {', '.join(TYPES)})")
        if self.n_max < 0 or self.n_min < 0:
            raise SpeculativeError(f"draft sizes must not be negative, got n_max {self.n_max}, n_min {self.n_min}")
        if not 0.0 <= self.p_min <= 1.0:
            raise SpeculativeError(f"draft p_min must be between 0 and 1, got {self.p_min}")
        if self.ngram_size_n < 1 or self.ngram_size_m < 1:
            raise SpeculativeError(f"n-gram sizes must be at least 1, got {self.ngram_size_n} and "
                                   f"{self.ngram_size_m}")

    def enabled(self) -> bool:
        return any(t != "none" for t in self.types) and self.cap() > 0

    def cap(self) -> int:
        """The longest draft any of the types can give."""
        return max([self.n_max if "draft-simple" in self.types else 0,
                    self.ngram_size_m if "ngram-simple" in self.types else 0])


class NgramSimple:
    """llama.cpp's common_ngram_simple_draft: the pattern is the last size_n - 1 tokens of the history and the token
    just sampled; its latest earlier occurrence (position 0 excluded) is followed by the draft, at most size_m tokens
    and none when fewer than size_n follow."""
    name = "ngram-simple"

    def __init__(self, size_n: int = 12, size_m: int = 48):
        if size_n < 1 or size_m < 1:
            raise SpeculativeError(f"n-gram sizes must be at least 1, got {size_n} and {size_m}")
        self.size_n, self.size_m = int(size_n), int(size_m)

    def draft(self, history: list, last: int, n_max: int) -> list:
        n, m = self.size_n, self.size_m
        cur = len(history)
        if cur <= n + m + 1 or n_max < 1:
            return []
        h = np.asarray(history, dtype=np.int64)
        pattern = np.concatenate([h[cur - n + 1:], [int(last)]])
        # latest match first, skipping the occurrence at the end (where we are)
        starts = np.flatnonzero(h[1:cur - n] == pattern[0]) + 1
        for j in starts[::-1]:
            if np.array_equal(h[j:j + n], pattern):
                k = min(m, cur - (j + n))
                if k < n:
                    return []
                return [int(t) for t in h[j + n:j + n + min(k, n_max)]]
        return []


class Drafters:
    """The drafters of a SpecParams over one target: n-gram lookup first, then the draft model for the sequences it
    left without a draft."""

    def __init__(self, spec: SpecParams, vocab_tgt, n_ctx: int, n_seq: int, draft_model=None):
        self.spec = spec
        self.ngram = NgramSimple(spec.ngram_size_n, spec.ngram_size_m) if "ngram-simple" in spec.types else None
        self.model = None
        if "draft-simple" in spec.types:
            if draft_model is None:
                raise SpeculativeError("speculative type draft-simple needs a draft model (--model-draft)")
            hp = draft_model.hparams
            if any(hp.is_recurrent(il) for il in range(hp.n_layer)):
                raise SpeculativeError(f"the draft model ({hp.arch}) keeps a recurrent state: it cannot drop "
                                       f"rejected drafts")
            self.model = DraftModel(draft_model, vocab_tgt, n_ctx, n_seq)

    def draft(self, wants: dict) -> dict:
        """``wants``: {seq: (history, last, room, n_min, p_min)}, room >= 1 the longest draft wanted (n_min/p_min:
        the draft model's, None for the settings'); returns {seq: draft} for the sequences that got one."""
        sp, out, rest = self.spec, {}, {}
        for sid, (history, last, room, n_min, p_min) in wants.items():
            if self.ngram is not None:
                d = self.ngram.draft(history, last, room)
                if d:
                    out[sid] = d
                    continue
            if self.model is not None:
                rest[sid] = (history, last, min(room, sp.n_max), sp.n_min if n_min is None else n_min,
                             sp.p_min if p_min is None else p_min)
        if rest:
            try:
                out.update(self.model.draft(rest))
            except Exception:   # a failing draft costs speed, never the request: start those sequences over
                for sid in rest:
                    self.model.forget(sid)
        return {sid: d for sid, d in out.items() if d}


class DraftModel:
    """A draft model's context: one sequence per slot of the target, each holding that slot's tokens. ``draft``
    catches every sequence up with its slot's history, then drafts for all of them together, one batch per step."""
    name = "draft-simple"
    TOP_K = 10                  # llama.cpp's draft sampler: top-k 10, the top candidate's probability among them

    def __init__(self, model, vocab_tgt, n_ctx: int, n_seq: int):
        from .context import Context
        check_compatible(vocab_tgt, model.vocab)
        self.model = model
        n_batch = min(n_ctx, 512)
        self.ctx = Context(model, n_ctx=n_ctx, n_batch=n_batch, n_ubatch=n_batch, n_seq_max=n_seq, max_graphs=64,
                           kv_pad_decode=n_ctx, kv_unified=False)
        self.cached: list[list] = [[] for _ in range(n_seq)]     # tokens whose K/V the draft cache holds, per seq

    def draft(self, wants: dict) -> dict:
        """``wants``: {seq: (history, last, n_max, n_min, p_min)}; returns {seq: draft tokens}."""
        out = {sid: [] for sid in wants}
        live = self._catch_up(wants)
        step = 0
        while live:
            batch = Batch.empty()
            nxt = []
            for sid, logits in live.items():
                _, last, n_max, _, p_min = wants[sid]
                tok, p = self._top(logits)
                if p < p_min:
                    continue
                out[sid].append(tok)
                if len(out[sid]) >= n_max:
                    continue
                batch.add(tok, len(wants[sid][0]) + 1 + step, [sid], True)
                nxt.append(sid)
            if not nxt:
                break
            self.ctx.decode(batch)
            for i, sid in enumerate(nxt):
                self.cached[sid].append(out[sid][-1])
            live = {sid: np.array(self.ctx.get_logits_ith(i)) for i, sid in enumerate(nxt)}
            step += 1
        for sid, (_, _, _, n_min, _) in wants.items():
            if len(out[sid]) < n_min:
                out[sid] = []
        return out

    def _catch_up(self, wants: dict) -> dict:
        """Bring each sequence's cache to its history plus the last sampled token; that token's logits per seq."""
        todo = []
        for sid, (history, last, *_rest) in wants.items():
            have = self.cached[sid]
            n = 0
            for a, b in zip(have, history):
                if a != b:
                    break
                n += 1
            if not self.ctx.seq_rm(sid, n, -1):
                self.ctx.seq_rm(sid, -1, -1)
                n = 0
            self.cached[sid] = list(history[:n])
            todo.append((sid, list(history[n:]) + [int(last)]))
        logits = {}
        # pack whole catch-ups into batches of n_batch tokens; a longer one goes alone, in chunks
        cap = self.ctx.n_batch
        while todo:
            batch, owners = Batch.empty(), []
            while todo and len(batch) + len(todo[0][1]) <= cap:
                sid, toks = todo.pop(0)
                p0 = len(self.cached[sid])
                for j, t in enumerate(toks):
                    batch.add(t, p0 + j, [sid], j == len(toks) - 1)
                owners.append((sid, toks, len(batch) - 1))
            if not owners:                     # the head is longer than a batch: its first chunk alone
                sid, toks = todo[0]
                p0 = len(self.cached[sid])
                chunk = toks[:cap]
                for j, t in enumerate(chunk):
                    batch.add(t, p0 + j, [sid], False)
                self.ctx.decode(batch)
                self.cached[sid].extend(chunk)
                todo[0] = (sid, toks[cap:])
                continue
            self.ctx.decode(batch)
            for sid, toks, row in owners:
                self.cached[sid].extend(toks)
                logits[sid] = np.array(self.ctx.get_logits_ith(row))
        return logits

    def _top(self, logits) -> tuple[int, float]:
        """The most likely token and its probability among the TOP_K most likely (softmax over them)."""
        x = np.asarray(logits, dtype=np.float32)
        k = min(self.TOP_K, len(x))
        idx = np.argpartition(-x, k - 1)[:k]
        top = idx[np.lexsort((idx, -x[idx]))]
        v = x[top].astype(np.float64)
        e = np.exp(v - v[0])
        return int(top[0]), float(e[0] / e.sum())

    def forget(self, sid: int) -> None:
        self.ctx.seq_rm(sid, -1, -1)
        self.cached[sid] = []
