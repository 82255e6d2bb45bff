"""Structured output through the server: llama.cpp's grammar/json_schema fields, OpenAI's response_format, and
tools/tool_choice through the official openai client, streamed and not; what cannot be compiled is a 400 naming the
field. Replies are sampled at temperature 1 with several seeds and checked by checkers independent of llguidance
(tests/llama/grammar_corpus.py)."""
from __future__ import annotations

import concurrent.futures as cf
import json

import httpx
import openai
import pytest

from tests.llama.grammar_corpus import BAD_GBNF, BAD_SCHEMAS, GBNF, SCHEMA_PROMPT, SCHEMAS, check_schema

from .conftest import sse_datas

pytestmark = pytest.mark.slow

TOOLS = [
    {"type": "function", "function": {
        "name": "get_weather", "description": "The current weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                                        "unit": {"enum": ["celsius", "fahrenheit"]}},
                       "required": ["city", "unit"], "additionalProperties": False}}},
    {"type": "function", "function": {
        "name": "add", "description": "Add two integers",
        "parameters": {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
                       "required": ["a", "b"], "additionalProperties": False}}},
]
TOOL_SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def client(server_url):
    return openai.OpenAI(base_url=server_url + "/v1", api_key="none", max_retries=0)


def chat_prompt(text: str) -> str:
    return f"<|im_start|>user\n{text}<|im_end|>\n<|im_start|>assistant\n"


# ------------------------------------------------------------------------------------------------ grammars
@pytest.mark.parametrize("name", ["arithmetic", "chess", "non_ascii", "json_like"])
def test_native_completion_grammar(server_url, name):
    src, prompt, check = GBNF[name]
    for seed in (0, 1):
        r = httpx.post(server_url + "/completion", json={"prompt": chat_prompt(prompt), "grammar": src,
                                                         "n_predict": 64, "temperature": 1.0, "seed": seed},
                       timeout=120)
        assert r.status_code == 200, r.text
        out = r.json()
        assert out["stop_type"] == "eos" and check(out["content"]), (seed, out["content"])


def test_native_completion_json_schema_streamed(server_url):
    schema = SCHEMAS["pattern"]
    with httpx.stream("POST", server_url + "/completion", timeout=120,
                      json={"prompt": chat_prompt(SCHEMA_PROMPT), "json_schema": schema, "n_predict": 64,
                            "temperature": 1.0, "seed": 4, "stream": True}) as r:
        parts = [json.loads(d) for d in sse_datas(r.iter_lines())]
    text = "".join(p["content"] for p in parts)
    assert parts[-1]["stop"] is True and parts[-1]["stop_type"] == "eos"
    check_schema(schema, text)


@pytest.mark.parametrize("name", ["types", "enum_const", "array_items", "ref_defs", "pattern", "any_of"])
def test_response_format_json_schema_through_openai(client, name):
    rf = {"type": "json_schema", "json_schema": {"name": name, "schema": SCHEMAS[name], "strict": True}}
    for seed in (0, 1):
        r = client.chat.completions.create(model="default", messages=[{"role": "user", "content": SCHEMA_PROMPT}],
                                           response_format=rf, max_tokens=64, temperature=1.0, seed=seed)
        assert r.choices[0].finish_reason == "stop", r.choices[0].message.content
        check_schema(SCHEMAS[name], r.choices[0].message.content)


def test_json_object_and_streamed_schema(client):
    r = client.chat.completions.create(
        model="default", messages=[{"role": "user", "content": "What is the capital of France? Answer in JSON."}],
        response_format={"type": "json_object"}, max_tokens=96, temperature=0)
    assert isinstance(json.loads(r.choices[0].message.content), dict)
    schema = SCHEMAS["string_lengths"]
    stream = client.chat.completions.create(
        model="default", messages=[{"role": "user", "content": SCHEMA_PROMPT}], stream=True, max_tokens=64,
        temperature=1.0, seed=2,
        response_format={"type": "json_schema", "json_schema": {"name": "s", "schema": schema}})
    text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    check_schema(schema, text)


def test_grammar_field_on_openai_completions(client):
    src, prompt, check = GBNF["list"]
    r = client.completions.create(model="default", prompt=chat_prompt(prompt), max_tokens=64, temperature=1.0,
                                  seed=3, extra_body={"grammar": src})
    assert r.choices[0].finish_reason == "stop" and check(r.choices[0].text)


def test_parallel_requests_with_different_grammars(server_url):
    """Four slots decoding together, each under its own schema (the masks overlap the shared forward pass)."""
    names = ["numeric_bounds", "nested", "one_of_format", "required_optional"]

    def one(name):
        r = httpx.post(server_url + "/v1/chat/completions", timeout=180, json={
            "messages": [{"role": "user", "content": SCHEMA_PROMPT}], "max_tokens": 64, "temperature": 1.0,
            "seed": 7, "response_format": {"type": "json_schema", "json_schema": {"schema": SCHEMAS[name]}}})
        assert r.status_code == 200, r.text
        return name, r.json()["choices"][0]["message"]["content"]

    with cf.ThreadPoolExecutor(4) as ex:
        for name, text in ex.map(one, names):
            check_schema(SCHEMAS[name], text)


# ------------------------------------------------------------------------------------------------ fail closed
@pytest.mark.parametrize("name", sorted(BAD_GBNF))
def test_bad_grammar_is_400(server_url, name):
    r = httpx.post(server_url + "/completion", json={"prompt": "x", "grammar": BAD_GBNF[name], "n_predict": 4})
    assert r.status_code == 400 and r.json()["error"]["param"] == "grammar", r.text
    assert "invalid" in r.json()["error"]["message"]


@pytest.mark.parametrize("name", sorted(BAD_SCHEMAS))
def test_bad_schema_is_400(server_url, name):
    r = httpx.post(server_url + "/v1/chat/completions", json={
        "messages": ASK, "max_tokens": 4,
        "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": BAD_SCHEMAS[name]}}})
    assert r.status_code == 400 and r.json()["error"]["param"] == "response_format", r.text
    r = httpx.post(server_url + "/completion", json={"prompt": "x", "json_schema": BAD_SCHEMAS[name]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "json_schema", r.text


@pytest.mark.parametrize("body, param", [
    ({"response_format": {"type": "xml"}}, "response_format"),
    ({"response_format": "json"}, "response_format"),
    ({"response_format": {"type": "json_schema"}}, "response_format"),
    ({"grammar": 5}, "grammar"),
    ({"grammar": 'root ::= "a"', "json_schema": {"type": "string"}}, "json_schema"),
    ({"tools": "get_weather"}, "tools"),
    ({"tools": [{"type": "function", "function": {"name": "bad name!"}}]}, "tools"),
    ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "nope"}}}],
      "tool_choice": "required"}, "tools"),
    ({"tools": TOOLS, "parallel_tool_calls": "yes"}, "parallel_tool_calls"),
])
def test_bad_structured_requests_are_400(server_url, body, param):
    r = httpx.post(server_url + "/v1/chat/completions", json={"messages": ASK, "max_tokens": 4, **body})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param, r.text


# ------------------------------------------------------------------------------------------------ tools
def _check_call(call, name=None):
    assert call.type == "function" and call.id
    assert name is None or call.function.name == name
    check_schema(TOOL_SCHEMAS[call.function.name], call.function.arguments)


def test_tool_choice_required_and_named(client):
    for seed in (0, 1, 2):
        r = client.chat.completions.create(model="default", messages=ASK, tools=TOOLS, tool_choice="required",
                                           max_tokens=64, temperature=1.0, seed=seed)
        c = r.choices[0]
        assert c.finish_reason == "tool_calls" and len(c.message.tool_calls) == 1 and not c.message.content
        _check_call(c.message.tool_calls[0])
    r = client.chat.completions.create(model="default", messages=ASK, tools=TOOLS, max_tokens=64, temperature=1.0,
                                       seed=0, tool_choice={"type": "function", "function": {"name": "add"}})
    assert r.choices[0].finish_reason == "tool_calls"
    _check_call(r.choices[0].message.tool_calls[0], "add")


def test_tool_calls_streamed_are_assembled_by_the_client(client):
    with client.chat.completions.stream(model="default", messages=ASK, tools=TOOLS, max_tokens=64, temperature=1.0,
                                        seed=1, tool_choice={"type": "function", "function":
                                                             {"name": "get_weather"}}) as s:
        final = s.get_final_completion()
    c = final.choices[0]
    assert c.finish_reason == "tool_calls" and len(c.message.tool_calls) == 1
    _check_call(c.message.tool_calls[0], "get_weather")
    chunks = list(client.chat.completions.create(model="default", messages=ASK, tools=TOOLS, max_tokens=64,
                                                 temperature=1.0, seed=1, tool_choice="required", stream=True))
    calls = [tc for ch in chunks if ch.choices for tc in (ch.choices[0].delta.tool_calls or [])]
    assert len(calls) == 1 and calls[0].index == 0 and calls[0].function.name in TOOL_SCHEMAS
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


def test_parallel_tool_calls(client):
    r = client.chat.completions.create(model="default", messages=ASK, tools=TOOLS, tool_choice="required",
                                       parallel_tool_calls=True, max_tokens=128, temperature=1.0, seed=3)
    c = r.choices[0]
    if c.finish_reason == "tool_calls":          # a small model may go on adding calls until max_tokens
        for call in c.message.tool_calls:
            _check_call(call)
    else:
        assert c.finish_reason == "length" and c.message.content.startswith('{"tool_calls"')


def test_tool_choice_auto_and_none(client):
    for seed in (0, 1):
        r = client.chat.completions.create(model="default", messages=ASK, tools=TOOLS, max_tokens=64,
                                           temperature=1.0, seed=seed)
        c = r.choices[0]
        if c.message.tool_calls:                 # a call, or a plain reply: both are well-formed
            assert c.finish_reason == "tool_calls"
            _check_call(c.message.tool_calls[0])
        else:
            assert c.finish_reason in ("stop", "length") and not c.message.content.startswith('{"response"')
    r = client.chat.completions.create(model="default", messages=ASK, tools=TOOLS, tool_choice="none",
                                       max_tokens=8, temperature=0)
    assert r.choices[0].message.tool_calls is None and r.choices[0].finish_reason == "length"


def test_tool_result_round_trip(client):
    first = client.chat.completions.create(model="default", messages=ASK, tools=TOOLS, tool_choice="required",
                                           max_tokens=64, temperature=0)
    call = first.choices[0].message.tool_calls[0]
    msgs = ASK + [first.choices[0].message.model_dump(exclude_none=True),
                  {"role": "tool", "tool_call_id": call.id, "content": '{"temperature": 21}'}]
    r = client.chat.completions.create(model="default", messages=msgs, tools=TOOLS, tool_choice="none",
                                       max_tokens=8, temperature=0)
    assert r.choices[0].message.content


# ------------------------------------------------------------------------------------------------ reasoning
THINK = r'root ::= "<think>" [a-z ]{3,20} "</think>" [A-Z] [a-z ]{2,16} "."'


def test_reasoning_content_split_streamed_and_not(client, server_url):
    body = {"messages": ASK, "max_tokens": 64, "temperature": 1.0, "seed": 5, "grammar": THINK,
            "reasoning_format": "deepseek"}
    r = httpx.post(server_url + "/v1/chat/completions", json=body, timeout=120).json()
    m = r["choices"][0]["message"]
    assert m["reasoning_content"] and "<think>" not in m["content"] and m["content"].endswith(".")
    with httpx.stream("POST", server_url + "/v1/chat/completions", json={**body, "stream": True}, timeout=120) as s:
        chunks = [json.loads(d) for d in sse_datas(s.iter_lines()) if d != "[DONE]"]
    deltas = [c["choices"][0]["delta"] for c in chunks if c["choices"]]
    assert "".join(d.get("reasoning_content", "") for d in deltas).strip() == m["reasoning_content"]
    assert "".join(d.get("content", "") for d in deltas) == m["content"]
    r = httpx.post(server_url + "/v1/chat/completions", json={**body, "reasoning_format": "none"}, timeout=120)
    assert r.json()["choices"][0]["message"]["content"].startswith("<think>")


def test_chat_template_kwargs_reach_the_template(server_url):
    r = httpx.post(server_url + "/v1/chat/completions", json={
        "messages": ASK, "max_tokens": 2, "chat_template_kwargs": {"enable_thinking": False}})
    assert r.status_code == 200
    for bad in ([1], {"messages": []}, {"not an identifier": 1}):
        r = httpx.post(server_url + "/v1/chat/completions", json={"messages": ASK, "max_tokens": 2,
                                                                  "chat_template_kwargs": bad})
        assert r.status_code == 400 and r.json()["error"]["param"] == "chat_template_kwargs"
    r = httpx.post(server_url + "/v1/chat/completions", json={"messages": ASK, "reasoning_format": "yes"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "reasoning_format"
