"""Samplers as in llama.cpp's sampling API: small objects that transform a candidate list, composed in a Chain.

A candidate list holds token ids and logits (and, once a sampler needs them, probabilities), optionally sorted by
logit descending. Every step is vectorised NumPy: no Python loop over the vocabulary. ``Chain.from_params`` builds
llama.cpp's default order: penalties, top-k, typical, top-p, min-p, temperature, then dist (or greedy at
temperature 0, or mirostat). Seeded chains are reproducible (NumPy's PCG64, not llama.cpp's mt19937 stream).
"""
from __future__ import annotations

import math
from collections import deque

import numpy as np


class Candidates:
    __slots__ = ("ids", "logits", "p", "sorted", "selected")

    def __init__(self, logits: np.ndarray):
        self.logits = np.asarray(logits, dtype=np.float32).copy()
        self.ids = np.arange(len(self.logits), dtype=np.int32)
        self.p = None
        self.sorted = False
        self.selected = -1

    def sort(self) -> None:
        if not self.sorted:
            o = np.argsort(-self.logits, kind="stable")
            self.ids, self.logits = self.ids[o], self.logits[o]
            if self.p is not None:
                self.p = self.p[o]
            self.sorted = True

    def softmax(self) -> None:
        """Sort and set p = softmax(logits) (llama_sampler_softmax_impl)."""
        self.sort()
        x = self.logits.astype(np.float64)
        e = np.exp(x - x[0]) if len(x) else x
        self.p = (e / e.sum()).astype(np.float32) if len(x) else e

    def keep(self, n: int) -> None:
        self.ids, self.logits = self.ids[:n], self.logits[:n]
        if self.p is not None:
            self.p = self.p[:n]

    def mask(self, m: np.ndarray) -> None:
        self.ids, self.logits = self.ids[m], self.logits[m]
        if self.p is not None:
            self.p = self.p[m]


class Sampler:
    def apply(self, c: Candidates) -> None:
        raise NotImplementedError

    def accept(self, token: int) -> None:
        pass

    def reset(self) -> None:
        pass


class Greedy(Sampler):
    def apply(self, c):
        c.selected = int(np.argmax(c.logits)) if len(c.logits) else -1


class Dist(Sampler):
    def __init__(self, seed: int | None = None):
        self.seed = seed
        self.rng = np.random.default_rng(seed)

    def apply(self, c):
        c.softmax()
        u = self.rng.random()
        cdf = np.cumsum(c.p, dtype=np.float64)
        c.selected = int(min(np.searchsorted(cdf, u * cdf[-1], side="right"), len(cdf) - 1))

    def reset(self):
        self.rng = np.random.default_rng(self.seed)


class Temp(Sampler):
    """t <= 0 keeps only the most likely token (llama.cpp's temp_impl)."""

    def __init__(self, t: float):
        self.t = t

    def apply(self, c):
        if self.t <= 0:
            i = int(np.argmax(c.logits))
            m = np.full(len(c.logits), -np.inf, np.float32)
            m[i] = c.logits[i]
            c.logits = m
            c.p = None
            return
        c.logits = c.logits / np.float32(self.t)
        c.p = None


class TempExt(Sampler):
    """Dynamic temperature: t in [t - delta, t + delta] by normalised entropy ** exponent."""

    def __init__(self, t: float, delta: float, exponent: float):
        self.t, self.delta, self.exponent = t, delta, exponent

    def apply(self, c):
        if self.delta <= 0:
            return Temp(self.t).apply(c)
        lo, hi = max(0.0, self.t - self.delta), self.t + self.delta
        if len(c.logits) <= 1:
            return
        c.softmax()
        p = c.p.astype(np.float64)
        ent = float(-(p[p > 0] * np.log(p[p > 0])).sum())
        max_ent = math.log(len(p))
        t = lo + (hi - lo) * (ent / max_ent) ** self.exponent if max_ent > 0 else lo
        c.logits = c.logits / np.float32(max(t, 1e-8))
        c.softmax()


class TopK(Sampler):
    def __init__(self, k: int):
        self.k = k

    def apply(self, c):
        if self.k <= 0 or self.k >= len(c.logits):
            return
        if not c.sorted:
            part = np.argpartition(-c.logits, self.k - 1)[:self.k]
            o = part[np.argsort(-c.logits[part], kind="stable")]
            # stable among ties by original position, as a stable sort of the whole list would be
            c.ids, c.logits = c.ids[o], c.logits[o]
            c.p = c.p[o] if c.p is not None else None
            c.sorted = True
        else:
            c.keep(self.k)


class TopP(Sampler):
    def __init__(self, p: float, min_keep: int = 1):
        self.p, self.min_keep = p, min_keep

    def apply(self, c):
        if self.p >= 1.0:
            return
        c.softmax()
        cum = np.cumsum(c.p, dtype=np.float64)
        n = int(np.searchsorted(cum, self.p, side="left")) + 1
        c.keep(max(min(n, len(cum)), self.min_keep))


class MinP(Sampler):
    def __init__(self, p: float, min_keep: int = 1):
        self.p, self.min_keep = p, min_keep

    def apply(self, c):
        if self.p <= 0 or not len(c.logits):
            return
        c.sort()
        thr = c.logits[0] + np.float32(math.log(self.p))
        n = int((c.logits >= thr).sum())
        c.keep(max(n, self.min_keep))


class Typical(Sampler):
    def __init__(self, p: float, min_keep: int = 1):
        self.p, self.min_keep = p, min_keep

    def apply(self, c):
        if self.p >= 1.0:
            return
        c.softmax()
        p = c.p.astype(np.float64)
        logp = np.log(np.maximum(p, 1e-45))
        ent = -(p * logp).sum()
        shifted = np.abs(-logp - ent)
        o = np.argsort(shifted, kind="stable")
        cum = np.cumsum(p[o])
        n = int(np.searchsorted(cum, self.p, side="left")) + 1
        n = max(min(n, len(o)), self.min_keep)
        keep = o[:n]
        c.ids, c.logits, c.p = c.ids[keep], c.logits[keep], c.p[keep]
        c.sorted = False


class Penalties(Sampler):
    """Repeat (divide positive / multiply negative logits), frequency and presence penalties over the last n tokens."""

    def __init__(self, last_n: int = 64, repeat: float = 1.0, freq: float = 0.0, present: float = 0.0):
        self.last_n, self.repeat, self.freq, self.present = last_n, repeat, freq, present
        self.hist: deque = deque(maxlen=max(last_n, 0) or None)
        if last_n == 0:
            self.hist = deque(maxlen=0)

    def accept(self, token):
        if self.last_n != 0:
            self.hist.append(int(token))

    def reset(self):
        self.hist.clear()

    def apply(self, c):
        if not self.hist or (self.repeat == 1.0 and self.freq == 0.0 and self.present == 0.0):
            return
        toks, counts = np.unique(np.fromiter(self.hist, dtype=np.int64), return_counts=True)
        if c.sorted or len(c.ids) != len(c.logits) or not np.array_equal(c.ids[:1], [0]):
            pos = {int(t): i for i, t in enumerate(c.ids)}
            idx = np.array([pos.get(int(t), -1) for t in toks])
        else:
            idx = toks
        ok = (idx >= 0) & (idx < len(c.logits))
        idx, counts = idx[ok], counts[ok]
        lg = c.logits[idx]
        lg = np.where(lg <= 0, lg * self.repeat, lg / self.repeat)
        lg = lg - counts * self.freq - (counts > 0) * self.present
        c.logits[idx] = lg.astype(np.float32)
        c.sorted = False
        c.p = None


class LogitBias(Sampler):
    def __init__(self, n_vocab: int, bias: dict):
        self.bias = {int(k): float(v) for k, v in (bias or {}).items() if 0 <= int(k) < n_vocab}

    def apply(self, c):
        if not self.bias:
            return
        pos = {int(t): i for i, t in enumerate(c.ids)} if c.sorted else None
        for t, b in self.bias.items():
            i = pos.get(t, -1) if pos is not None else t
            if 0 <= i < len(c.logits):
                c.logits[i] += b
        c.sorted = False
        c.p = None


class Mirostat(Sampler):
    """Mirostat v1 (Basu et al.): estimate s_hat from the top m, pick k from it, sample, update mu."""

    def __init__(self, n_vocab: int, seed=None, tau: float = 5.0, eta: float = 0.1, m: int = 100):
        self.n_vocab, self.tau, self.eta, self.m = n_vocab, tau, eta, m
        self.mu = 2.0 * tau
        self.seed = seed
        self.rng = np.random.default_rng(seed)

    def apply(self, c):
        c.softmax()
        p = c.p.astype(np.float64)
        m = min(self.m, len(p) - 1)
        if m >= 1:
            i = np.arange(m)
            t_i = np.log((i + 2) / (i + 1))
            b_i = np.log(p[:m] / np.maximum(p[1:m + 1], 1e-45))
            s_hat = (t_i * b_i).sum() / (t_i * t_i).sum()
        else:
            s_hat = 1.0
        eps = s_hat - 1
        k = int(((eps * 2 ** self.mu) / (1 - self.n_vocab ** (-eps))) ** (1 / s_hat)) if eps > 0 else len(p)
        c.keep(max(1, min(k, len(p))))
        c.softmax()
        cdf = np.cumsum(c.p, dtype=np.float64)
        j = int(min(np.searchsorted(cdf, self.rng.random() * cdf[-1], side="right"), len(cdf) - 1))
        c.selected = j
        self.mu -= self.eta * (-math.log2(max(float(c.p[j]), 1e-45)) - self.tau)

    def reset(self):
        self.mu = 2.0 * self.tau
        self.rng = np.random.default_rng(self.seed)


class MirostatV2(Sampler):
    def __init__(self, seed=None, tau: float = 5.0, eta: float = 0.1):
        self.tau, self.eta = tau, eta
        self.mu = 2.0 * tau
        self.seed = seed
        self.rng = np.random.default_rng(seed)

    def apply(self, c):
        c.softmax()
        surprise = -np.log2(np.maximum(c.p.astype(np.float64), 1e-45))
        n = int((surprise <= self.mu).sum())
        c.keep(max(n, 1))
        c.softmax()
        cdf = np.cumsum(c.p, dtype=np.float64)
        j = int(min(np.searchsorted(cdf, self.rng.random() * cdf[-1], side="right"), len(cdf) - 1))
        c.selected = j
        self.mu -= self.eta * (-math.log2(max(float(c.p[j]), 1e-45)) - self.tau)

    def reset(self):
        self.mu = 2.0 * self.tau
        self.rng = np.random.default_rng(self.seed)


class Chain(Sampler):
    def __init__(self, samplers: list):
        self.samplers = list(samplers)

    def sample(self, logits: np.ndarray) -> int:
        c = Candidates(logits)
        for s in self.samplers:
            s.apply(c)
            if c.selected >= 0:
                break
        if c.selected < 0:   # no terminal sampler: take the best remaining
            c.selected = int(np.argmax(c.logits))
        return int(c.ids[c.selected])

    def apply(self, c):
        for s in self.samplers:
            s.apply(c)

    def accept(self, token):
        for s in self.samplers:
            s.accept(token)

    def reset(self):
        for s in self.samplers:
            s.reset()

    @classmethod
    def from_params(cls, temperature=0.8, top_k=40, top_p=0.95, min_p=0.05, typical_p=1.0, repeat_penalty=1.0,
                    repeat_last_n=64, frequency_penalty=0.0, presence_penalty=0.0, mirostat=0, mirostat_tau=5.0,
                    mirostat_eta=0.1, logit_bias=None, seed=None, n_vocab=0, dynatemp_range=0.0,
                    dynatemp_exponent=1.0) -> "Chain":
        s: list = []
        if logit_bias:
            s.append(LogitBias(n_vocab, logit_bias))
        if repeat_penalty != 1.0 or frequency_penalty or presence_penalty:
            s.append(Penalties(repeat_last_n, repeat_penalty, frequency_penalty, presence_penalty))
        if temperature is not None and temperature <= 0:
            s.append(Greedy())
            return cls(s)
        if mirostat == 1:
            return cls(s + [Temp(temperature), Mirostat(n_vocab, seed, mirostat_tau, mirostat_eta)])
        if mirostat == 2:
            return cls(s + [Temp(temperature), MirostatV2(seed, mirostat_tau, mirostat_eta)])
        s += [TopK(top_k), Typical(typical_p), TopP(top_p), MinP(min_p),
              TempExt(temperature, dynatemp_range, dynatemp_exponent), Dist(seed)]
        return cls(s)


def top_logprobs(logits: np.ndarray, k: int) -> list:
    """The k most likely tokens with their log-probabilities over the whole vocabulary (raw logits)."""
    x = np.asarray(logits, np.float64)
    m = x.max()
    lse = m + math.log(np.exp(x - m).sum())
    k = min(k, len(x))
    if k <= 0:
        return []
    idx = np.argpartition(-x, k - 1)[:k]
    idx = idx[np.lexsort((idx, -x[idx]))]
    return [(int(i), float(x[i] - lse)) for i in idx]
