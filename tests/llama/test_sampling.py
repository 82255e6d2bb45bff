"""Samplers against llama.cpp's semantics: the cases of llama.cpp's own tests/test-sampling.cpp, hand computations,
the random streams of std::mt19937, and (when a built libllama.so is at hand) a differential run against it."""
from __future__ import annotations

import ctypes
import math
import zlib
from pathlib import Path

import numpy as np
import pytest

from llampy.llama.sampling import (MT19937, XTC, Candidates, Chain, Dist, Greedy, LogitBias, MinP, Mirostat,
                                   MirostatV2, Penalties, Temp, TempExt, TopK, TopNSigma, TopP, Typical,
                                   sampler_order, top_logprobs)
from llampy.llama.sampling_dry import DRY

ROOT = Path(__file__).resolve().parents[2]


def apply_then_dist(probs, sampler, then_dist=True):
    """llama.cpp's sampler_tester: logits = log(probs) in id order, apply, then dist(0) (which normalises p)."""
    c = Candidates(np.log(np.array(probs, np.float32)))
    sampler.apply(c)
    if then_dist:
        Dist(0).apply(c)
    return c


# ------------------------------------------------------------------- llama.cpp's tests/test-sampling.cpp cases
P4 = [0.1, 0.2, 0.3, 0.4]


@pytest.mark.parametrize("sampler, expected", [
    (Temp(1.0), P4), (Temp(0.0), [0, 0, 0, 1]),
    (TempExt(1.0, 0.0, 1.0), P4), (TempExt(0.0, 0.0, 1.0), [0, 0, 0, 1]),
    (TopK(1), [1.0]), (TopK(3), [0.44444, 0.33333, 0.22222]), (TopK(4), [0.4, 0.3, 0.2, 0.1]), (TopK(0), P4),
    (TopP(0, 0), [1.0]), (TopP(0.7, 0), [0.571429, 0.428571]), (TopP(0.8, 0), [0.44444, 0.33333, 0.22222]),
    (TopP(1.0, 0), P4),
    (MinP(0.0, 0), P4), (MinP(0.24, 0), P4), (MinP(0.26, 0), [0.2 / 0.9, 0.3 / 0.9, 0.4 / 0.9]),
    (MinP(0.49, 0), [0.2 / 0.9, 0.3 / 0.9, 0.4 / 0.9]), (MinP(0.51, 0), [0.3 / 0.7, 0.4 / 0.7]),
    (MinP(0.74, 0), [0.3 / 0.7, 0.4 / 0.7]), (MinP(0.76, 0), [1.0]), (MinP(1.0, 0), [1.0]), (MinP(1.05, 0), [1.0]),
])
def test_llamacpp_cases(sampler, expected):
    c = apply_then_dist(P4, sampler)
    np.testing.assert_allclose(c.p, expected, atol=1e-5)


def test_llamacpp_typical_cases():
    np.testing.assert_allclose(apply_then_dist([0.97, 0.01, 0.01, 0.01], Typical(0.5, 0), False).p, [0.97], atol=1e-5)
    c = apply_then_dist([0.4, 0.2, 0.2, 0.2], Typical(0.5, 0), False)
    np.testing.assert_allclose(c.p, [0.2, 0.2, 0.2], atol=1e-5)   # p is not renormalised by typical
    assert list(c.ids) == [1, 2, 3] and not c.sorted                 # most typical first, ties by position


@pytest.mark.parametrize("last, expected, rep, freq, pres", [
    ([0], [0, 0.25, 0.25, 0.25, 0.25], 50.0, 0.0, 0.0),
    ([0, 1, 2], [0, 0, 0, 0.5, 0.5], 50.0, 0.0, 0.0),
    ([0, 1, 2, 0, 0], [0, 0, 0, 0.5, 0.5], 50.0, 0.0, 0.0),
    ([0], [0.000011, 0.249997, 0.249997, 0.249997, 0.249997], 1.0, 5.0, 5.0),
    ([0, 1, 2], [0.000023, 0.000023, 0.000023, 0.499966, 0.499966], 1.0, 5.0, 5.0),
    ([0, 1, 2, 0, 0], [0.000000, 0.000023, 0.000023, 0.499977, 0.499977], 1.0, 5.0, 5.0),
])
def test_llamacpp_penalty_cases(last, expected, rep, freq, pres):
    pen = Penalties(len(last), rep, freq, pres)
    for t in last:
        pen.accept(t)
    np.testing.assert_allclose(apply_then_dist([0.2] * 5, pen).p, expected, atol=1e-5)


@pytest.mark.parametrize("seq, top_k, top_p, min_p", [
    ("k", 10000, 1.0, 1.0), ("k", 1, 1.0, 1.0), ("p", 10000, 1.0, 1.0), ("p", 10000, 0.0, 1.0),
    ("m", 10000, 1.0, 1.0), ("m", 10000, 1.0, 1e-12), ("k", 100, 1.0, 1.0), ("p", 10000, 0.0003, 1.0),
    ("p", 10000, 0.8, 1.0), ("m", 10000, 1.0, 9997.9 / 9999.0), ("m", 10000, 1.0, 0.1),
    ("kp", 100, 0.8, 0.1), ("km", 100, 0.8, 0.1), ("pk", 100, 0.8, 0.1), ("pm", 100, 0.8, 0.1),
    ("mk", 100, 0.8, 0.1), ("mp", 100, 0.8, 9997.9 / 9999.0), ("mp", 100, 0.8, 0.1),
    ("kpm", 100, 0.8, 0.1), ("kmp", 100, 0.8, 0.1), ("pkm", 100, 0.8, 0.1), ("pmk", 100, 0.8, 0.1),
    ("mkp", 100, 0.8, 0.1), ("mpk", 100, 0.8, 0.1),
])
def test_llamacpp_sampler_queue(seq, top_k, top_p, min_p):
    """test_sampler_queue: logits log(id) over 10000 tokens; sizes and end ids after each sampler."""
    n_vocab = 10000
    with np.errstate(divide="ignore"):
        c = Candidates(np.log(np.arange(n_vocab, dtype=np.float32)))
    min_id, max_id = 0, n_vocab - 1
    for s in seq:
        {"k": TopK(top_k), "p": TopP(top_p, 1), "m": MinP(min_p, 1)}[s].apply(c)
        Dist(0).apply(c)
        size = c.size
        if s == "k":
            exp_size = min(size, top_k)
            min_id = max(min_id, n_vocab - top_k)
        elif s == "p":
            divisor = n_vocab * (n_vocab - 1) // 2 - min_id * (min_id - 1) // 2
            target = math.ceil(np.float32(top_p) * np.float32(divisor))
            min_id, exp_size, cum = n_vocab, 0, 0
            while True:
                min_id -= 1
                exp_size += 1
                cum += min_id
                if cum >= target:
                    break
            if min_id == 1:
                min_id, exp_size = 0, exp_size + 1
        else:
            exp_size = min(max(math.ceil(np.float32(1.0 - np.float32(min_p)) * n_vocab), 1), size)
            min_id = min(max(math.floor(np.float32(min_p) * n_vocab), 1, n_vocab - size), n_vocab - 1)
        assert size == exp_size
        if c.sorted:
            assert c.ids[0] == max_id and c.ids[exp_size - 1] == min_id


@pytest.mark.parametrize("expected, p, t", [
    ([0.1], 0.99, 0.09), ([0.2, 0.1], 0.99, 0.19), ([0.3, 0.2, 0.1], 0.99, 0.29), (P4[::-1], 0.99, 0.39)])
def test_llamacpp_xtc_cases(expected, p, t):
    c = apply_then_dist(P4, XTC(p, t, 0, 0), then_dist=False)
    np.testing.assert_allclose(c.p, expected, atol=1e-5)


@pytest.mark.parametrize("probs, last, expected, mult, base, allowed, last_n, breakers", [
    ([0.25] * 4, [0, 1], [0.25] * 4, 1.0, 1.1, 2, 4, {}),
    ([0.25] * 4, [0, 1, 2, 0, 1], [0.296923, 0.296923, 0.109232, 0.296923], 1.0, 1.1, 2, 5, {}),
    ([0.2] * 5, [0, 1, 3, 4, 0, 1], [0.2] * 5, 1.0, 1.1, 2, 6, {3: [()]}),
    ([0.2] * 5, [0, 1, 2, 0, 1], [0.241818, 0.241818, 0.032727, 0.241818, 0.241818], 2.0, 1.1, 2, 5, {}),
    ([0.2] * 5, [0, 1, 2, 3, 4, 0, 1], [0.2] * 5, 1.0, 1.1, 4, 7, {}),
])
def test_llamacpp_dry_cases(probs, last, expected, mult, base, allowed, last_n, breakers):
    dry = DRY(mult, base, allowed, last_n, breakers)
    for t in last:
        dry.accept(t)
    np.testing.assert_allclose(apply_then_dist(probs, dry).p, expected, atol=1e-5)


@pytest.mark.parametrize("n, expected", [(1, [0, 0, 0.428571, 0.571429]), (0, P4), (3, P4)])
def test_llamacpp_top_n_sigma_cases(n, expected):
    np.testing.assert_allclose(apply_then_dist(P4, TopNSigma(n)).p, expected, atol=1e-5)


def test_dry_restart_sequence_limits_the_repeat():
    """History 7 8 1 2 3 4 7 8 1 2: the suffix 7 8 1 2 occurred before, followed by 3, so 3 extends a repeat of 4
    (penalty 2 ** (4 - 1)). A restart sequence 7 8 caps the repeat at the 2 tokens after its latest occurrence; a
    single-token breaker 1 caps it at 1; a breaker token itself is never penalised."""
    hist = [7, 8, 1, 2, 3, 4, 7, 8, 1, 2]
    logits = np.zeros(10, np.float32)

    def penalised(breakers):
        d = DRY(1.0, 2.0, 1, 64, breakers)
        for t in hist:
            d.accept(t)
        c = Candidates(logits)
        d.apply(c)
        return {int(i): float(-l) for i, l in zip(c.ids, c.logits) if l != 0}
    assert penalised({}) == {3: 8.0}
    assert penalised({7: [(8,)]}) == {3: 2.0}
    assert penalised({7: [(9,)]}) == {3: 8.0}          # the tail does not follow the head: no restart
    assert penalised({1: [()]}) == {3: 1.0}
    assert penalised({3: [()]}) == {}


def test_sampler_order_names_and_letters():
    assert sampler_order(["Top-K", "nucleus", "temp", "typ", "minp", "penalties", "DRY", "xtc", "top_n_sigma"]) == (
        "top_k", "top_p", "temperature", "typ_p", "min_p", "penalties", "dry", "xtc", "top_n_sigma")
    assert sampler_order("edskypmxt") == ("penalties", "dry", "top_n_sigma", "top_k", "typ_p", "top_p", "min_p",
                                          "xtc", "temperature")
    for bad in (["top_q"], "kz", ["infill"], "a", [1], 3):
        with pytest.raises(ValueError):
            sampler_order(bad)


def test_sampler_order_builds_the_chain_in_that_order():
    ch = Chain.from_params(samplers=["temperature", "min_p", "top_k"], temperature=0.7, top_k=5, min_p=0.1, seed=1)
    assert [type(s).__name__ for s in ch.samplers] == ["TempExt", "MinP", "TopK", "Dist"]
    # greedy: the pure filters after the last sampler that changes logits are dropped, the rest kept in order
    ch = Chain.from_params(temperature=0, top_k=5, repeat_penalty=1.2, samplers="kept")
    assert [type(s).__name__ for s in ch.samplers] == ["TopK", "Penalties", "Greedy"]
    # no temperature in the order: llama.cpp samples at temperature 1 whatever the temperature says
    assert type(Chain.from_params(temperature=0, samplers="k", seed=3).samplers[-1]).__name__ == "Dist"


def test_greedy_respects_a_custom_order():
    """[top_k, penalties] at temperature 0: the argmax among the top k after the penalty, not over all tokens."""
    logits = np.array([5.0, 4.9, 4.8, 1.0], np.float32)
    ch = Chain.from_params(temperature=0, top_k=2, repeat_penalty=100.0, samplers=["top_k", "penalties", "temp"])
    for t in (0, 1):
        ch.accept(t)
    assert ch.sample(logits) == 0      # 0 and 1 both penalised (5/100 > 4.9/100): token 2 was cut by top_k
    ch = Chain.from_params(temperature=0, top_k=2, repeat_penalty=100.0)    # default order: penalties first
    for t in (0, 1):
        ch.accept(t)
    assert ch.sample(logits) == 2


def test_dist_singleton_keeps_the_stream():
    one, two = Dist(4242), Dist(4242)
    Chain([one]).sample(np.zeros(1, np.float32))
    Chain([two]).sample(np.zeros(2, np.float32))
    logits = np.zeros(256, np.float32)
    assert [Chain([one]).sample(logits) for _ in range(4)] == [Chain([two]).sample(logits) for _ in range(4)]


# ---------------------------------------------------------------------------------------- hand computations
L = np.log(np.array([0.5, 0.2, 0.15, 0.1, 0.05], np.float32))


def test_greedy_is_argmax_and_temp_zero_chain_is_greedy():
    rng = np.random.default_rng(1)
    for _ in range(20):
        x = rng.standard_normal(1000).astype(np.float32)
        assert Chain([Greedy()]).sample(x) == int(np.argmax(x))
        assert Chain.from_params(temperature=0, n_vocab=1000, seed=3).sample(x) == int(np.argmax(x))
        assert Chain.from_params(temperature=0.0, typical_p=0.9, n_vocab=1000).sample(x) >= 0
    x = np.array([1.0, 3.0, 3.0, 2.0], np.float32)
    assert Chain([Greedy()]).sample(x) == 1                          # ties: the first


def test_temperature_and_min_keep():
    c = Candidates(L); Temp(2.0).apply(c)
    assert np.array_equal(c.logits, L / np.float32(2.0))
    c = Candidates(np.array([1.0, 5.0, 5.0, 2.0], np.float32)); Temp(0.0).apply(c)
    assert c.size == 4 and c.logits[1] == 5.0 and np.isneginf(c.logits[[0, 2, 3]]).all()   # first max survives
    c = Candidates(L); TopP(0.7).apply(c)
    assert list(c.ids) == [0, 1]                                      # 0.5 + 0.2 reaches 0.7 (>=)
    c = Candidates(L); TopP(0.1, min_keep=3).apply(c)
    assert list(c.ids) == [0, 1, 2]
    c = Candidates(L); MinP(0.25).apply(c)                            # keep p >= 0.25 * 0.5, original order
    assert list(c.ids) == [0, 1, 2] and not c.sorted
    c = Candidates(L[::-1].copy()); MinP(0.99, min_keep=2).apply(c)  # too few: sorted fallback
    assert list(c.ids) == [4, 3] and c.sorted
    c = Candidates(L); Typical(0.01, min_keep=2).apply(c)
    assert c.size == 2


def test_top_k_ties_by_position_and_partial_path():
    x = np.zeros(5000, np.float32)
    x[[7, 3000, 4000]] = 1.0
    c = Candidates(x); TopK(5).apply(c)
    assert list(c.ids) == [7, 3000, 4000, 0, 1] and c.sorted
    rng = np.random.default_rng(2)
    y = rng.standard_normal(50000).astype(np.float32)
    c = Candidates(y); TopK(40).apply(c)
    assert list(c.ids) == list(np.argsort(-y, kind="stable")[:40])


def test_partial_selection_is_the_full_sorts_prefix():
    """The bounded-heap top-k (``_order_desc`` with k) keeps exactly the full sort's first k positions: ties by
    position, -inf, -0.0 against 0.0, k of 0 and n - 1."""
    from llampy.llama.sampling import _order_desc
    rng = np.random.default_rng(5)
    for trial in range(200):
        n = int(rng.integers(1, 2000))
        keys = rng.standard_normal(n).astype(np.float32)
        if trial % 3 == 0:
            keys = np.round(keys * 2).astype(np.float32)
        if trial % 5 == 0:
            keys[rng.integers(0, n, 5)] = -np.inf
        if trial % 7 == 0:
            keys[rng.integers(0, n, 3)] = -0.0
        full = _order_desc(keys)
        for k in {0, n // 3, max(n - 1, 0)}:
            assert np.array_equal(_order_desc(keys, k), full[:k]), (trial, n, k)


def test_chain_shortcuts_pick_the_samplers_tokens():
    """Chain.sample's shortcuts (a leading TopK's candidates taken straight from the row, or from top_positions for
    many rows at once, also after a logit bias; a lone Greedy's argmax) pick, step after step, the token that the
    samplers applied one by one to the whole row pick, with the same seeds."""
    from llampy.llama.sampling import top_positions
    rng = np.random.default_rng(11)
    n_vocab = 3000
    bans = {t: -np.inf for t in range(0, 400, 2)}           # ignore_eos's kind: a few always among the top 40
    lower = {**bans, **{t: -2.5 for t in range(1, 200, 2)}}
    raise_ = {**bans, **{t: 4.0 for t in range(500, 510)}}  # pulls tokens from anywhere into the top
    params = [dict(temperature=0.8), dict(temperature=0), dict(temperature=1.1, top_k=1), dict(temperature=0.9, top_k=0),
              dict(temperature=0.7, top_k=300, top_p=0.5), dict(temperature=0.6, top_k=n_vocab + 1),
              dict(temperature=0.8, repeat_penalty=1.3), dict(temperature=1.0, top_k=40, dynatemp_range=0.5),
              dict(temperature=0.8, logit_bias=bans), dict(temperature=0.8, logit_bias=lower),
              dict(temperature=0.9, top_k=5, logit_bias=raise_), dict(temperature=0, logit_bias=lower),
              dict(temperature=0.8, top_k=n_vocab - 250, logit_bias=bans)]
    fast = [Chain.from_params(seed=7 + i, n_vocab=n_vocab, **p) for i, p in enumerate(params)]
    slow = [Chain.from_params(seed=7 + i, n_vocab=n_vocab, **p) for i, p in enumerate(params)]
    for step in range(12):
        logits = (rng.standard_normal((len(params) + 2, n_vocab)) * 3).astype(np.float32)
        logits[:, :50] = np.round(logits[:, :50])       # ties
        rows = [int(r) for r in rng.permutation(len(logits))[:len(params)]]
        tops = top_positions(fast, logits, rows)
        assert [t is not None for t in tops] == [p.get("top_k", 40) in range(1, n_vocab) and p["temperature"] > 0
                                                 and "repeat_penalty" not in p for p in params]
        for i in range(len(params)):
            c = Candidates(logits[rows[i]])
            slow[i].apply(c)
            want = int(c.ids[c.selected])
            got = fast[i].sample(logits[rows[i]], tops[i]) if step % 2 else fast[i].sample(logits[rows[i]])
            assert got == want, (step, params[i])
            fast[i].accept(got)
            slow[i].accept(want)


def test_sample_rows_picks_chain_sample_tokens():
    """sample_rows (the server's common chains, every row in one compiled call: top-p, min-p with min_keep, the
    temperature and the draw, after a logit bias or none) picks, step after step, the token that the samplers
    applied one by one to the whole row pick, with the same seeds; the other chains are left to Chain.sample."""
    from llampy.llama.sampling import sample_rows, top_positions
    rng = np.random.default_rng(5)
    n_vocab = 3000
    bans = {t: -np.inf for t in range(0, 400, 2)}
    raise_ = {**bans, **{t: 4.0 for t in range(500, 510)}}
    params = [dict(temperature=0.8), dict(temperature=0.8, logit_bias=bans), dict(temperature=1.3, top_k=1),
              dict(temperature=0.7, top_k=300, top_p=0.5, min_keep=3), dict(temperature=0.6, top_p=1.0, min_p=0.2),
              dict(temperature=0.9, top_p=0.999999, min_p=0.0), dict(temperature=0.5, min_p=0.9, min_keep=5),
              dict(temperature=0.9, top_k=5, logit_bias=raise_), dict(temperature=0.8, samplers="kpt"),
              dict(temperature=1.0, dynatemp_range=0.5), dict(temperature=0.8, repeat_penalty=1.3),
              dict(temperature=0), dict(temperature=0.8, samplers="mkt"), dict(temperature=0.8, samplers="kmpt")]
    batched = [True] * 9 + [False] * 5
    fast = [Chain.from_params(seed=3 + i, n_vocab=n_vocab, **p) for i, p in enumerate(params)]
    slow = [Chain.from_params(seed=3 + i, n_vocab=n_vocab, **p) for i, p in enumerate(params)]
    for step in range(16):
        logits = (rng.standard_normal((len(params) + 2, n_vocab)) * (1 + step % 4)).astype(np.float32)
        logits[:, :50] = np.round(logits[:, :50])       # ties
        rows = [int(r) for r in rng.permutation(len(logits))[:len(params)]]
        tops = top_positions(fast, logits, rows)
        got = sample_rows(fast, logits, rows, tops)
        assert [g is not None for g in got] == batched
        for i in range(len(params)):
            c = Candidates(logits[rows[i]])
            slow[i].apply(c)
            want = int(c.ids[c.selected])
            tok = got[i] if got[i] is not None else fast[i].sample(logits[rows[i]], tops[i])
            assert tok == want, (step, params[i])
            fast[i].accept(tok)
            slow[i].accept(want)


def test_top_p_adaptive_path_equals_full_sort():
    rng = np.random.default_rng(3)
    for scale in (0.5, 4.0):                                   # flat: nucleus beyond 256; peaked: inside
        y = (rng.standard_normal(5000) * scale).astype(np.float32)
        a = Candidates(y); TopP(0.9).apply(a)
        b = Candidates(y); b.sort_top(); TopP(0.9).apply(b)
        assert a.sorted and np.array_equal(a.ids, b.ids)


def test_penalties_match_hand_computation():
    pen = Penalties(last_n=3, repeat=1.5, freq=0.1, present=0.2)
    for t in (0, 3, 3, 1):                   # the window keeps 3, 3, 1
        pen.accept(t)
    x = np.array([0.5, 2.0, -1.0, -0.25, 1.0], np.float32)
    c = Candidates(x); pen.apply(c)
    want = x.copy()
    want[3] = np.float32(-0.25 * 1.5) - np.float32(2 * 0.1 + 0.2)   # non-positive: multiplied
    want[1] = np.float32(2.0 / 1.5) - np.float32(0.1 + 0.2)         # positive: divided
    np.testing.assert_allclose(c.logits, want, rtol=1e-6)
    assert c.logits[0] == x[0] and not c.sorted                      # 0 left the window
    d = Candidates(x); d.sort_top(); pen.apply(d)                    # same, found by id in a shuffled array
    np.testing.assert_allclose(d.logits[np.argsort(d.ids)], want, rtol=1e-6)
    pen.reset(); c = Candidates(x); pen.apply(c)
    assert np.array_equal(c.logits, x)


def test_logit_bias_by_id_in_any_order():
    c = Candidates(L); LogitBias(5, {4: 10.0, 9: 1.0}).apply(c)
    assert Greedy().apply(c) is None and c.ids[c.selected] == 4
    d = Candidates(L); TopK(3).apply(d); LogitBias(5, {2: -np.inf}).apply(d)
    assert list(d.ids) == [0, 1, 2] and np.isneginf(d.logits[2]) and not d.sorted


def test_mirostat_v2_mu_update_by_hand():
    m = MirostatV2(seed=1, tau=1.25, eta=0.5)                # mu = 2.5: keep while -log2 p <= 2.5
    c = Candidates(L); m.apply(c)
    assert list(c.ids) == [0, 1]                             # 1 bit, 2.32 bits; 0.15 is 2.74 bits: cut
    p = np.array([0.5, 0.2]) / 0.7
    np.testing.assert_allclose(c.p, p, rtol=1e-6)
    assert m.mu == pytest.approx(2.5 - 0.5 * (-math.log2(p[c.selected]) - 1.25), rel=1e-6)
    m.reset()
    assert m.mu == 2.5


def test_mirostat_v1_k_and_mu_by_hand():
    # Zipf-like probabilities p_i ~ 1/i^s: s_hat recovers s, k follows from the closed form
    s, n = 1.3, 50
    p = 1.0 / np.arange(1, n + 1) ** s
    m = Mirostat(n_vocab=n, seed=5, tau=2.0, eta=0.25, m=100)
    c = Candidates(np.log(p).astype(np.float32)); m.apply(c)
    eps = s - 1
    k = int(((eps * 2 ** 4.0) / (1 - n ** -eps)) ** (1 / s))
    assert c.size == k
    q = p[:k] / p[:k].sum()
    assert m.mu == pytest.approx(4.0 - 0.25 * (-math.log2(q[c.selected]) - 2.0), rel=1e-5)


def test_temp_ext_entropy_mapping():
    x = np.log(np.array([0.25, 0.25, 0.25, 0.25], np.float32))     # maximal entropy: t = t + delta
    c = Candidates(x + np.array([0, 0, 0, 1e-7], np.float32)); TempExt(1.0, 0.5, 1.0).apply(c)
    np.testing.assert_allclose(c.p, 0.25, atol=1e-6)
    y = np.log(np.array([0.7, 0.2, 0.1], np.float32))
    c = Candidates(y); TempExt(1.0, 0.5, 1.0).apply(c)
    h = -(0.7 * math.log(0.7) + 0.2 * math.log(0.2) + 0.1 * math.log(0.1)) / math.log(3)
    t = 0.5 + 1.0 * h
    want = np.exp(np.log([0.7, 0.2, 0.1]) / t)
    np.testing.assert_allclose(c.p, want / want.sum(), rtol=1e-5)


# ----------------------------------------------------------------------------------------------- randomness
def test_mt19937_is_the_cpp_stream():
    # [rand.predef]: the 10000th output of a default-constructed std::mt19937 (seed 5489) is 4123659995
    assert int(MT19937(5489).bitgen.random_raw(10000)[-1]) == 4123659995
    r = MT19937(5489)
    a, b = 3499211612, 581869302                                      # its first two outputs
    assert r.uniform() == (a + b * 2.0 ** 32) / 2.0 ** 64


def test_seeded_reproducible_and_reset():
    x = np.random.default_rng(0).standard_normal(3000).astype(np.float32)
    for make in (lambda: Chain.from_params(seed=7, n_vocab=3000, top_k=0, min_p=0.0),
                 lambda: Chain.from_params(seed=7, n_vocab=3000, mirostat=1),
                 lambda: Chain.from_params(seed=7, n_vocab=3000, mirostat=2)):
        a, b = make(), make()
        ra = [a.sample(x) for _ in range(30)]
        assert ra == [b.sample(x) for _ in range(30)]
        a.reset()
        assert [a.sample(x) for _ in range(30)] == ra
        assert len(set(ra)) > 1


def test_dist_follows_the_distribution():
    d = Chain([Dist(0)])
    n = 20000
    counts = np.bincount([d.sample(L) for _ in range(n)], minlength=5)
    expected = np.exp(L.astype(np.float64)) / np.exp(L.astype(np.float64)).sum() * n
    chi2 = float(((counts - expected) ** 2 / expected).sum())
    assert chi2 < 18.5                                   # chi-square, 4 degrees of freedom, p = 0.001


def test_top_logprobs():
    tl = top_logprobs(L, 3)
    assert [i for i, _ in tl] == [0, 1, 2]
    assert abs(tl[0][1] - math.log(0.5)) < 1e-6
    x = np.array([0.0, 2.0, 2.0, 1.0], np.float32)
    assert [i for i, _ in top_logprobs(x, 4)] == [1, 2, 3, 0]
    assert top_logprobs(x, 0) == []


def test_chain_without_a_selector_raises():
    with pytest.raises(ValueError, match="selected no token"):
        Chain([TopK(2)]).sample(L)


@pytest.mark.parametrize("n_vocab", [49152, 262144])
def test_default_chain_on_large_vocabularies(n_vocab):
    """The default chain with penalties and a bias on a real vocabulary size: the same seed gives the same tokens,
    and the biased token's chance falls (its speed: benchmarks/sampler_step.py)."""
    logits = np.random.default_rng(0).standard_normal(n_vocab).astype(np.float32) * 3

    def draws():
        ch = Chain.from_params(seed=1, n_vocab=n_vocab, repeat_penalty=1.1, logit_bias={5: -1.0})
        for t in (5, 17, 99):
            ch.accept(t)
        return [ch.sample(logits) for _ in range(20)]
    a = draws()
    assert all(0 <= t < n_vocab for t in a) and a == draws()


# ------------------------------------------------------------------------ differential run against libllama
def _find_libllama():
    from tests import llamacpp
    return llamacpp.libllama()


class _TDA(ctypes.Structure):
    _fields_ = [("data", ctypes.c_void_p), ("size", ctypes.c_size_t), ("selected", ctypes.c_int64),
                ("sorted", ctypes.c_bool)]


class _Bias(ctypes.Structure):
    _fields_ = [("token", ctypes.c_int32), ("bias", ctypes.c_float)]


_TD = np.dtype([("id", "<i4"), ("logit", "<f4"), ("p", "<f4")])


class LibLlama:
    """llama.cpp's samplers through ctypes, built from our sampler objects' parameters."""

    def __init__(self, path):
        lib = self.lib = ctypes.CDLL(path)
        vp, f, i32, u32, sz = ctypes.c_void_p, ctypes.c_float, ctypes.c_int32, ctypes.c_uint32, ctypes.c_size_t
        sigs = {"greedy": [], "dist": [u32], "top_k": [i32], "top_p": [f, sz], "min_p": [f, sz], "typical": [f, sz],
                "temp": [f], "temp_ext": [f, f, f], "mirostat": [i32, u32, f, f, i32], "mirostat_v2": [u32, f, f],
                "penalties": [i32, i32, f, f, f], "logit_bias": [i32, i32, ctypes.POINTER(_Bias)],
                "top_n_sigma": [f], "xtc": [f, f, sz, u32],
                "dry": [vp, f, f, i32, i32, ctypes.POINTER(ctypes.c_char_p), sz]}
        for name, args in sigs.items():
            fn = getattr(lib, f"llama_sampler_init_{name}")
            fn.restype, fn.argtypes = vp, args
        lib.llama_sampler_apply.argtypes = [vp, ctypes.POINTER(_TDA)]
        lib.llama_sampler_accept.argtypes = [vp, i32]
        lib.llama_sampler_free.argtypes = [vp]

    def make(self, s, n_vocab):
        L = self.lib
        if isinstance(s, Greedy): return L.llama_sampler_init_greedy()
        if isinstance(s, Dist): return L.llama_sampler_init_dist(s.seed)
        if isinstance(s, TopK): return L.llama_sampler_init_top_k(s.k)
        if isinstance(s, TopP): return L.llama_sampler_init_top_p(s.p, s.min_keep)
        if isinstance(s, MinP): return L.llama_sampler_init_min_p(s.p, s.min_keep)
        if isinstance(s, Typical): return L.llama_sampler_init_typical(s.p, s.min_keep)
        if isinstance(s, Temp): return L.llama_sampler_init_temp(s.t)
        if isinstance(s, TempExt): return L.llama_sampler_init_temp_ext(s.t, s.delta, s.exponent)
        if isinstance(s, MirostatV2): return L.llama_sampler_init_mirostat_v2(s.seed, s.tau, s.eta)
        if isinstance(s, Mirostat): return L.llama_sampler_init_mirostat(s.n_vocab, s.seed, s.tau, s.eta, s.m)
        if isinstance(s, Penalties): return L.llama_sampler_init_penalties(n_vocab, s.last_n, s.repeat, s.freq,
                                                                           s.present)
        if isinstance(s, TopNSigma): return L.llama_sampler_init_top_n_sigma(s.n)
        if isinstance(s, XTC): return L.llama_sampler_init_xtc(s.probability, s.threshold, s.min_keep, s.seed)
        if isinstance(s, DRY):          # no vocabulary: breakers are tested through llama_cpp (test below)
            assert not s.breakers
            return L.llama_sampler_init_dry(None, s.multiplier, s.base, s.allowed_length, s.penalty_last_n, None, 0)
        if isinstance(s, LogitBias):
            arr = (_Bias * len(s.bias))(*[_Bias(t, b) for t, b in s.bias.items()])
            return L.llama_sampler_init_logit_bias(n_vocab, len(s.bias), arr)
        raise TypeError(s)


@pytest.fixture(scope="module")
def libllama():
    path = _find_libllama()
    if path is None:
        from tests import llamacpp
        llamacpp.missing("libllama.so")
    return LibLlama(path)


CHAINS = {
    "default": lambda n: Chain.from_params(seed=11, n_vocab=n, repeat_penalty=1.3, frequency_penalty=0.2,
                                           presence_penalty=0.1, logit_bias={3: 2.0, 8: -np.inf}),
    "no-top-k": lambda n: Chain.from_params(temperature=1.1, top_k=0, top_p=0.9, min_p=0.02, seed=5, n_vocab=n),
    "typical-dynatemp": lambda n: Chain.from_params(top_k=200, typical_p=0.8, dynatemp_range=0.5, seed=9,
                                                    n_vocab=n, repeat_penalty=1.1),
    "min-p-only": lambda n: Chain([MinP(0.1, 3), Temp(0.7), Dist(1234)]),
    "mirostat": lambda n: Chain.from_params(mirostat=1, temperature=0.9, seed=21, n_vocab=n, mirostat_tau=3.0),
    "mirostat2": lambda n: Chain.from_params(mirostat=2, temperature=0.9, seed=22, n_vocab=n, mirostat_tau=3.0),
    "greedy-temp0": lambda n: Chain([Penalties(8, 1.5, 0.0, 0.0), TopK(10), Temp(0.0), Dist(3)]),
    "min-keep": lambda n: Chain([TopP(0.5, 300), Typical(0.3, 5), MinP(0.9, 50), TempExt(0.8, 0.7, 2.0), Dist(77)]),
    "min-p-fallback": lambda n: Chain([LogitBias(n, {0: 5.0, 2999: 4.0}), MinP(0.9, 40), Greedy()]),
    "top-n-sigma": lambda n: Chain([TopK(300), TopNSigma(1.3), Temp(0.9), Dist(5)]),
    "top-n-sigma-first": lambda n: Chain.from_params(top_n_sigma=2.0, top_k=0, seed=6, n_vocab=n),
    "xtc": lambda n: Chain([TopK(60), XTC(0.6, 0.04, 2, 123), Temp(1.0), Dist(123)]),
    "xtc-min-keep": lambda n: Chain([Temp(0.3), XTC(0.9, 0.01, 40, 7), Dist(8)]),
    "xtc-chain": lambda n: Chain.from_params(xtc_probability=0.5, xtc_threshold=0.02, min_keep=3, seed=44, n_vocab=n),
    "dry": lambda n: Chain([DRY(0.8, 1.75, 2, 40), TopK(40), Dist(8)]),
    "dry-greedy": lambda n: Chain([DRY(2.0, 1.5, 1, 16), Greedy()]),
    "dry-chain": lambda n: Chain.from_params(dry_multiplier=0.5, dry_base=3.0, dry_allowed_length=3,
                                             dry_penalty_last_n=64, dry_sequence_breakers=[], repeat_penalty=1.1,
                                             seed=12, n_vocab=n),
}
# chains whose accepted tokens follow a repetitive script (a few tokens, repeated runs) rather than the sampled
# token, so that DRY has repeats to find
SCRIPTED = {"dry", "dry-greedy", "dry-chain"}


def _script(name: str, steps: int) -> list:
    rnd = np.random.default_rng(zlib.crc32(name.encode()) + 1)
    out: list = []
    while len(out) < steps:
        out += [int(t) for t in rnd.integers(0, 6, 3)] if rnd.random() < 0.3 else out[-rnd.integers(1, 8):] or [1]
    return out[:steps]


@pytest.mark.parametrize("name", list(CHAINS))
def test_matches_libllama_step_by_step(libllama, name):
    """Each sampler's output (ids in order, logits, p, sorted, selected) equals llama.cpp's, over 25 steps of a
    generation with accept()."""
    n = 3000
    ours = CHAINS[name](n)
    theirs = [libllama.make(s, n) for s in ours.samplers]
    rng = np.random.default_rng(zlib.crc32(name.encode()))
    script = _script(name, 60) if name in SCRIPTED else None
    try:
        for step in range(60 if script else 25):
            logits = (rng.standard_normal(n) * rng.uniform(1, 4)).astype(np.float32)
            c = Candidates(logits)
            buf = np.zeros(n, _TD)
            buf["id"], buf["logit"] = np.arange(n), logits
            arr = _TDA(buf.ctypes.data, n, -1, False)
            for s, cs in zip(ours.samplers, theirs):
                s.apply(c)
                libllama.lib.llama_sampler_apply(cs, ctypes.byref(arr))
                off = (arr.data - buf.ctypes.data) // _TD.itemsize      # XTC moves the array's start
                got = buf[off:off + arr.size]
                where = f"{name} step {step} after {s!r}"
                assert arr.size == c.size, where
                assert np.array_equal(got["id"], c.ids), where
                assert np.array_equal(got["logit"], c.logits), where
                assert bool(arr.sorted) == c.sorted, where
                if c.p is not None:       # bit for bit, stale p too: C leaves it in place, and so do we
                    ulps = np.abs(got["p"].view(np.int32).astype(np.int64) - c.p.view(np.int32))
                    assert ulps.max(initial=0) == 0, f"{where}: p differs by {ulps.max()} ulps"
            assert arr.selected == c.selected, name
            tok = script[step] if script else int(c.ids[c.selected])
            ours.accept(tok)
            for cs in theirs:
                libllama.lib.llama_sampler_accept(cs, tok)
    finally:
        for cs in theirs:
            libllama.lib.llama_sampler_free(cs)


# DRY's sequence breakers as llama.cpp reads them from a vocabulary: through llama_cpp's low-level API (a vocabulary
# needs a loaded model), one process per run
_DRY_ORACLE = r"""
import ctypes, json, sys
import numpy as np
import llama_cpp as L
d = json.loads(sys.stdin.read())
L.llama_backend_init()
mp = L.llama_model_default_params()
mp.vocab_only = True
model = L.llama_model_load_from_file(d["model"].encode(), mp)
vocab = L.llama_model_get_vocab(model)
n = L.llama_vocab_n_tokens(vocab)
brk = [b.encode() for b in d["breakers"]]
s = L.llama_sampler_init_dry(vocab, d["mult"], d["base"], d["allowed"], d["last_n"],
                             (ctypes.c_char_p * len(brk))(*brk), len(brk))
TD = np.dtype([("id", "<i4"), ("logit", "<f4"), ("p", "<f4")])
out = []
for t in d["history"]:
    buf = np.zeros(n, TD)
    buf["id"] = np.arange(n)
    arr = L.llama_token_data_array(data=ctypes.cast(buf.ctypes.data, ctypes.POINTER(L.llama_token_data)), size=n,
                                   selected=-1, sorted=False)
    L.llama_sampler_apply(s, ctypes.byref(arr))
    hit = np.flatnonzero(buf["logit"] != 0)
    out.append({int(i): float(buf["logit"][i]) for i in hit})
    L.llama_sampler_accept(s, t)
print(json.dumps(out))
"""


@pytest.mark.parametrize("model", ["smollm2", "gemma3"])
def test_dry_sequence_breakers_match_libllama(model):
    """DRY with string breakers (llama.cpp's defaults and multi-token ones) over a real vocabulary, against
    libllama's, step by step over a repetitive text: which tokens are penalised, by how much."""
    import json
    import subprocess

    from llampy.llama.model import Model
    from llampy.llama.sampling_dry import dry_breakers
    from llampy.models import resolve_model
    from tests import llamacpp
    py = llamacpp.python()
    if py is None:
        llamacpp.missing("a Python with llama_cpp")
    path = resolve_model(model)
    v = Model(path, vocab_only=True).vocab
    text = ("the quick brown fox jumps over the lazy dog and then it rests for a while, " * 3 +
            "the quick red fox jumps over ### the lazy dog and then it rests for a while\n" * 2 +
            "\u00e9t\u00e9 the quick brown fox \"jumps\" over the lazy cat and then it rests for a while, ")
    hist = v.tokenize(text, add_special=False, parse_special=False)
    breakers = ["\n", ":", "\"", "*", "###", "brown fox", "zy dog", "\u00e9t\u00e9"]
    cfg = dict(mult=0.8, base=1.75, allowed=2, last_n=48)
    r = subprocess.run([py, "-c", _DRY_ORACLE], capture_output=True, text=True, timeout=300,
                       input=json.dumps({"model": str(path), "breakers": breakers, "history": hist, **cfg}))
    assert r.returncode == 0, r.stderr[-2000:]
    want = [{int(k): val for k, val in step.items()} for step in json.loads(r.stdout)]
    dry = DRY(cfg["mult"], cfg["base"], cfg["allowed"], cfg["last_n"], dry_breakers(v, breakers))
    got = []
    for t in hist:
        c = Candidates(np.zeros(v.n_tokens, np.float32))
        dry.apply(c)
        hit = np.flatnonzero(c.logits != 0)
        got.append({int(c.ids[i]): float(c.logits[i]) for i in hit})
        dry.accept(t)
    assert sum(1 for step in want if step) > 10         # the text does make DRY penalise
    assert got == want
