"""Samplers with llama.cpp's semantics on hand-made logits."""
from __future__ import annotations

import math

import numpy as np

from llampy.llama.sampling import (Candidates, Chain, Dist, Greedy, LogitBias, MinP, Mirostat, MirostatV2,
                                   Penalties, Temp, TempExt, TopK, TopP, Typical, top_logprobs)

L = np.log(np.array([0.5, 0.2, 0.15, 0.1, 0.05], np.float32))


def cands(logits=L):
    c = Candidates(logits)
    return c


def test_greedy_and_temp_zero():
    assert Chain([Greedy()]).sample(L) == 0
    assert Chain.from_params(temperature=0, n_vocab=5).sample(L[::-1].copy()) == 4


def test_top_k_top_p_min_p():
    c = cands(); TopK(2).apply(c)
    assert list(c.ids) == [0, 1]
    c = cands(); TopP(0.7).apply(c)
    assert list(c.ids) == [0, 1]            # 0.5 + 0.2 reaches 0.7
    c = cands(); TopP(0.71).apply(c)
    assert list(c.ids) == [0, 1, 2]
    c = cands(); MinP(0.25).apply(c)         # keep p >= 0.25 * 0.5
    assert list(c.ids) == [0, 1, 2]
    c = cands(); MinP(0.99, min_keep=2).apply(c)
    assert list(c.ids) == [0, 1]


def test_temperature_scales_logits():
    c = cands(); Temp(2.0).apply(c)
    np.testing.assert_allclose(c.logits, L / 2)
    c = cands(); Temp(0.0).apply(c)
    assert np.isinf(c.logits[1:]).all() and c.logits[0] == L[0]


def test_typical_keeps_the_most_typical():
    c = cands(); Typical(0.5).apply(c)
    p = np.exp(L)
    ent = -(p * L).sum()
    order = np.argsort(np.abs(-L - ent), kind="stable")
    assert c.ids[0] == order[0]


def test_penalties_match_hand_computation():
    pen = Penalties(last_n=3, repeat=1.5, freq=0.1, present=0.2)
    for t in (0, 3, 3, 1):                   # window keeps 3, 3, 1
        pen.accept(t)
    c = cands(); pen.apply(c)
    want = L.copy()
    want[3] = want[3] * 1.5 - 2 * 0.1 - 0.2   # negative logit: multiplied
    want[1] = want[1] * 1.5 - 0.1 - 0.2
    np.testing.assert_allclose(c.logits, want, rtol=1e-6)
    assert c.logits[0] == L[0]               # 0 fell out of the window


def test_logit_bias_and_dist_reproducible_and_distributed():
    c = cands(); LogitBias(5, {4: 10.0}).apply(c)
    assert int(np.argmax(c.logits)) == 4
    a = [Chain([Dist(42)]).sample(L) for _ in range(3)]
    s1, s2 = Chain([Dist(7)]), Chain([Dist(7)])
    draws1 = [s1.sample(L) for _ in range(50)]
    assert draws1 == [s2.sample(L) for _ in range(50)]
    d = Chain([Dist(0)])
    counts = np.bincount([d.sample(L) for _ in range(20000)], minlength=5) / 20000
    np.testing.assert_allclose(counts, np.exp(L), atol=0.015)


def test_mirostat_updates_mu():
    for m in (Mirostat(5, seed=1, tau=3.0, eta=0.5), MirostatV2(seed=1, tau=3.0, eta=0.5)):
        mu0 = m.mu
        c = cands(); m.apply(c)
        chosen_p = float(np.exp(L)[c.ids[c.selected]] / np.exp(L[c.ids]).sum()) if isinstance(m, Mirostat) else None
        assert m.mu != mu0
        assert c.selected >= 0
        m.reset()
        assert m.mu == 6.0


def test_dynamic_temperature_and_top_logprobs():
    c = cands(); TempExt(1.0, 0.5, 1.0).apply(c)
    assert c.p is not None and abs(float(c.p.sum()) - 1) < 1e-6
    tl = top_logprobs(L, 3)
    assert [i for i, _ in tl] == [0, 1, 2]
    assert abs(tl[0][1] - math.log(0.5)) < 1e-6


def test_default_chain_on_large_vocab_is_fast():
    import time
    logits = np.random.default_rng(0).standard_normal(262144).astype(np.float32)
    ch = Chain.from_params(seed=1, n_vocab=262144, repeat_penalty=1.1)
    ch.accept(5)
    t0 = time.perf_counter()
    for _ in range(5):
        tok = ch.sample(logits)
    assert 0 <= tok < 262144
    assert (time.perf_counter() - t0) / 5 < 0.2
