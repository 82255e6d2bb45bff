"""Speculative decoding in the server: a draft model (a tiny random model with SmolLM2's vocabulary) and n-gram
prompt lookup draft for SmolLM2; the replies must be the ones the server gives with drafting off
(``speculative.n_max`` 0), greedy and seeded, one request at a time and several slots at once."""
from __future__ import annotations

import concurrent.futures as cf
import copy
import json
import re
from pathlib import Path

import httpx
import pytest

from .conftest import SHARED, serve_in_thread

DRAFT = SHARED / "fixtures" / "tiny" / "qwen2-Q8_0.gguf"
STORY = ("Tom has a red ball. Tom gives the red ball to Anna. Anna has a red ball now. Anna gives the red ball to "
         "Tom. Tom has a red ball now. Tom gives the red ball to Anna. Anna has")
PROMPTS = [STORY, "The capital of France is"]
SEEDED = {"temperature": 0.9, "top_k": 0, "top_p": 1.0, "min_p": 0.0, "seed": 1234}


@pytest.fixture(scope="module")
def spec_server():
    from llampy.llama.speculative import SpecParams
    from llampy.models import smollm2_path
    from llampy.server.app import Server, create_app
    # small n-gram sizes so that these short prompts find matches; the draft model drafts where they do not; every
    # draft checked whole (test_planned_drafts_... cuts them)
    sp = SpecParams(types=("ngram-simple", "draft-simple"), n_max=4, ngram_size_n=3, ngram_size_m=6, plan=False)
    server = Server(smollm2_path(), n_parallel=2, n_ctx=1024, spec=sp, model_draft=DRAFT)
    url, uv, t = serve_in_thread(create_app(server))
    yield url, server
    uv.should_exit = True
    t.join(timeout=5)
    server.engine.stop()


def complete(url, prompt, **kw) -> dict:
    body = {"prompt": prompt, "n_predict": 12, "temperature": 0, "cache_prompt": False, **kw}
    r = httpx.post(url + "/completion", json=body, timeout=300)
    assert r.status_code == 200, r.text
    return r.json()


@pytest.fixture(scope="module")
def plain(spec_server):
    """The replies with drafting off: greedy for each prompt, seeded for the first."""
    url, _ = spec_server
    out = {(p, "greedy"): complete(url, p, **{"speculative.n_max": 0}) for p in PROMPTS}
    # seeded sampling on the real model too (the API test below has more of it, on tiny models)
    out[(PROMPTS[1], "seeded")] = complete(url, PROMPTS[1], **SEEDED, n_predict=8, **{"speculative.n_max": 0})
    for r in out.values():
        assert "draft_n" not in r["timings"]
    return out


def test_greedy_and_seeded_replies_unchanged_by_drafts(spec_server, plain):
    url, server = spec_server
    drafted = accepted = 0
    for (p, how), want in plain.items():
        spec = complete(url, p, **({**SEEDED, "n_predict": 8} if how == "seeded" else {}))
        assert spec["content"] == want["content"], (p, how)
        assert spec["tokens_predicted"] == want["tokens_predicted"]
        drafted += spec["timings"].get("draft_n", 0)
        accepted += spec["timings"].get("draft_n_accepted", 0)
    # the story repeats itself: lookup drafts are accepted; the random draft model's mostly are not
    assert drafted > accepted > 0
    m = httpx.get(url + "/metrics").text
    val = {ln.split()[0]: float(ln.split()[1]) for ln in m.splitlines() if ln.startswith("llamacpp:spec_decode")}
    assert val["llamacpp:spec_decode_num_draft_tokens_total"] >= drafted
    assert 0 < val["llamacpp:spec_decode_num_accepted_tokens_total"] <= val[
        "llamacpp:spec_decode_num_draft_tokens_total"]
    props = httpx.get(url + "/props").json()["speculative"]
    assert props["types"] == ["ngram-simple", "draft-simple"] and props["model_draft"].endswith(DRAFT.name)


def test_slots_draft_together(spec_server, plain):
    """Two requests at once (their drafts in one batch, verified side by side) give the replies each gives alone
    without drafting."""
    url, _ = spec_server
    with cf.ThreadPoolExecutor(2) as ex:
        together = list(ex.map(lambda p: complete(url, p)["content"], PROMPTS))
    assert together == [plain[(p, "greedy")]["content"] for p in PROMPTS]


def test_speculative_fields_checked(spec_server):
    url, _ = spec_server
    for field, v in (("speculative.n_max", -1), ("speculative.p_min", 1.5), ("speculative.n_min", "2")):
        r = httpx.post(url + "/completion", json={"prompt": "Hi", field: v}, timeout=60)
        assert r.status_code == 400 and field in r.text, (field, r.text)


def test_ngram_simple_lookup():
    from llampy.llama.speculative import NgramSimple
    ng = NgramSimple(size_n=2, size_m=3)
    h = [9, 1, 2, 3, 4, 5, 6, 1, 2, 3, 4, 7, 8, 1]
    # pattern (1, 2): latest earlier match at 7, followed by 3 4 7 (size_m 3)
    assert ng.draft(h, 2, 10) == [3, 4, 7]
    assert ng.draft(h, 2, 2) == [3, 4]                  # n_max caps it
    assert ng.draft(h, 99, 10) == []                    # no match
    assert ng.draft(h[:6], 2, 10) == []                 # history too short for n + m + 1


def test_draft_vocabulary_must_match():
    from llampy.llama.model import Model
    from llampy.llama.speculative import SpeculativeError, check_compatible
    v = Model(DRAFT).vocab
    check_compatible(v, v)
    other = copy.copy(v)
    other.tokens = list(v.tokens)
    other.tokens[100] = "<not it>"
    with pytest.raises(SpeculativeError, match="token 100"):
        check_compatible(v, other)
    other = copy.copy(v)
    other.n_tokens = v.n_tokens + 500
    with pytest.raises(SpeculativeError, match="tokens"):
        check_compatible(v, other)


def test_cli_refuses_draft_type_without_model(capsys):
    from llampy.cli import main
    assert main(["serve", "--spec-type", "draft-simple"]) == 2
    assert "--model-draft" in capsys.readouterr().err
    assert main(["serve", "--spec-type", "medusa"]) == 2
    assert "unknown speculative type 'medusa'" in capsys.readouterr().err
    assert Path(DRAFT).is_file()


def test_api_generate_with_drafts_matches_plain():
    """Llama.set_speculative (what `llampy run --model-draft/--spec-type` uses): the same tokens as without drafting,
    on a tiny target (qwen3) with the tiny qwen2 drafting, and with n-gram lookup."""
    from llampy.llama.api import Llama
    from llampy.llama.speculative import SpecParams
    llm = Llama(str(SHARED / "fixtures" / "tiny" / "qwen3-Q8_0.gguf"), n_ctx=256)
    prompt = llm.vocab.tokenize(STORY, add_special=True, parse_special=True)

    def run(**kw):
        return [s.token for s in llm.generate(prompt, 24, llm.make_sampler(**kw))]
    greedy, seeded = run(temperature=0), run(temperature=0.9, seed=5, top_k=0, top_p=1.0, min_p=0.0)
    target = SHARED / "fixtures" / "tiny" / "qwen3-Q8_0.gguf"
    stats = []
    for sp, draft in ((SpecParams(types=("draft-simple",), n_max=5, plan=False), DRAFT),
                      (SpecParams(types=("draft-simple",), n_max=5, plan=False), target),  # drafts it agrees with
                      (SpecParams(types=("ngram-simple",), ngram_size_n=2, ngram_size_m=8), None)):
        llm.set_speculative(sp, draft)
        assert run(temperature=0) == greedy, sp.types
        stats.append(dict(llm.spec_stats))
        assert run(temperature=0.9, seed=5, top_k=0, top_p=1.0, min_p=0.0) == seeded, sp.types
        # the cache holds exactly the tokens the Llama says it holds: a follow-up reuses the prefix correctly
        assert llm.ctx.seq_pos_max(0) == len(llm._cached) - 1
    assert all(st["drafted"] > 0 for st in stats[:2])
    assert llm._planner.cost            # the n-gram run's planner timed its steps (the token loop's, per row count)
    # the target drafting for itself, greedy: every draft is what the target picks
    assert stats[1]["accepted"] == stats[1]["drafted"], stats
    llm.set_speculative(None)
    assert run(temperature=0) == greedy


def test_cli_run_with_drafts_prints_the_plain_run(capsys):
    """`llampy run` with a draft model and with prompt lookup: the greedy tokens of the run without them, and
    llama-cli's summary of drafted / accepted tokens on stderr."""
    from llampy.cli import main
    target = str(SHARED / "fixtures" / "tiny" / "qwen3-Q8_0.gguf")
    base = ["run", target, "-p", STORY, "-n", "16", "--temp", "0", "-c", "256", "--json"]

    def run(*extra):
        assert main(base + list(extra)) == 0
        out, err = capsys.readouterr()
        return json.loads(out)["tokens"], err
    plain, err = run()
    assert "speculative" not in err
    for extra in (["--model-draft", str(DRAFT), "--draft-max", "5", "--draft-whole"],
                  ["--spec-type", "ngram-simple", "--spec-ngram-simple-size-n", "2",
                   "--spec-ngram-simple-size-m", "8"]):
        toks, err = run(*extra)
        assert toks == plain, extra
        m = re.search(r"speculative: (\d+) tokens drafted, (\d+) accepted", err)
        assert m and int(m.group(2)) <= int(m.group(1)), err
        # the draft model drafts at every step (this random target's output never repeats the prompt's 2-grams)
        assert int(m.group(1)) > 0 or extra[0] == "--spec-type", err


class FixedCosts:
    """A DraftPlanner whose step costs are given (not measured): one to three rows cost the same, more cost one per
    row, so a one-slot step checks two drafted tokens at most, and a draft whose rate is low is not checked."""

    def __new__(cls):
        from llampy.llama.speculative import DraftPlanner
        p = DraftPlanner()
        p.cost = {1: 1.0, 2: 1.0, 3: 1.0, 4: 4.0, 5: 5.0, 6: 6.0}
        p.observe_step = lambda n, s: None
        return p


def test_planned_drafts_are_cut_and_replies_unchanged(spec_server, plain):
    """With the planner, the drafts a step checks are cut to what its (here fixed) step costs make worth it; the
    greedy replies stay those without drafting."""
    url, server = spec_server
    e = server.engine
    m0 = dict(e.metrics)
    e.planner = FixedCosts()
    try:
        for p in PROMPTS:
            assert complete(url, p)["content"] == plain[(p, "greedy")]["content"], p
    finally:
        e.planner = None
    drafted = e.metrics["draft_tokens_total"] - m0["draft_tokens_total"]
    steps = e.metrics["draft_steps_total"] - m0["draft_steps_total"]
    assert 0 < drafted <= 2 * steps


def test_draft_planner_costs_and_choices():
    from llampy.llama.speculative import DraftPlanner, DraftRate
    p = DraftPlanner()
    assert p.plan(1, {0: [5, 6]}, {0: 0.9}) == {0: 0}         # no step measured yet: nothing checked
    p.observe_step(1, 9.0)                                      # the first step of a size builds its graph: left out
    assert p.estimate(1) is None
    p.observe_step(1, 1.0)
    p.observe_step(8, 7.0)
    p.observe_step(8, 4.0)
    assert p.estimate(8) == 4.0 and p.estimate(1) == 1.0
    assert p.estimate(4) == 1.0 + 3.0 * 3 / 7                   # between two sizes: interpolated
    assert p.estimate(10) == 4.0 * (1 + DraftPlanner.PRIOR_ROW * 2 / 8)    # past them: optimistic per row
    # one slot, rows 2-7 dearer per token than 1 or 8 (as SmolLM2's products on a 2-core AVX2 host): all seven
    # checked when they are likely right, none when not
    p.cost = {**{n: float(n) for n in range(1, 8)}, 8: 4.0}
    assert p.plan(1, {0: list(range(7))}, {0: 0.95}) == {0: 7}
    assert p.plan(1, {0: list(range(7))}, {0: 0.3}) == {0: 0}
    assert p.plan(1, {0: list(range(12))}, {0: 0.99}) == {0: 12}   # past 8 rows: tried on the optimistic estimate
    # two slots: the likelier drafts first
    p.cost = {2: 2.0, 3: 2.0, 4: 2.0, 5: 5.0}
    assert p.plan(2, {0: [1, 2, 3], 1: [4, 5]}, {0: 0.2, 1: 0.9}) == {0: 0, 1: 2}
    r = DraftRate()
    assert r.rate() == 0.5
    r.shadow = (3, [7, 8, 9])                   # an unchecked draft of the tokens at 3, 4, 5
    r.score_shadow([0, 1, 2, 7])
    assert r.shadow is not None                 # one right so far
    r.score_shadow([0, 1, 2, 7, 8, 4])
    assert r.shadow is None and r.acc == 0.7 + 2 and r.cut == 0.7 + 1


def test_drafts_stay_within_the_rows_that_keep_single_step_bits():
    """A model whose batches do not give each row a single step's bits (the tiny F32 llama: from 8 rows on) checks
    drafts only in batches that do (speculative.exact_rows, found by trying), so greedy runs keep their tokens; a
    model of the 32-value formats needs no limit."""
    from llampy.llama.api import Llama
    from llampy.llama.speculative import EXACT_PROBE_ROWS, SpecParams, exact_rows
    q8 = Llama(str(SHARED / "fixtures" / "tiny" / "qwen3-Q8_0.gguf"), n_ctx=256)
    assert exact_rows(q8.ctx, 0) is None
    llm = Llama(str(SHARED / "fixtures" / "tiny" / "llama-F32.gguf"), n_ctx=256)
    m = exact_rows(llm.ctx, 0)
    assert m is not None and 1 <= m < EXACT_PROBE_ROWS
    prompt = llm.vocab.tokenize(STORY, add_special=True, parse_special=True)
    greedy = [s.token for s in llm.generate(prompt, 32, llm.make_sampler(temperature=0))]
    llm.set_speculative(SpecParams(types=("ngram-simple",), ngram_size_n=1, ngram_size_m=16, plan=False))
    assert llm._exact_rows == m
    seen = []
    real = llm.ctx.decode
    llm.ctx.decode = lambda b: (seen.append(len(b)), real(b))[1]
    assert [s.token for s in llm.generate(prompt, 32, llm.make_sampler(temperature=0))] == greedy
    assert max(seen[1:]) <= m and llm.spec_stats["drafted"] > 0     # seen[0]: the prompt
