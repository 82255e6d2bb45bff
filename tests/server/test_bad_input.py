"""Bad input over raw HTTP: a 4xx with an OpenAI-style error body, never a 500, and the server keeps serving."""
from __future__ import annotations

import json

import httpx
import pytest

MSG = [{"role": "user", "content": "x"}]


def chat(**kw) -> bytes:
    return json.dumps({"messages": MSG, **kw}).encode()


CASES = [
    ("/v1/chat/completions", b"{not json", 400, None),
    ("/v1/chat/completions", b"\xff\xfe", 400, None),
    ("/v1/chat/completions", b"[1, 2]", 400, None),
    ("/v1/chat/completions", b"", 400, None),
    ("/v1/chat/completions", json.dumps({"max_tokens": 4}).encode(), 400, "messages"),
    ("/v1/chat/completions", json.dumps({"messages": "hi"}).encode(), 400, "messages"),
    ("/v1/chat/completions", json.dumps({"messages": []}).encode(), 400, "messages"),
    ("/v1/chat/completions", json.dumps({"messages": [{"content": "no role"}]}).encode(), 400, "messages[0]"),
    ("/v1/chat/completions", json.dumps({"messages": [{"role": "user", "content": 5}]}).encode(), 400,
     "messages[0].content"),
    ("/v1/chat/completions", json.dumps({"messages": [{"role": "wizard", "content": "x"}]}).encode(), 400,
     "messages[0].role"),
    ("/v1/chat/completions", chat(max_tokens=0), 400, "max_tokens"),
    ("/v1/chat/completions", chat(max_tokens=-5), 400, "max_tokens"),
    ("/v1/chat/completions", chat(max_tokens="10"), 400, "max_tokens"),
    ("/v1/chat/completions", chat(max_tokens=2.5), 400, "max_tokens"),
    ("/v1/chat/completions", chat(temperature="hot"), 400, "temperature"),
    ("/v1/chat/completions", chat(temperature=-1), 400, "temperature"),
    ("/v1/chat/completions", chat(top_p=3), 400, "top_p"),
    ("/v1/chat/completions", chat(top_k=1.5), 400, "top_k"),
    ("/v1/chat/completions", chat(seed="x"), 400, "seed"),
    ("/v1/chat/completions", chat(stop=5), 400, "stop"),
    ("/v1/chat/completions", chat(stop=[""]), 400, "stop"),
    ("/v1/chat/completions", chat(logit_bias=[1]), 400, "logit_bias"),
    ("/v1/chat/completions", chat(logit_bias={"abc": "x"}), 400, "logit_bias"),
    ("/v1/chat/completions", chat(logit_bias=[[1, 2, 3]]), 400, "logit_bias"),
    ("/v1/chat/completions", chat(logit_bias={"99999999": 1}), 400, "logit_bias"),
    ("/v1/chat/completions", chat(stream="yes"), 400, "stream"),
    ("/v1/chat/completions", chat(stream=True, stream_options="usage"), 400, "stream_options"),
    ("/v1/chat/completions", chat(logprobs=True, top_logprobs=50), 400, "top_logprobs"),
    ("/v1/chat/completions", chat(n=65), 400, "n"),
    ("/v1/chat/completions", chat(n=0), 400, "n"),
    ("/v1/chat/completions", chat(presence_penalty=9), 400, "presence_penalty"),
    ("/v1/chat/completions", chat(model=7), 400, "model"),
    ("/v1/chat/completions", chat(model="gpt-9"), 404, "model"),
    ("/v1/chat/completions", chat(messages=[{"role": "user", "content": "word " * 600}]), 400, "messages"),
    ("/v1/completions", json.dumps({"prompt": "word " * 600}).encode(), 400, "prompt"),
    ("/v1/completions", json.dumps({"prompt": 5}).encode(), 400, "prompt"),
    ("/v1/completions", json.dumps({"prompt": ["a", 5]}).encode(), 400, "prompt"),
    ("/v1/completions", json.dumps({"prompt": []}).encode(), 400, "prompt"),
    ("/v1/completions", json.dumps({"prompt": ["a", "b"], "n": 40}).encode(), 400, "n"),
    ("/v1/completions", json.dumps({"prompt": "a", "n": 0}).encode(), 400, "n"),
    ("/v1/completions", json.dumps({"prompt": [1, 10 ** 9]}).encode(), 400, "prompt"),
    ("/v1/completions", json.dumps({"prompt": ""}).encode(), 400, "prompt"),
    ("/v1/completions", json.dumps({"max_tokens": 3}).encode(), 400, "prompt"),
    ("/v1/completions", json.dumps({"prompt": "x", "logprobs": True}).encode(), 400, "logprobs"),
    ("/v1/completions", json.dumps({"prompt": "x", "model": "nope"}).encode(), 404, "model"),
    ("/v1/embeddings", json.dumps({"input": []}).encode(), 400, "input"),
    ("/v1/embeddings", json.dumps({"input": [1, 2]}).encode(), 400, "input"),
    ("/v1/embeddings", json.dumps({"input": ""}).encode(), 400, "input"),
    ("/completion", json.dumps({"prompt": "x", "n_probs": -1}).encode(), 400, "n_probs"),
    ("/completion", json.dumps({"prompt": "x", "n_predict": 0}).encode(), 400, "n_predict"),
    ("/tokenize", json.dumps({"content": 3}).encode(), 400, "content"),
    ("/detokenize", json.dumps({"tokens": [1, -1]}).encode(), 400, "tokens"),
    ("/detokenize", json.dumps({"tokens": "12"}).encode(), 400, "tokens"),
]


@pytest.mark.parametrize("path,body,status,param", CASES)
def test_bad_input_is_4xx_with_openai_error(server_url, path, body, status, param):
    r = httpx.post(server_url + path, content=body, headers={"content-type": "application/json"}, timeout=30)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["message"] and err["type"] and err["param"] == param


def test_unknown_route_and_method(server_url):
    r = httpx.get(server_url + "/v1/nothing")
    assert r.status_code == 404 and r.json()["error"]["message"]
    r = httpx.get(server_url + "/v1/chat/completions")
    assert r.status_code == 405 and r.json()["error"]["message"]


def test_oversized_bodies(server_url):
    r = httpx.post(server_url + "/v1/completions", content=b"x" * (5 << 20), timeout=30)
    assert r.status_code == 413 and "larger" in r.json()["error"]["message"]

    def chunks():       # no content-length: the server must stop reading by itself
        for _ in range(80):
            yield b"y" * (64 << 10)
    r = httpx.post(server_url + "/v1/completions", content=chunks(), timeout=30)
    assert r.status_code == 413 and r.json()["error"]["type"] == "invalid_request_error"


def test_still_serving_after_bad_input(server_url):
    for path, body, *_ in CASES[:8]:
        httpx.post(server_url + path, content=body, timeout=30)
    r = httpx.post(server_url + "/v1/completions", json={"prompt": "Hello", "max_tokens": 2, "temperature": 0},
                   timeout=60)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2
    assert httpx.get(server_url + "/health").json()["slots_processing"] == 0
