"""The server with the official openai client, raw HTTP for bad input, and a bounded concurrent load."""
from __future__ import annotations

import concurrent.futures as cf
import json

import httpx
import openai
import pytest

from tests.paths import LLAMACPP

REF = json.loads((LLAMACPP / "smollm2-135m-q4_1.json").read_text())


@pytest.fixture(scope="module")
def client(server_url):
    return openai.OpenAI(base_url=server_url + "/v1", api_key="none")


def test_completion_is_llamacpps_greedy(client):
    g = REF["greedy"][0]
    r = client.completions.create(model="default", prompt=g["prompt"], max_tokens=6, temperature=0, logprobs=2)
    assert r.usage.prompt_tokens == 5 and r.usage.completion_tokens == 6
    assert r.choices[0].finish_reason == "length"
    assert r.choices[0].logprobs.tokens and len(r.choices[0].logprobs.token_logprobs) == 6
    assert r.choices[0].text.startswith(" Paris")


def test_chat_streaming_and_usage(client):
    msgs = [{"role": "user", "content": "Name three primary colors."}]
    full = client.chat.completions.create(model="default", messages=msgs, max_tokens=10, temperature=0)
    assert full.choices[0].message.role == "assistant" and full.usage.completion_tokens > 0
    stream = client.chat.completions.create(model="default", messages=msgs, max_tokens=10, temperature=0,
                                            stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == full.choices[0].message.content
    assert chunks[-1].usage.total_tokens == full.usage.total_tokens


def test_chat_logprobs_stop_and_embeddings(client):
    r = client.chat.completions.create(model="default", messages=[{"role": "user", "content": "Count: 1, 2, 3,"}],
                                       max_tokens=8, temperature=0, logprobs=True, top_logprobs=3)
    lp = r.choices[0].logprobs.content
    assert lp and len(lp[0].top_logprobs) == 3
    s = client.completions.create(model="default", prompt="The capital of France is", max_tokens=12, temperature=0,
                                  stop=["."])
    assert s.choices[0].finish_reason == "stop" and "." not in s.choices[0].text
    e = client.embeddings.create(model="default", input=["hello", "world"])
    assert len(e.data) == 2 and len(e.data[0].embedding) == 576


def test_native_routes(server_url):
    r = httpx.post(server_url + "/completion", json={"prompt": "The capital of France is", "n_predict": 4,
                                                     "temperature": 0, "n_probs": 2, "return_tokens": True}, timeout=60)
    out = r.json()
    assert r.status_code == 200 and out["tokens"] == REF["greedy"][0]["ids"][:4]
    assert len(out["completion_probabilities"][0]["top_logprobs"]) == 2
    t = httpx.post(server_url + "/tokenize", json={"content": "Hello world"}).json()
    assert t["tokens"] == [19556, 905]
    assert httpx.post(server_url + "/detokenize", json={"tokens": t["tokens"]}).json()["content"] == "Hello world"
    assert httpx.get(server_url + "/v1/models").json()["data"][0]["id"]
    m = httpx.get(server_url + "/metrics").text
    assert "llampy_requests_total" in m and "llampy_kv_cache_tokens" in m
    assert "/v1/chat/completions" in httpx.get(server_url + "/openapi.json").text
    assert "<form" in httpx.get(server_url + "/").text


@pytest.mark.parametrize("path,body,status,param", [
    ("/v1/chat/completions", b"{not json", 400, None),
    ("/v1/chat/completions", b"[1, 2]", 400, None),
    ("/v1/chat/completions", json.dumps({"max_tokens": 4}).encode(), 400, "messages"),
    ("/v1/chat/completions", json.dumps({"messages": "hi"}).encode(), 400, "messages"),
    ("/v1/chat/completions", json.dumps({"messages": [{"role": "user", "content": "x"}], "max_tokens": 0}).encode(),
     400, "max_tokens"),
    ("/v1/chat/completions", json.dumps({"messages": [{"role": "user", "content": "x"}], "temperature": "hot"}).encode(),
     400, "temperature"),
    ("/v1/chat/completions", json.dumps({"model": "gpt-9", "messages": [{"role": "user", "content": "x"}]}).encode(),
     404, "model"),
    ("/v1/completions", json.dumps({"prompt": "word " * 600}).encode(), 400, "prompt"),
    ("/v1/completions", json.dumps({"prompt": 5}).encode(), 400, "prompt"),
    ("/v1/embeddings", json.dumps({"input": []}).encode(), 400, "input"),
    ("/tokenize", json.dumps({"content": 3}).encode(), 400, "content"),
])
def test_bad_input_is_4xx_with_openai_error(server_url, path, body, status, param):
    r = httpx.post(server_url + path, content=body, headers={"content-type": "application/json"}, timeout=30)
    assert r.status_code == status
    err = r.json()["error"]
    assert err["message"] and err["type"] and err["param"] == param


def test_oversized_body(server_url):
    r = httpx.post(server_url + "/v1/completions", content=b"x" * (5 << 20), timeout=30)
    assert r.status_code == 413 and "larger" in r.json()["error"]["message"]


def test_32_concurrent_streams_all_complete(server_url):
    def one(i):
        with httpx.stream("POST", server_url + "/v1/completions", timeout=300,
                          json={"prompt": f"Item {i}: the", "max_tokens": 4, "temperature": 0.7, "seed": i,
                                "stream": True}) as r:
            assert r.status_code == 200
            datas = [l[5:].strip() for l in r.iter_lines() if l.startswith("data:")]
        assert datas[-1] == "[DONE]"
        chunks = [json.loads(d) for d in datas[:-1]]
        assert chunks[-1]["choices"][0]["finish_reason"] in ("length", "stop")
        return "".join(c["choices"][0]["text"] for c in chunks)

    with cf.ThreadPoolExecutor(32) as ex:
        outs = list(ex.map(one, range(32)))
    assert len(outs) == 32
    # after the storm, the server still answers and no slot is stuck
    m = httpx.get(server_url + "/metrics").text
    assert "llampy_requests_processing 0" in m
