"""The server through the official openai client: completions, chat, streaming, logprobs, embeddings, models;
and llama.cpp's native routes through raw HTTP."""
from __future__ import annotations

import json
import math
import time

import httpx
import numpy as np
import openai
import pytest

from .conftest import N_PARALLEL, load_ref, sse_datas

REF = load_ref()


@pytest.fixture(scope="module")
def client(server_url):
    return openai.OpenAI(base_url=server_url + "/v1", api_key="none", max_retries=0)


def erase_all_slots(url: str) -> None:
    """A fresh cache, as llama.cpp's reference run had: where earlier requests left cached prompts, new cells can
    land below a slot's older ones, and flash attention's F16 accumulation (ggml's) then rounds differently."""
    for sid in range(N_PARALLEL):
        for _ in range(100):
            r = httpx.post(f"{url}/slots/{sid}", params={"action": "erase"}, timeout=30)
            if r.status_code == 200:
                break
            assert "processing" in r.json()["error"]["message"], r.text
            time.sleep(0.1)        # a request of an earlier test still finishing
        else:
            raise AssertionError(f"slot {sid} stayed busy")


def test_completion_is_llamacpps_greedy_with_its_logprobs(client, server_url):
    erase_all_slots(server_url)
    g = REF["greedy"][0]
    r = client.completions.create(model="default", prompt=g["prompt"], max_tokens=6, temperature=0, logprobs=3)
    c = r.choices[0]
    assert r.usage.prompt_tokens == len(g["prompt_ids"]) and r.usage.completion_tokens == 6
    assert c.finish_reason == "length"
    assert c.text == g["text"][:len(c.text)] and c.text.startswith(" Paris")
    lp = c.logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 6
    assert "".join(lp.tokens) == c.text and lp.text_offset[0] == 0 and lp.text_offset[1] == len(lp.tokens[0])
    for step, got, top in zip(g["steps"], lp.token_logprobs, lp.top_logprobs):
        assert got == pytest.approx(step["logprob"], abs=1e-3)      # llama.cpp's own log-probabilities
        assert len(top) == 3 and max(top.values()) == pytest.approx(step["top"][0][1], abs=1e-3)


def test_chat_stream_equals_non_stream_and_reports_usage(client):
    msgs = [{"role": "user", "content": "Name three primary colors."}]
    full = client.chat.completions.create(model="default", messages=msgs, max_tokens=12, temperature=0)
    m = full.choices[0].message
    assert m.role == "assistant" and m.content and full.usage.completion_tokens > 0
    assert full.usage.total_tokens == full.usage.prompt_tokens + full.usage.completion_tokens
    stream = client.chat.completions.create(model="default", messages=msgs, max_tokens=12, temperature=0,
                                            stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    pieces = [c.choices[0].delta.content for c in chunks if c.choices and c.choices[0].delta.content]
    assert len(pieces) > 1 and "".join(pieces) == m.content
    assert chunks[0].choices[0].delta.role == "assistant"
    finals = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finals == [full.choices[0].finish_reason]
    assert chunks[-1].choices == [] and chunks[-1].usage.total_tokens == full.usage.total_tokens


def test_chat_logprobs_in_openais_shape(client):
    r = client.chat.completions.create(model="default", messages=[{"role": "user", "content": "Count: 1, 2, 3,"}],
                                       max_tokens=5, temperature=0, logprobs=True, top_logprobs=3)
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens
    for t in content:
        assert len(t.top_logprobs) == 3 and t.logprob <= 0
        assert bytes(t.bytes).decode("utf-8", "replace") == t.token
        # greedy: the chosen token is the most likely one
        assert t.logprob == pytest.approx(t.top_logprobs[0].logprob)
        assert sum(math.exp(x.logprob) for x in t.top_logprobs) <= 1 + 1e-6


def test_stop_strings_penalties_bias_and_seed(client):
    s = client.completions.create(model="default", prompt="The capital of France is", max_tokens=16,
                                  temperature=0, stop=["."])
    assert s.choices[0].finish_reason == "stop" and "." not in s.choices[0].text and s.choices[0].text
    # a large bias forces a token; a ban (-100) removes Paris from the greedy answer
    paris = httpx.post(str(client.base_url).replace("/v1/", "/tokenize"), json={"content": " Paris"}).json()["tokens"]
    b = client.completions.create(model="default", prompt="The capital of France is", max_tokens=3, temperature=0,
                                  logit_bias={str(paris[0]): -100})
    assert "Paris" not in b.choices[0].text
    same = [client.completions.create(model="default", prompt="Once upon a time", max_tokens=8, temperature=1.0,
                                      seed=7, presence_penalty=0.5, frequency_penalty=0.5).choices[0].text
            for _ in range(2)]
    assert same[0] == same[1] and same[0]


def test_embeddings(client):
    e = client.embeddings.create(model="default", input=["hello world", "hello world", "the stock market fell"])
    v = np.array([d.embedding for d in e.data])
    assert v.shape == (3, 576) and e.usage.prompt_tokens > 0
    assert np.allclose(np.linalg.norm(v, axis=1), 1, atol=1e-6)
    assert v[0] @ v[1] == pytest.approx(1, abs=1e-6) and v[0] @ v[2] < 0.99
    # the client asks for base64 by default; plain floats must agree
    f = client.embeddings.create(model="default", input="hello world", encoding_format="float")
    assert np.allclose(f.data[0].embedding, v[0], atol=1e-6)


def test_models(client):
    ms = client.models.list().data
    assert len(ms) == 1 and ms[0].id and ms[0].owned_by == "llampy"


def test_native_completion_with_n_probs_and_tokens(server_url):
    g = REF["greedy"][0]
    r = httpx.post(server_url + "/completion", timeout=60, json={
        "prompt": g["prompt"], "n_predict": 4, "temperature": 0, "n_probs": 2, "return_tokens": True})
    out = r.json()
    assert r.status_code == 200 and out["tokens"] == g["ids"][:4] and out["tokens_predicted"] == 4
    assert out["stop"] is True and out["stop_type"] == "limit"
    probs = out["completion_probabilities"]
    assert [p["id"] for p in probs] == g["ids"][:4]
    assert [t["id"] for t in probs[0]["top_logprobs"]] == [t[0] for t in g["steps"][0]["top"][:2]]
    # the same, streamed: one event per token, the last one with the totals
    with httpx.stream("POST", server_url + "/completion", timeout=60, json={
            "prompt": g["prompt"], "n_predict": 4, "temperature": 0, "stream": True, "return_tokens": True}) as s:
        evs = [json.loads(d) for d in sse_datas(s.iter_lines())]
    assert [t for e in evs[:-1] for t in e["tokens"]] == g["ids"][:4] and evs[-1]["stop"] is True
    assert "".join(e["content"] for e in evs) == out["content"]


def test_tokenize_detokenize_as_llamacpp(server_url):
    for case in REF["tokenize"]:
        t = httpx.post(server_url + "/tokenize", json={"content": case["text"],
                                                       "parse_special": case["parse_special"]}).json()
        assert t["tokens"] == case["ids"], case["text"]
    p = httpx.post(server_url + "/tokenize", json={"content": "Hello world", "with_pieces": True}).json()
    assert [x["piece"] for x in p["tokens"]] == ["Hello", " world"]
    assert httpx.post(server_url + "/detokenize", json={"tokens": [19556, 905]}).json()["content"] == "Hello world"


def test_health_metrics_openapi_and_page(server_url):
    h = httpx.get(server_url + "/health").json()
    assert h["status"] == "ok"
    m = httpx.get(server_url + "/metrics")
    assert m.headers["content-type"].startswith("text/plain")
    for name in ("requests_total", "prompt_tokens_total", "tokens_predicted_total", "predicted_tokens_seconds",
                 "requests_deferred", "requests_processing", "kv_cache_tokens", "kv_cache_usage_ratio"):
        assert f"# TYPE llampy_{name} " in m.text and f"\nllampy_{name} " in m.text
    spec = httpx.get(server_url + "/openapi.json").json()
    for path in ("/v1/chat/completions", "/v1/completions", "/v1/embeddings", "/v1/models", "/completion",
                 "/tokenize", "/detokenize", "/health", "/metrics"):
        assert path in spec["paths"]
    body = spec["paths"]["/v1/chat/completions"]["post"]["requestBody"]["content"]["application/json"]["schema"]
    assert "messages" in body["required"]
    page = httpx.get(server_url + "/")
    assert page.status_code == 200 and "<form" in page.text and "/static/app.js" in page.text
    assert httpx.get(server_url + "/static/app.js").status_code == 200
    assert httpx.get(server_url + "/static/..%2Fapp.py").status_code == 404
