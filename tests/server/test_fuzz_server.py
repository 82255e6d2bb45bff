"""A bounded fuzz of the server's routes: valid requests with fields replaced by other types, extremes, deep
nesting, long or odd strings, unknown fields and missing ones, plus raw bodies that are barely JSON. Every answer
is a 2xx or a 4xx with an OpenAI-style error body, never a 5xx, and the server is healthy afterwards. A fast run of
a few hundred requests; a longer one is marked slow."""
from __future__ import annotations

import json
import random

import httpx
import pytest

from .conftest import wait_metric

MSGS = [{"role": "user", "content": "Hi"}]
VALID = {
    "/v1/chat/completions": {"messages": MSGS, "max_tokens": 2, "temperature": 0},
    "/v1/completions": {"prompt": "Hello", "max_tokens": 2},
    "/completion": {"prompt": "Hello", "n_predict": 2},
    "/v1/embeddings": {"input": ["Hello", "world"]},
    "/tokenize": {"content": "Hello world", "with_pieces": True},
    "/detokenize": {"tokens": [19556, 905]},
}
LIMIT = {"/v1/chat/completions": "max_tokens", "/v1/completions": "max_tokens", "/completion": "n_predict"}
# fields whose valid values make work: kept small when a mutation leaves them valid
COUNTS = {"max_tokens", "n_predict", "n", "n_probs", "top_logprobs", "logprobs", "best_of"}
ODD_STRINGS = ["", " ", "\x00", "\u2028", "<|im_start|>", "<|im_end|>" * 50, "é" * 1000, "🦙" * 200,
               "\ud83d\ude00", "x" * 20000, "{{ 1 }}", "\\u0000", "null"]
SCALARS = [None, True, False, 0, -1, 1, 2**31, -2**63, 2**64, 1.5, -0.0, 1e308, "", "0", "abc", [], {}, [[]],
           {"a": {"b": {}}}]


def deep(rng: random.Random, n: int):
    v = 0
    for _ in range(n):
        v = [v] if rng.random() < 0.5 else {"k": v}
    return v


def mutate_value(rng: random.Random, key: str | None, v):
    r = rng.random()
    if key in COUNTS:       # never a large valid count: a slot's whole context takes minutes on a busy machine
        return rng.choice([0, -1, -5, 1, 3, 2.5, "2", None, True, [2], 2**64, -2**63, "x" * 100])
    if r < 0.35:
        return rng.choice(SCALARS)
    if r < 0.5:
        return rng.choice(ODD_STRINGS)
    if r < 0.6:
        return deep(rng, rng.choice([5, 30, 90]))
    if isinstance(v, list) and v and r < 0.8:
        i = rng.randrange(len(v))
        return v[:i] + [mutate_value(rng, None, v[i])] + v[i + 1:]
    if isinstance(v, dict) and v and r < 0.9:
        k = rng.choice(list(v))
        return {**v, k: mutate_value(rng, k, v[k])}
    return [v] * rng.choice([0, 2, 5])


def mutated_body(rng: random.Random, path: str) -> bytes:
    body = json.loads(json.dumps(VALID[path]))
    for _ in range(rng.choice([1, 1, 2, 3])):
        op = rng.random()
        if not isinstance(body, dict):
            break
        if op < 0.6 and body:
            k = rng.choice(list(body))
            body[k] = mutate_value(rng, k, body[k])
        elif op < 0.75 and body:
            del body[rng.choice(list(body))]
        elif op < 0.9:
            k = rng.choice(["model", "stream", "stop", "seed", "logit_bias", "grammar", "json_schema",
                            "response_format", "tools", "tool_choice", "top_k", "top_p", "min_p", "samplers",
                            "cache_prompt", "id_slot", "suffix", "echo", "user", "zzz_unknown"])
            body[k] = mutate_value(rng, k, rng.choice(SCALARS + ODD_STRINGS))
        else:
            body = mutate_value(rng, None, body)
    if isinstance(body, dict) and path in LIMIT and LIMIT[path] not in body:
        body[LIMIT[path]] = 2       # a valid request without a limit generates a slot's whole context: minutes
    raw = json.dumps(body).encode()
    r = rng.random()
    if r < 0.05:
        raw = raw[:rng.randrange(len(raw) + 1)]                 # cut short
    elif r < 0.08:
        raw = bytes(rng.randrange(256) for _ in range(rng.randrange(1, 64)))
    elif r < 0.1:
        raw = raw.replace(b"2", b"NaN", 1)
    return raw


def run_fuzz(url: str, n: int, seed: int) -> dict:
    rng = random.Random(seed)
    seen: dict[int, int] = {}
    with httpx.Client(timeout=120) as c:
        for i in range(n):
            path = rng.choice(list(VALID))
            raw = mutated_body(rng, path)
            streaming = b'"stream": true' in raw
            r = c.post(url + path, content=raw, headers={"content-type": "application/json"})
            seen[r.status_code] = seen.get(r.status_code, 0) + 1
            assert r.status_code < 500, (path, raw[:300], r.status_code, r.text[:300])
            if r.status_code >= 400:
                err = r.json()["error"]
                assert err["message"] and err["type"], (path, raw[:300], r.text[:300])
            elif not streaming:
                r.json()
    return seen


def test_fuzzed_requests_are_never_a_5xx(server_url):
    seen = run_fuzz(server_url, 120, seed=22)
    assert seen.get(200, 0) > 5 and sum(v for k, v in seen.items() if 400 <= k < 500) > 40, seen
    assert wait_metric(server_url, "requests_processing", 0) == 0
    assert httpx.get(server_url + "/health").json()["status"] == "ok"


@pytest.mark.slow
def test_fuzzed_requests_longer_run(server_url):
    seen = run_fuzz(server_url, 1500, seed=2022)
    assert seen.get(200, 0) > 50, seen
    assert wait_metric(server_url, "requests_processing", 0) == 0
    assert httpx.get(server_url + "/health").json()["status"] == "ok"
