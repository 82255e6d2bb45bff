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
    # llampy's: drafts are cut to the length whose verification is expected to pay (DraftPlanner); off: every draft
    # is checked whole, as llama.cpp checks it
    plan: bool = True

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


EXACT_PROBE_ROWS = 8      # exact_rows tries batches of up to this many rows


def exact_rows(ctx, seq: int = 0, n_max: int = EXACT_PROBE_ROWS) -> int | None:
    """The most rows a decode step of this context may hold while every row still gets the logits of a step of its
    token alone, bit for bit (a verification batch then samples exactly what plain decoding would); None when every
    size does (the context computes rows apart: Context._rows_apart, the 32-value formats). Found by trying, on
    sequence ``seq`` of an empty cache (left empty): n_max tokens decoded one by one, then as batches of 2..n_max
    rows; the answer is the largest m whose batches of 2..m rows all gave the single steps' bits (1: none did).
    Q4_K's repacked rows, for one, take ggml's gemm order from 4 rows."""
    n_vocab = ctx.n_vocab
    toks = [(97 * i + 13) % n_vocab for i in range(n_max)]
    ctx.seq_rm(seq, -1, -1)
    ref = []
    try:
        for i, t in enumerate(toks):
            b = Batch.empty()
            b.add(t, i, [seq], True)
            ctx.decode(b)
            ref.append(np.array(ctx.get_logits_ith(0)))
            if ctx._rows_apart:
                return None
        best = 1
        for m in range(2, n_max + 1):
            ctx.seq_rm(seq, -1, -1)
            b = Batch.empty()
            for i in range(m):
                b.add(toks[i], i, [seq], True)
            ctx.decode(b)
            if not all(np.array_equal(ctx.get_logits_ith(i), ref[i]) for i in range(m)):
                break
            best = m
        return best
    finally:
        ctx.seq_rm(seq, -1, -1)


def cap_rows(drafts: dict, n_base: int, max_rows: int) -> dict:
    """``drafts`` cut (longest first) so that a step of ``n_base`` rows and them holds at most max_rows rows."""
    room = max(0, max_rows - n_base)
    out = {sid: list(d) for sid, d in drafts.items()}
    while sum(len(d) for d in out.values()) > room:
        longest = max(out, key=lambda sid: len(out[sid]))
        out[longest].pop()
    return {sid: d for sid, d in out.items() if d}


class DraftPlanner:
    """How much of each slot's draft a decode step checks. Checking drafted tokens costs rows of the target's batch;
    what they cost depends on the backend's kernels (on a 2-core AVX2 host SmolLM2's products cost nearly a whole
    step per row below eight rows and half that per row from eight on), and what they bring depends on how often
    the slot's drafts are right. The planner measures both as the server runs:

    - the seconds of a step of n rows of generating slots (``observe_step``: drafting, decode and sampling, in a
      moving average per n; the first step of each n is left out, as it may build that batch's graph), with an
      estimate for the n not yet seen (between two seen: interpolated; past the largest: its cost per row, each
      further row at PRIOR_ROW of it, the optimism that makes the planner try a longer batch at least once);
    - each slot's chance that a drafted token is accepted when the ones before it were (``observe``, a decaying
      count of accepted tokens against drafts cut short; the drafts a step does not check are scored against the
      tokens generated after them, for free).

    ``plan`` takes the drafted tokens in order of their chance of being accepted (a^i for the i-th token of a slot
    whose rate is a) and keeps the count that maximises the expected tokens per second of the step. Greedy output
    is unchanged: the tokens kept are checked exactly as before; only fewer of them are."""
    PRIOR_ROW = 0.5     # an unseen longer batch: each row past the longest seen costs this share of its row cost
    DECAY = 0.7         # weight of a slot's earlier draft outcomes at each new one
    EMA = 0.3           # weight of a new step time in its batch size's average

    def __init__(self):
        self.cost: dict[int, float] = {}
        self.seen: set = set()

    def observe_step(self, n_rows: int, seconds: float) -> None:
        if n_rows not in self.seen:
            self.seen.add(n_rows)
            return
        old = self.cost.get(n_rows)
        self.cost[n_rows] = seconds if old is None else (1 - self.EMA) * old + self.EMA * seconds

    def estimate(self, n: int) -> float | None:
        """Seconds of a step of n rows: measured, or estimated from the sizes measured (None: none yet)."""
        c = self.cost
        if n in c:
            return c[n]
        if not c:
            return None
        lo = max((k for k in c if k < n), default=None)
        hi = min((k for k in c if k > n), default=None)
        if lo is not None and hi is not None:
            return c[lo] + (c[hi] - c[lo]) * (n - lo) / (hi - lo)
        if lo is None:
            return c[hi] * n / hi
        return c[lo] * (1 + self.PRIOR_ROW * (n - lo) / lo)

    def plan(self, n_base: int, drafts: dict, rates: dict) -> dict:
        """{slot: tokens of its draft to check}: ``n_base`` rows are in the step anyway (one per generating slot,
        and prompt pieces), ``drafts`` {slot: draft}, ``rates`` {slot: chance that a drafted token is accepted}."""
        keep = {sid: 0 for sid in drafts}
        base = self.estimate(n_base)
        if base is None or base <= 0:
            return keep
        marg = sorted(((rates[sid] ** (i + 1), sid) for sid, d in drafts.items() for i in range(len(d))),
                      key=lambda t: -t[0])
        # a row of the step's own counts as one token (a prompt row as one too: steps with prompt pieces draft less)
        best, best_j, tokens = n_base / base, 0, float(n_base)
        for j, (p, _sid) in enumerate(marg, 1):
            tokens += p
            cost = self.estimate(n_base + j)
            if cost and tokens / cost > best * (1 + 1e-9):
                best, best_j = tokens / cost, j
        for _p, sid in marg[:best_j]:
            keep[sid] += 1
        return keep


class DraftRate:
    """A slot's running chance that a drafted token is accepted when the ones before it were (DraftPlanner)."""
    __slots__ = ("acc", "cut", "shadow")

    def __init__(self):
        self.acc, self.cut = 1.0, 1.0       # prior: one accepted, one cut short
        self.shadow = None                  # (position of its first token, draft) not checked by the target

    def rate(self) -> float:
        return self.acc / (self.acc + self.cut)

    def observe(self, n_drafted: int, n_accepted: int) -> None:
        d = DraftPlanner.DECAY
        self.acc = d * self.acc + n_accepted
        self.cut = d * self.cut + (1.0 if n_accepted < n_drafted else 0.0)

    def score_shadow(self, tokens: list) -> None:
        """Score the unchecked draft against the tokens generated since (``tokens``: the sequence so far, the
        last sampled token included), once they tell how much of it would have been accepted."""
        if self.shadow is None:
            return
        p0, d = self.shadow
        known = tokens[p0:p0 + len(d)]
        for i, t in enumerate(known):
            if t != d[i]:
                self.observe(len(d), i)
                self.shadow = None
                return
        if len(known) == len(d):
            self.observe(len(d), len(d))
            self.shadow = None


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
                if len(d) >= max(1, sp.n_min if n_min is None else n_min):   # llama-server drops a shorter one
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
