"""Context checkpoints (llama-server's --ctx-checkpoints) on a hybrid model (Qwen3-Next: gated DeltaNet layers and
attention layers): its recurrent state cannot drop a suffix, so a prompt that shares a prefix with a slot's cache
restarts from the newest checkpoint inside that prefix (the recurrent rows restored, the KV cells past it cut) and
decodes only the rest, with the tokens and log-probs of a run from zero."""
from __future__ import annotations

import pytest

from llampy.llama.model import Model
from llampy.llama.sampling import Chain, Greedy
from llampy.server.slots import Engine, Request

from tests.llama.tiny_recurrent import gguf

P = list(range(300, 340))           # 40 tokens
Q = [7, 8, 9, 10, 11, 12, 13, 14, 15, 16]


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    model = Model(gguf("qwen3next-s32-Q8_0", tmp_path_factory))
    eng = Engine(model, n_parallel=1, n_ctx=256, prompt_budget=16, n_ctx_checkpoints=3)
    yield eng
    eng.stop()


def _run(eng, tokens, **kw):
    r = eng.submit(Request(tokens=tokens, max_tokens=4, sampler=Chain([Greedy()]), n_probs=3, **kw))
    evs = []
    while not evs or evs[-1].finish_reason is None:
        evs.append(r.events.get(timeout=300))
    assert evs[-1].error is None, evs[-1].error
    steps = [e for e in evs if e.token is not None]
    return [e.token for e in steps], [e.top for e in steps], evs[-1].timings


def _kept(eng):
    return [c.n_tokens for c in eng.slots[0].checkpoints]


def test_prompt_sharing_a_prefix_restarts_from_a_checkpoint(engine):
    engine.run_job(lambda: engine.erase_slot(0)).result()
    restored = engine.metrics["checkpoints_restored"]
    _, _, t = _run(engine, P)
    assert (t["cache_n"], t["prompt_n"]) == (0, 40)
    assert _kept(engine) == [36, 40]                # 4 tokens before the prompt's end, and at its end
    # the slot holds P and 3 generated tokens: the state cannot be cut back to 40, the checkpoint at 40 can
    toks, tops, t = _run(engine, P + Q)
    assert (t["cache_n"], t["prompt_n"]) == (40, 10)
    assert _kept(engine) == [40, 46, 50]            # at most 3: the oldest went
    # diverging 2 tokens before the end of that prompt: back to its checkpoint 4 tokens before the end
    _, _, t = _run(engine, P + Q[:8] + [20, 21, 22])
    assert (t["cache_n"], t["prompt_n"]) == (46, 5)
    assert engine.metrics["checkpoints_restored"] == restored + 2
    # the same prompt from zero (cache_prompt off): the same tokens and top log-probs, bit for bit
    toks0, tops0, t = _run(engine, P + Q, cache_prompt=False)
    assert (t["cache_n"], t["prompt_n"]) == (0, 50)
    assert toks == toks0 and tops == tops0
    # nothing in common: no checkpoint fits, the prompt is decoded whole
    _, _, t = _run(engine, [5] + P)
    assert (t["cache_n"], t["prompt_n"]) == (0, 41)


def test_a_failure_while_admitting_ends_the_request(engine, monkeypatch):
    # before a request has its slot, an exception used to leave it without any event (its client waited forever)
    real, calls = engine.ctx.seq_rm, []

    def seq_rm(*a):
        calls.append(a)
        if len(calls) == 1:
            raise RuntimeError("seq_rm broke")
        return real(*a)
    monkeypatch.setattr(engine.ctx, "seq_rm", seq_rm)
    r = engine.submit(Request(tokens=P, max_tokens=2, sampler=Chain([Greedy()])))
    ev = r.events.get(timeout=60)
    assert ev.finish_reason == "error" and "seq_rm broke" in ev.error
    assert engine.slots[0].req is None and engine.slots[0].cached == []
    monkeypatch.undo()
    _, _, t = _run(engine, P)                       # the slot serves the next request, from zero
    assert (t["cache_n"], t["prompt_n"]) == (0, 40)
