"""Continuous batching: concurrent requests share decode steps and still give each one its own exact output; a
late request starts while others generate; a slot reuses its cached prefix; a client that leaves frees its slot;
32 concurrent streams all complete."""
from __future__ import annotations

import concurrent.futures as cf
import json
import threading
import time

import httpx
import pytest

from .conftest import N_PARALLEL, load_ref, metric, sse_datas, wait_metric

REF = load_ref()


def native(url, prompt_ids, n, **kw):
    r = httpx.post(url + "/completion", timeout=300, json={"prompt": prompt_ids, "n_predict": n, "temperature": 0,
                                                           "return_tokens": True, **kw})
    assert r.status_code == 200, r.text
    return r.json()


def collect(req):
    toks = []
    while True:
        ev = req.events.get(timeout=300)
        assert ev.error is None, ev.error
        if ev.token is not None:
            toks.append(ev.token)
        if ev.finish_reason:
            return toks, ev


def test_batched_greedy_runs_are_llamacpps(llama_server):
    """Four of llama.cpp's greedy references at once in a fresh engine of four slots: prompts and generation
    share every decode step, and each output is still llama.cpp's, token for token. (A fresh engine: in a cache
    where other requests have left holes, new cells land out of position order, and flash attention's F16
    accumulation, as ggml's, then rounds differently.)"""
    from llampy.llama.sampling import Chain
    from llampy.server.slots import Engine, Request
    eng = Engine(llama_server.model, n_parallel=4, n_ctx=1024)
    try:
        refs = REF["greedy"][:4]
        reqs = [eng.submit(Request(tokens=list(g["prompt_ids"]), max_tokens=12,
                                   sampler=Chain.from_params(temperature=0, n_vocab=llama_server.n_vocab)))
                for g in refs]
        outs = [collect(r) for r in reqs]
        for g, (got, last) in zip(refs, outs):
            want = g["ids"][:12]
            # the chat reference ends with the end-of-turn token, which ends generation instead of being returned
            assert got == want[:len(got)] and (len(got) == 12 or eng.vocab.is_eog(want[len(got)])), g["prompt"]
            assert last.finish_reason == ("length" if len(got) == 12 else "stop")
        m = eng.metrics
        assert m["steps_total"] < sum(len(o[0]) for o in outs) and m["busy_slot_steps"] / m["steps_total"] > 3
    finally:
        eng.stop()


def test_concurrent_http_requests_share_steps(server_url):
    steps0 = metric(server_url, "n_decode_total")
    with cf.ThreadPoolExecutor(6) as ex:
        outs = list(ex.map(lambda g: native(server_url, g["prompt_ids"], 6), REF["greedy"] + REF["greedy"][:1]))
    assert all(1 <= o["tokens_predicted"] <= 8 for o in outs)
    # 6 requests on 4 slots: they shared steps (fewer decodes than tokens taken one request at a time)
    assert metric(server_url, "n_decode_total") - steps0 < sum(o["tokens_predicted"] for o in outs)


def test_late_request_starts_while_others_generate(server_url):
    """A request arriving while a long one generates is served beside it: the short one completes while the long
    one is still streaming tokens (it has hundreds to go), and the long one goes on after. The long one is then
    left by its client (its slot freed), so the test does not wait for its 400 tokens on a slow machine."""
    body = {"prompt": "Once upon a time", "n_predict": 400, "temperature": 0, "ignore_eos": True, "stream": True}

    def parts(lines):
        for line in lines:
            if line.startswith("data:"):
                yield json.loads(line[5:])
    with httpx.stream("POST", server_url + "/completion", json=body, timeout=300) as r:
        assert r.status_code == 200
        long = parts(r.iter_lines())
        first = next(long)                  # the long request is generating
        assert not first["stop"]
        out = native(server_url, "The capital of France is", 3)
        assert out["tokens_predicted"] == 3 and out["stop_type"] == "limit"
        # the server's view (the stream may hold tokens sent long ago): the long request is still in its slot
        busy = [s["next_token"] for s in httpx.get(server_url + "/slots").json() if s["is_processing"]]
        mine = [b for b in busy if b["n_decoded"] + b["n_remain"] == 400]
        assert len(mine) == 1 and 0 < mine[0]["n_decoded"] < 400, busy
        after = [next(long) for _ in range(2)]      # and it goes on
    assert not any(p["stop"] for p in after)


def test_slot_reuses_the_common_prefix(server_url):
    prompt = "In a quiet town by the sea there lived an old lighthouse keeper who"
    native(server_url, prompt, 2)
    again = native(server_url, prompt + " loved", 2)
    n_prompt = len(httpx.post(server_url + "/tokenize", json={"content": prompt + " loved"}).json()["tokens"])
    # everything but the new tail came from the slot's cache
    assert again["tokens_cached"] >= n_prompt - 2 and again["tokens_evaluated"] == n_prompt
    assert metric(server_url, "prompt_tokens_cached_total") >= again["tokens_cached"]


def test_erase_slot_forgets_its_cached_prompt(server_url):
    prompt = "A slot to erase: the prompt of this request stays cached after it"
    native(server_url, prompt, 2)
    assert wait_metric(server_url, "requests_processing", 0) == 0
    erased = [httpx.post(f"{server_url}/slots/{i}", params={"action": "erase"}).json() for i in range(N_PARALLEL)]
    assert all(e["id_slot"] == i for i, e in enumerate(erased)) and max(e["n_erased"] for e in erased) > 10
    again = native(server_url, prompt, 2)
    assert again["tokens_cached"] == 0
    for url, params in ((f"{server_url}/slots/{N_PARALLEL}", {"action": "erase"}), (f"{server_url}/slots/0", {})):
        r = httpx.post(url, params=params)
        assert r.status_code == 400 and r.json()["error"]["message"]


def test_engine_builds_decode_graphs_while_idle(llama_server):
    from llampy.server.slots import Engine
    eng = Engine(llama_server.model, n_parallel=3, n_ctx=384)
    try:
        t0 = time.time()
        while eng.graphs_pending() and time.time() - t0 < 60:
            time.sleep(0.05)
        shapes = {key[:3] for key in eng.ctx._graphs}       # (n_tokens, n_outputs, n_kv[, the memory's part])
        assert {(k, k, 384) for k in (1, 2, 3)} <= shapes and (eng.ctx.n_ubatch, 3, 256) in shapes
        # and every graph sits in its allocators' buffers as they are now: none moves at its first step
        plans = [eng.ctx.sched._plans[id(gc.graph)][1] for gc in eng.ctx._graphs.values()]
        assert all(al.buffer is p.buffers[k] for p in plans for k, al in enumerate(p.allocators))
    finally:
        eng.stop()


def test_padded_prompt_pieces_keep_their_bits(llama_server):
    """The server's context pads a micro-batch of short prompt pieces (alone or beside generating slots' tokens) to
    a few sizes, so that new arrivals reuse graphs instead of building their own (Context's pad_ubatch): every
    step's logits are bit for bit the unpadded decode's, also those read through the cells the padding wrote
    again, and fewer graphs are built."""
    from tests.llama.padded_steps import PADDED_SHAPES, assert_same_bits, run_steps
    plain, c0 = run_steps(llama_server.model, False, 512)
    padded, c1 = run_steps(llama_server.model, True, 512)
    assert_same_bits(plain, padded)
    assert {k[:2] for k in c1._graphs} == PADDED_SHAPES
    assert (c0.n_graph_builds, c1.n_graph_builds) == (5, 4)
    # what a server of 4 slots would build while idle: every padded shape up to 4 outputs, these among them
    shapes = c1.pad_shapes(4)
    assert c0.pad_shapes(4) == [] and len(shapes) == len(set(shapes)) == 3 + 7 * 3
    assert {(40, 4), (16, 4), (16, 2)} <= set(shapes) and all(o < t < 64 for t, o in shapes)


def test_disconnect_frees_the_slot(server_url):
    assert wait_metric(server_url, "requests_processing", 0) == 0
    cancelled0 = metric(server_url, "requests_cancelled_total")
    with httpx.stream("POST", server_url + "/v1/completions", timeout=60, json={
            "prompt": "Tell me a very long story.", "max_tokens": 400, "ignore_eos": True, "stream": True}) as r:
        for line in r.iter_lines():
            if line.startswith("data:"):
                # one token arrived: the slot is busy (checked while the stream is still being read: leaving the
                # loop closes httpx's line iterator and with it the connection); now hang up
                assert metric(server_url, "requests_processing") == 1
                break
    # 400 tokens would take far longer than this; the slot must be free again within a few steps
    assert wait_metric(server_url, "requests_processing", 0, timeout=10) == 0
    assert metric(server_url, "requests_cancelled_total") == cancelled0 + 1


@pytest.mark.slow
def test_32_concurrent_streams_all_complete(server_url):
    def one(i):
        kind = "chat" if i % 2 else "completion"
        body = {"max_tokens": 4, "temperature": 0.7, "seed": i, "stream": True,
                "stream_options": {"include_usage": True}}
        if kind == "chat":
            path, body["messages"] = "/v1/chat/completions", [{"role": "system", "content": "Be brief."},
                                                              {"role": "user", "content": f"Say {i}."}]
        else:
            path, body["prompt"] = "/v1/completions", f"Item {i}: the"
        with httpx.stream("POST", server_url + path, timeout=300, json=body) as r:
            assert r.status_code == 200
            datas = sse_datas(r.iter_lines())
        assert datas[-1] == "[DONE]"
        chunks = [json.loads(d) for d in datas[:-1]]
        assert not any("error" in c for c in chunks)
        finals = [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]
                  and c["choices"][0]["finish_reason"]]
        assert len(finals) == 1 and finals[0] in ("length", "stop")
        u = chunks[-1]["usage"]
        assert 1 <= u["completion_tokens"] <= 4 and u["prompt_tokens"] > 0
        key = "delta" if kind == "chat" else None
        return "".join((c["choices"][0]["delta"].get("content") or "") if key else c["choices"][0]["text"]
                       for c in chunks if c["choices"]), u["completion_tokens"]

    done0 = metric(server_url, "requests_finished_total")
    with cf.ThreadPoolExecutor(32) as ex:
        outs = list(ex.map(one, range(32)))
    assert len(outs) == 32 and sum(n for _, n in outs) >= 32
    assert metric(server_url, "requests_finished_total") == done0 + 32
    # the slots were shared: on average more than one busy slot per decoded batch, and none is left busy
    assert metric(server_url, "n_busy_slots_per_decode") > 1
    assert wait_metric(server_url, "requests_processing", 0) == 0
    assert metric(server_url, "requests_deferred") == 0
    assert N_PARALLEL == metric(server_url, "slots_total")


def test_requests_arriving_together_at_an_idle_engine_start_in_one_step(llama_server, monkeypatch):
    """Requests that reach an idle engine a few ms apart (a burst of clients, parsed one after another by the HTTP
    side) are all admitted before its first step: each one's first token comes from that step, not the last
    request's from the step after the first request's."""
    from llampy.llama.sampling import Chain
    from llampy.server import slots
    monkeypatch.setattr(slots, "GATHER_GAP_S", 0.1)     # wide enough for a loaded host's 5 ms sleeps
    monkeypatch.setattr(slots, "GATHER_MAX_S", 1.0)
    eng = slots.Engine(llama_server.model, n_parallel=3, n_ctx=192)
    try:
        t0 = time.time()
        while eng.graphs_pending() and time.time() - t0 < 60:
            time.sleep(0.05)
        reqs = []
        for g in REF["greedy"][:3]:
            reqs.append(eng.submit(slots.Request(tokens=list(g["prompt_ids"]), max_tokens=1,
                                                 sampler=Chain.from_params(temperature=0, n_vocab=eng.vocab.n_tokens))))
            time.sleep(0.005)
        for r in reqs:
            collect(r)
        assert max(r.t_start for r in reqs) < min(r.t_first for r in reqs)
        assert eng.metrics["steps_total"] == 1
    finally:
        eng.stop()
