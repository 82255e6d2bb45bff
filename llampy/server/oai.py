"""OpenAI request validation and response shapes. Every bad input becomes an ``APIError`` with an HTTP status and
an OpenAI-style body: ``{"error": {"message", "type", "param", "code"}}``.

Requests are validated by hand rather than by pydantic models so that each error names the offending field the
way OpenAI's API does (``param``). A field a route does not know is a 400 as OpenAI gives it ("Unrecognized request
argument supplied: <field>"), never silently ignored: the fields each route honours are listed once, in
``SCHEMAS`` (which /openapi.json also shows), and ``check_fields`` holds a body to them. llama-server passes
unknown fields through, but rejects ``best_of`` and ``suffix`` on /v1/completions, ``echo``, ``top_logprobs``
without ``logprobs``, ``logprobs`` with tools on a stream, a string ``enable_thinking``, and a grammar with tools;
those are 400s here too, each naming the field."""
from __future__ import annotations

import time
import uuid


class APIError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, type: str = "invalid_request_error",
                 code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.type, self.code = status, message, param, type, code

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _num(body, key, default, lo=None, hi=None, integer=False):
    v = body.get(key, default)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, (int, float)) or (integer and not isinstance(v, int)):
        raise APIError(400, f"'{key}' must be {'an integer' if integer else 'a number'}, got {v!r}", key)
    if v != v or (lo is not None and v < lo) or (hi is not None and v > hi):
        raise APIError(400, f"'{key}' must be between {lo} and {hi}, got {v}", key)
    return v


def flag(body: dict, key: str) -> bool:
    v = body.get(key, False)
    if v is None:
        return False
    if not isinstance(v, bool):
        raise APIError(400, f"'{key}' must be a boolean, got {v!r}", key)
    return v


def include_usage(body: dict) -> bool:
    so = body.get("stream_options")
    if so is None:
        return False
    if not isinstance(so, dict):
        raise APIError(400, "'stream_options' must be an object", "stream_options")
    return flag(so, "include_usage")


def sampling_params(body: dict, n_vocab: int) -> dict:
    """The sampling fields of a completion request, checked; names as Chain.from_params takes them."""
    key = next((k for k in ("max_tokens", "max_completion_tokens", "n_predict") if body.get(k) is not None), None)
    max_tokens = body.get(key) if key else None
    if max_tokens is not None:
        if not _is_int(max_tokens):
            raise APIError(400, f"'{key}' must be an integer, got {max_tokens!r}", key)
        # llama.cpp's native n_predict = -1 means "until the context is full"; OpenAI's fields must be >= 1
        if max_tokens <= 0 and not (key == "n_predict" and max_tokens == -1):
            raise APIError(400, f"'{key}' must be at least 1, got {max_tokens}", key)
    stop = body.get("stop")
    if stop is None:
        stop = []
    if isinstance(stop, str):
        stop = [stop]
    if not isinstance(stop, list) or not all(isinstance(s, str) and s for s in stop) or len(stop) > 16:
        raise APIError(400, "'stop' must be a non-empty string or a list of up to 16 of them", "stop")
    from .fields import llama_sampling, logit_bias
    bias = logit_bias(body, n_vocab)
    seed = body.get("seed")
    if seed is not None and not _is_int(seed):
        raise APIError(400, f"'seed' must be an integer, got {seed!r}", "seed")
    return dict(
        max_tokens=max_tokens if max_tokens is not None and max_tokens > 0 else None,
        temperature=_num(body, "temperature", 0.8, 0, 2), top_p=_num(body, "top_p", 0.95, 0, 1),
        top_k=_num(body, "top_k", 40, 0, n_vocab, integer=True), min_p=_num(body, "min_p", 0.05, 0, 1),
        presence_penalty=_num(body, "presence_penalty", 0.0, -2, 2),
        frequency_penalty=_num(body, "frequency_penalty", 0.0, -2, 2),
        repeat_penalty=_num(body, "repeat_penalty", 1.0, 0, 10), seed=seed, stop=stop, logit_bias=bias,
        ignore_eos=flag(body, "ignore_eos"), **llama_sampling(body))


def choices_n(body: dict, limit: int) -> int:
    """OpenAI's ``n`` (llama-server's n_cmpl): completions per prompt, 1..limit."""
    n = body.get("n", 1)
    n = 1 if n is None else n
    if not _is_int(n) or not 1 <= n <= limit:
        if limit == 1:
            raise APIError(400, f"only 'n': 1 is supported here (one choice per request), got {n!r}", "n")
        raise APIError(400, f"'n' must be an integer from 1 to {limit}, got {n!r}", "n")
    return n


def grammar_param(body: dict):
    """The request's output constraint, compiled (a LlamaGrammar) or None: llama.cpp's ``grammar`` (GBNF) and
    ``json_schema`` fields, or OpenAI's ``response_format``; at most one of them. One that cannot be compiled is a
    400 naming the field and what is wrong, never an unconstrained reply."""
    from ..llama.grammar import GrammarError, LlamaGrammar, from_response_format
    given = [k for k in ("grammar", "json_schema", "response_format") if body.get(k) is not None]
    if len(given) > 1:
        raise APIError(400, f"give only one of {', '.join(repr(k) for k in given)}", given[1])
    if not given:
        return None
    key = given[0]
    v = body[key]
    try:
        if key == "grammar":
            if not isinstance(v, str):
                raise APIError(400, "'grammar' must be a string (a GBNF grammar)", key)
            return LlamaGrammar.from_string(v) if v.strip() else None
        if key == "json_schema":
            if not isinstance(v, (dict, bool)):
                raise APIError(400, "'json_schema' must be an object (a JSON schema)", key)
            return LlamaGrammar.from_json_schema(v)
        return from_response_format(v)
    except GrammarError as e:
        raise APIError(400, f"{key}: {e}", key) from None


def template_kwargs(body: dict) -> dict:
    """``chat_template_kwargs``: extra variables for the chat template (e.g. enable_thinking), as llama-server;
    OpenAI's ``reasoning_effort`` as llama-server reads it: "none" turns thinking off (enable_thinking false),
    another value reaches the template as ``reasoning_effort``."""
    from ..llama.reasoning import check_template_kwargs
    try:
        kw = check_template_kwargs(body.get("chat_template_kwargs"))
    except ValueError as e:
        raise APIError(400, str(e), "chat_template_kwargs") from None
    effort = body.get("reasoning_effort")
    if effort is not None:
        if not isinstance(effort, str) or not effort:
            raise APIError(400, "'reasoning_effort' must be a string such as 'low', 'medium', 'high' or 'none'",
                           "reasoning_effort")
        if effort == "none":
            kw["enable_thinking"] = False
        else:
            kw["reasoning_effort"] = effort
    return kw


def reasoning_format(body: dict) -> str:
    """llama.cpp's reasoning_format: "none" keeps a thinking block in the content; "auto" (default) and
    "deepseek" move it to reasoning_content (llampy/llama/reasoning.py)."""
    from ..llama.reasoning import check_reasoning_format
    try:
        return check_reasoning_format(body.get("reasoning_format"))
    except ValueError as e:
        raise APIError(400, str(e), "reasoning_format") from None


def check_fields(body: dict, route: str) -> None:
    """A 400 naming the first field of ``body`` that ``route`` (a key of SCHEMAS) does not honour."""
    known = SCHEMAS[route]["properties"]
    for k in body:
        if k not in known:
            hint = UNSUPPORTED.get(k, "")
            raise APIError(400, f"Unrecognized request argument supplied: {k}" + (f" ({hint})" if hint else ""), k)


def check_messages(body: dict) -> list:
    msgs = body.get("messages")
    if msgs is None:
        raise APIError(400, "'messages' is required", "messages")
    if not isinstance(msgs, list) or not msgs:
        raise APIError(400, "'messages' must be a non-empty list", "messages")
    out = []
    for i, m in enumerate(msgs):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise APIError(400, f"messages[{i}] must be an object with a string 'role'", f"messages[{i}]")
        if m["role"] not in ("system", "developer", "user", "assistant", "tool"):
            raise APIError(400, f"messages[{i}].role must be system, user or assistant, got {m['role']!r}",
                           f"messages[{i}].role")
        content = m.get("content", "")
        images = isinstance(content, list) and any(isinstance(p, dict) and p.get("type") == "image_url"
                                                   for p in content)
        if isinstance(content, list):   # OpenAI content parts: text, and images (server/media.py joins those)
            if not all(isinstance(p, dict) and (p.get("type") == "text" and isinstance(p.get("text"), str)
                                                or p.get("type") == "image_url") for p in content):
                raise APIError(400, f"messages[{i}].content: only text and image_url parts are supported",
                               f"messages[{i}].content")
            if not images:
                content = "".join(p["text"] for p in content)
        if content is not None and not isinstance(content, str) and not images:
            raise APIError(400, f"messages[{i}].content must be a string", f"messages[{i}].content")
        role = "system" if m["role"] == "developer" else m["role"]
        msg = {"role": role, "content": content or ""}
        calls = m.get("tool_calls")
        if calls is not None and role == "assistant":       # an earlier reply's calls, for the template
            if not isinstance(calls, list) or not all(
                    isinstance(c, dict) and isinstance(c.get("function"), dict)
                    and isinstance(c["function"].get("name"), str) for c in calls):
                raise APIError(400, f"messages[{i}].tool_calls must be a list of {{'function': {{'name', "
                                    "'arguments'}}}}", f"messages[{i}].tool_calls")
            msg["tool_calls"] = calls
        for k in ("tool_call_id", "name", "reasoning_content"):
            if isinstance(m.get(k), str):
                msg[k] = m[k]
        out.append(msg)
    return out


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


def now() -> int:
    return int(time.time())


def usage(n_prompt: int, n_gen: int, n_cached: int = 0) -> dict:
    return {"prompt_tokens": n_prompt, "completion_tokens": n_gen, "total_tokens": n_prompt + n_gen,
            "prompt_tokens_details": {"cached_tokens": n_cached}}


def chat_logprob(piece: bytes, logprob: float, top: list) -> dict:
    """One token of a chat completion's ``logprobs.content``; ``top`` is [(piece bytes, logprob)]."""
    def entry(b: bytes, lp: float) -> dict:
        return {"token": b.decode("utf-8", errors="replace"), "logprob": lp, "bytes": list(b)}
    return {**entry(piece, logprob), "top_logprobs": [entry(b, lp) for b, lp in top]}


def completion_logprobs(pieces: list, logprobs: list, tops: list, offset0: int = 0) -> dict:
    """A text completion's ``logprobs`` object: tokens, token_logprobs, top_logprobs (dicts), text_offset."""
    offs, o = [], offset0
    for p in pieces:
        offs.append(o)
        o += len(p)
    return {"tokens": pieces, "token_logprobs": logprobs,
            "top_logprobs": [None if t is None else dict(t) for t in tops], "text_offset": offs}


# ---------------------------------------------------------------------- request schemas, for /openapi.json only
from . import fields as _fields  # noqa: E402  (fields imports APIError from here)

# Every field a route honours (check_fields rejects the others), with its schema for /openapi.json.
_SAMPLING = {
    "model": {"type": "string"}, "max_tokens": {"type": "integer", "minimum": 1},
    "max_completion_tokens": {"type": "integer", "minimum": 1},
    "n_predict": {"type": "integer", "minimum": -1, "description": "llama.cpp's max_tokens; -1: until the context "
                                                                   "is full"},
    "n": {"type": "integer", "enum": [1]},
    **_fields.SCHEMA,
    "repeat_penalty": {"type": "number", "minimum": 0, "maximum": 10},
    "ignore_eos": {"type": "boolean"},
    "user": {"type": "string", "description": "OpenAI's end-user id; it does not change the reply"},
    "temperature": {"type": "number", "minimum": 0, "maximum": 2},
    "top_p": {"type": "number", "minimum": 0, "maximum": 1}, "top_k": {"type": "integer", "minimum": 0},
    "min_p": {"type": "number", "minimum": 0, "maximum": 1}, "seed": {"type": "integer"},
    "stop": {"anyOf": [{"type": "string"}, {"type": "array", "items": {"type": "string"}}]},
    "presence_penalty": {"type": "number"}, "frequency_penalty": {"type": "number"},
    "logit_bias": {"anyOf": [{"type": "object", "additionalProperties": {"anyOf": [{"type": "number"},
                                                                                   {"const": False}]}},
                             {"type": "array", "items": {"type": "array", "minItems": 2, "maxItems": 2}}],
                   "description": "token id (or text) -> bias; false bans the token"},
    "stream": {"type": "boolean"},
    "stream_options": {"type": "object", "properties": {"include_usage": {"type": "boolean"}}},
    "grammar": {"type": "string", "description": "a GBNF grammar the output must match"},
    "json_schema": {"type": "object", "description": "a JSON schema the output must match"},
    "response_format": {"type": "object", "properties": {
        "type": {"type": "string", "enum": ["text", "json_object", "json_schema"]},
        "json_schema": {"type": "object", "properties": {"name": {"type": "string"}, "schema": {"type": "object"}}},
        "schema": {"type": "object"}}},
}
_MESSAGE = {"type": "object", "required": ["role"], "properties": {
    "role": {"type": "string", "enum": ["system", "developer", "user", "assistant", "tool"]},
    "content": {"anyOf": [{"type": "string"}, {"type": "array"}]}}}
_PROMPT = {"anyOf": [{"type": "string"}, {"type": "array", "items": {"type": "integer"}}]}
_PROMPTS = {"anyOf": [{"type": "string"}, {"type": "array", "items": {"type": "integer"}},
                      {"type": "array", "items": {"anyOf": [{"type": "string"},
                                                            {"type": "array", "items": {"type": "integer"}}]}}],
            "description": "one prompt, or a list of them (a choice each)"}

SCHEMAS = {
    "chat": {"type": "object", "required": ["messages"], "properties": {
        **_SAMPLING, "messages": {"type": "array", "items": _MESSAGE, "minItems": 1},
        "n": {"type": "integer", "minimum": 1, "maximum": 64, "description": "replies to the conversation"},
        "tools": {"type": "array", "items": {"type": "object", "properties": {
            "type": {"const": "function"}, "function": {"type": "object", "required": ["name"], "properties": {
                "name": {"type": "string"}, "description": {"type": "string"}, "parameters": {"type": "object"}}}}}},
        "tool_choice": {"anyOf": [{"type": "string", "enum": ["none", "auto", "required"]}, {"type": "object"}]},
        "parallel_tool_calls": {"type": "boolean"},
        "logprobs": {"type": "boolean"}, "top_logprobs": {"type": "integer", "minimum": 0, "maximum": 20},
        "chat_template_kwargs": {"type": "object", "description": "extra chat template variables, e.g. "
                                                                  "enable_thinking (a boolean)"},
        "reasoning_format": {"type": "string", "enum": ["none", "auto", "deepseek", "deepseek-legacy"]},
        "reasoning_effort": {"type": "string", "description": "'none' turns thinking off; another value reaches "
                                                              "the template"}}},
    "completion": {"type": "object", "required": ["prompt"], "properties": {
        **_SAMPLING, "prompt": _PROMPTS, "logprobs": {"type": "integer", "minimum": 0, "maximum": 20},
        "n": {"type": "integer", "minimum": 1, "description": "completions per prompt"},
        "echo": {"type": "boolean", "description": "the prompt before the completion (with logprobs: its tokens' "
                                                   "log-probs too); max_tokens may then be 0"},
        "suffix": {"type": "string", "description": "the text after the completion: fill-in-the-middle, for "
                                                    "models with FIM tokens"}}},
    "native": {"type": "object", "required": ["prompt"], "properties": {
        **_SAMPLING, "prompt": _PROMPT, "n_predict": {"type": "integer"}, "n_probs": {"type": "integer"},
        "return_tokens": {"type": "boolean"}}},
    "infill": {"type": "object", "required": ["input_prefix", "input_suffix"], "properties": {
        **_SAMPLING, "input_prefix": {"type": "string"}, "input_suffix": {"type": "string"},
        "input_extra": {"type": "array", "items": {"type": "object", "required": ["text"], "properties": {
            "text": {"type": "string"}, "filename": {"type": "string"}}}},
        "prompt": {"type": "string", "description": "text after the prefix (llama-server's)"},
        "n_predict": {"type": "integer"}, "n_probs": {"type": "integer"}, "return_tokens": {"type": "boolean"}}},
    "apply_template": {"type": "object", "required": ["messages"], "properties": {
        "messages": {"type": "array", "items": _MESSAGE, "minItems": 1}, "tools": {"type": "array"},
        "chat_template_kwargs": {"type": "object"}, "add_generation_prompt": {"type": "boolean"}}},
    "embeddings": {"type": "object", "required": ["input"], "properties": {
        "model": {"type": "string"}, "user": {"type": "string"},
        "encoding_format": {"type": "string", "enum": ["float", "base64"]},
        "input": {"anyOf": [{"type": "string"}, {"type": "array", "items": {"type": "string"}}]}}},
    "tokenize": {"type": "object", "required": ["content"], "properties": {
        "content": {"type": "string"}, "add_special": {"type": "boolean"}, "parse_special": {"type": "boolean"},
        "with_pieces": {"type": "boolean"}}},
    "detokenize": {"type": "object", "required": ["tokens"], "properties": {
        "tokens": {"type": "array", "items": {"type": "integer"}}}},
}


# why a field OpenAI or llama-server knows is refused (the 400 says so beside the field's name)
UNSUPPORTED = {
    "best_of": "one completion per request; use 'n'", "functions": "use 'tools'",
    "function_call": "use 'tool_choice'", "store": "replies are not stored", "audio": "text only",
    "modalities": "text only",
}


def openapi_body(name: str) -> dict:
    return {"requestBody": {"required": True, "content": {"application/json": {"schema": SCHEMAS[name]}}}}
