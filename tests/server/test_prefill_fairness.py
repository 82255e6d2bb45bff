"""Prompt processing shared fairly between requests that arrive together: the chunks of several slots' prompts go
into each step (llama-server fills each step with every prompt's tokens), so every request has its first token
before any of them finishes; short pieces of several sequences share one micro-batch, with the results each gets
alone."""
from __future__ import annotations

import concurrent.futures as cf
import threading
import time

import httpx
import numpy as np
import pytest

from llampy.llama.batch import Batch
from llampy.llama.kv_cache import MIX_BELOW
from llampy.llama.model import Model
from llampy.llama.sampling import Chain, Greedy
from llampy.server.slots import Engine, Request

from .conftest import SHARED, wait_metric

# prompt tokens: two chunks of 64 (each decoded alone) and a tail (decoded beside the others' tails and tokens)
LENGTHS = (150, 140, 130)


def _prompts(n_vocab: int) -> list:
    rng = np.random.default_rng(22)
    return [[int(t) for t in rng.integers(100, n_vocab - 100, size=n)] for n in LENGTHS]


@pytest.fixture(scope="module")
def model():
    return Model(SHARED / "fixtures" / "tiny" / "qwen3-Q8_0.gguf")


def _run(eng, prompts, log=None):
    """The requests submitted at once; returns each one's (tokens, top log-probs). ``log`` gets ("first", i) and
    ("end", i) in the order the engine emitted them."""
    lock = threading.Lock()
    reqs, outs, errors = [], [[] for _ in prompts], []

    def emitter(i):
        def emit(ev):
            with lock:
                if ev.token is not None:
                    if not outs[i] and log is not None:
                        log.append(("first", i))
                    outs[i].append((ev.token, ev.top))
                if ev.finish_reason is not None:
                    if ev.error is not None:        # asserted on the test's thread, not the engine's
                        errors.append(ev.error)
                    if log is not None:
                        log.append(("end", i))
                    done[i].set()
        return emit
    done = [threading.Event() for _ in prompts]
    for i, p in enumerate(prompts):
        reqs.append(Request(tokens=p, max_tokens=3, sampler=Chain([Greedy()]), n_probs=4, ignore_eos=True,
                            cache_prompt=False, emit=emitter(i)))
    for r in reqs:      # one submit after the other: the engine may take the first before the others arrive
        eng.submit(r)
    for d in done:
        assert d.wait(120)
    assert not errors, errors
    return outs


def test_requests_arriving_together_all_start_before_any_finishes(model):
    """Three prompts of 130-150 tokens at once on three slots: with one prompt at a time (a chunk per step, oldest
    first) the first request finished before the second had a token. Each request's tokens and top log-probs are
    the ones it gets alone (its chunks decoded whole, its tail beside the others' pieces: the same bits)."""
    prompts = _prompts(model.hparams.n_vocab)
    eng = Engine(model, n_parallel=3, n_ctx=768)
    try:
        alone = [_run(eng, [p])[0] for p in prompts]
        log: list = []
        together = _run(eng, prompts, log)
    finally:
        eng.stop()
    first_end = next(k for k, (what, _) in enumerate(log) if what == "end")
    assert sorted(i for what, i in log[:first_end] if what == "first") == [0, 1, 2], log
    assert together == alone


def test_short_pieces_share_micro_batches(model):
    """KVCache.split with a stream per sequence: the single tokens and the short pieces of several sequences go
    together while below MIX_BELOW tokens; a sequence's longer piece is alone; each sequence's tokens keep their
    order; the logits are those of each sequence decoded in micro-batches of its own."""
    from llampy.llama.context import Context
    ctx = Context(model, n_ctx=1024, n_batch=512, n_ubatch=80, n_seq_max=8, kv_unified=False)
    rng = np.random.default_rng(5)
    lens = {0: 1, 1: 1, 2: 20, 3: 30, 4: 70, 5: 12, 6: 1}
    b = Batch.empty()
    for s, n in lens.items():
        for j, t in enumerate(rng.integers(100, 40000, size=n)):
            b.add(int(t), j, [s], True)
    seqs = np.array([s[0] for s in b.seq_id])
    groups = ctx.kv.split(b, ctx.n_ubatch)
    assert sorted(np.concatenate(groups).tolist()) == list(range(len(b)))
    assert sorted(sorted(set(seqs[g].tolist())) for g in groups) == [[0, 1, 2, 3, 6], [4], [5]]
    assert all(len(g) < MIX_BELOW for g in groups if len(set(seqs[g].tolist())) > 1)
    for g in groups:
        for s in set(seqs[g].tolist()):
            assert np.all(np.diff(g[seqs[g] == s]) > 0)
    ctx.decode(b)
    mixed = ctx.get_logits().copy()
    apart = []
    for s, n in lens.items():       # each sequence alone, in the same cells (its own stream)
        ctx.seq_rm(s, -1, -1)
        idx = np.flatnonzero(seqs == s)
        ctx.decode(Batch(b.tokens[idx], b.pos[idx], [[s]] * len(idx), b.logits[idx]))
        apart.append(ctx.get_logits().copy())
    order = np.concatenate([np.flatnonzero(seqs == s) for s in lens])
    assert np.array_equal(mixed[order], np.concatenate(apart))


def test_concurrent_http_streams_all_start_before_any_ends(server_url):
    """Four streamed /completion requests of ~200-token prompts on the real server (four slots): every stream's
    first token arrives before any stream's end."""
    wait_metric(server_url, "requests_processing", 0)
    words = ("river stone lantern orchard copper meadow violin harbor thunder pepper glacier saddle "
             "marble falcon willow engine canvas").split()
    events: list = []
    lock = threading.Lock()

    def stream(i):
        prompt = " ".join(words[(i * 7 + 3 * k) % len(words)] + str(k % (i + 3)) for k in range(90))
        body = {"prompt": prompt, "n_predict": 4, "ignore_eos": True, "stream": True, "cache_prompt": False,
                "temperature": 0}
        got = False
        with httpx.stream("POST", server_url + "/completion", json=body, timeout=300) as r:
            assert r.status_code == 200
            for line in r.iter_lines():
                if not line.startswith("data:"):
                    continue
                with lock:
                    if not got:
                        events.append(("first", i, time.perf_counter()))
                        got = True
                    if '"stop":true' in line.replace(" ", ""):
                        events.append(("end", i, time.perf_counter()))
    with cf.ThreadPoolExecutor(4) as ex:
        list(ex.map(stream, range(4)))
    firsts = [t for what, _, t in events if what == "first"]
    ends = [t for what, _, t in events if what == "end"]
    assert len(firsts) == 4 and len(ends) == 4, events
    assert max(firsts) < min(ends), events
