"""Request fields a route does not honour are a 400 naming the field, as OpenAI answers them ("Unrecognized request
argument supplied: <field>"), never silently ignored; the fields llama-server itself refuses (best_of, suffix on a
model without FIM tokens, top_logprobs without logprobs, logprobs with tools on a stream, a string enable_thinking) are 400s too. Fields
that are honoured pass; reasoning_effort is read as llama-server reads it."""
from __future__ import annotations

import httpx
import openai
import pytest

from llampy.server.oai import SCHEMAS

pytestmark = pytest.mark.slow

ASK = [{"role": "user", "content": "Hi"}]
TOOLS = [{"type": "function", "function": {"name": "add", "parameters": {
    "type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}}}]
ROUTES = {"/v1/chat/completions": {"messages": ASK, "max_tokens": 1},
          "/v1/completions": {"prompt": "Hi", "max_tokens": 1},
          "/completion": {"prompt": "Hi", "n_predict": 1},
          "/v1/embeddings": {"input": "Hi"},
          "/tokenize": {"content": "Hi"},
          "/detokenize": {"tokens": [1]}}


def post(url, path, body):
    return httpx.post(url + path, json=body, timeout=60)


def _error(r, param):
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and err["type"] == "invalid_request_error", err
    return err["message"]


@pytest.mark.parametrize("path", sorted(ROUTES))
def test_unknown_field_is_400_naming_it(server_url, path):
    assert post(server_url, path, ROUTES[path]).status_code == 200
    msg = _error(post(server_url, path, {**ROUTES[path], "frobnicate": 1}), "frobnicate")
    assert msg == "Unrecognized request argument supplied: frobnicate"


@pytest.mark.parametrize("path, field, value, says", [
    ("/v1/completions", "best_of", 2, "one completion per request"),
    ("/v1/chat/completions", "functions", [{"name": "f"}], "use 'tools'"),
    ("/v1/chat/completions", "adaptive_target", 0.5, ""),  # a llama.cpp sampler this server does not run
    ("/v1/embeddings", "dimensions", 64, ""),
])
def test_fields_llama_server_or_openai_know_but_not_honoured(server_url, path, field, value, says):
    msg = _error(post(server_url, path, {**ROUTES[path], field: value}), field)
    assert msg.startswith(f"Unrecognized request argument supplied: {field}") and says in msg


@pytest.mark.parametrize("path, extra, param", [
    ("/v1/completions", {"suffix": "x"}, "suffix"),       # SmolLM2 has no FIM tokens
    ("/v1/chat/completions", {"top_logprobs": 2}, "top_logprobs"),
    ("/v1/chat/completions", {"logprobs": True, "stream": True, "tools": TOOLS}, "logprobs"),
    ("/v1/chat/completions", {"chat_template_kwargs": {"enable_thinking": "false"}}, "chat_template_kwargs"),
    ("/v1/chat/completions", {"reasoning_effort": 3}, "reasoning_effort"),
    ("/completion", {"cache_prompt": 0}, "cache_prompt"),
    ("/completion", {"samplers": ["top_k", "infill"]}, "samplers"),
])
def test_refused_values_name_the_field(server_url, path, extra, param):
    _error(post(server_url, path, {**ROUTES[path], **extra}), param)


def test_honoured_fields_pass(server_url):
    for path, extra in [("/v1/chat/completions", {"logprobs": True, "top_logprobs": 2, "user": "u1", "n": 1,
                                                  "reasoning_effort": "none", "reasoning_format": "none",
                                                  "max_completion_tokens": 1, "stream_options": None}),
                        ("/v1/completions", {"echo": True, "user": "u1", "ignore_eos": True, "min_p": 0.1,
                                             "n": 2, "mirostat": 2}),
                        ("/completion", {"cache_prompt": False, "n_probs": 2, "return_tokens": True, "lora": [],
                                         "typical_p": 0.5, "samplers": "kt"}),
                        ("/v1/embeddings", {"encoding_format": "base64", "user": "u1"}),
                        ("/tokenize", {"add_special": True, "parse_special": False, "with_pieces": True})]:
        r = post(server_url, path, {**ROUTES[path], **extra})
        assert r.status_code == 200, (path, r.text)
    for route, schema in SCHEMAS.items():        # what /openapi.json documents is what the check accepts
        assert schema["type"] == "object" and set(schema.get("required", [])) <= set(schema["properties"]), route


def test_openai_client_extra_body_is_refused(server_url):
    client = openai.OpenAI(base_url=server_url + "/v1", api_key="none", max_retries=0)
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="default", messages=ASK, max_tokens=1, extra_body={"foo": 1})
    assert e.value.body["param"] == "foo"
    r = client.chat.completions.create(model="default", messages=ASK, max_tokens=1,
                                       extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    assert r.choices[0].finish_reason == "length"
