"""OpenAI request validation and response shapes. Every bad input becomes an ``APIError`` with an HTTP status and
an OpenAI-style body: ``{"error": {"message", "type", "param", "code"}}``."""
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


def _num(body, key, default, lo=None, hi=None, integer=False):
    v = body.get(key, default)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, (int, float)) or (integer and not isinstance(v, int)):
        raise APIError(400, f"'{key}' must be {'an integer' if integer else 'a number'}", key)
    if lo is not None and v < lo or hi is not None and v > hi:
        raise APIError(400, f"'{key}' must be between {lo} and {hi}, got {v}", key)
    return v


def sampling_params(body: dict, n_vocab: int) -> dict:
    max_tokens = body.get("max_tokens", body.get("max_completion_tokens", body.get("n_predict")))
    if max_tokens is not None:
        if isinstance(max_tokens, bool) or not isinstance(max_tokens, int):
            raise APIError(400, "'max_tokens' must be an integer", "max_tokens")
        if max_tokens <= 0 and "n_predict" not in body:
            raise APIError(400, f"'max_tokens' must be at least 1, got {max_tokens}", "max_tokens")
    stop = body.get("stop") or []
    if isinstance(stop, str):
        stop = [stop]
    if not isinstance(stop, list) or not all(isinstance(s, str) for s in stop):
        raise APIError(400, "'stop' must be a string or a list of strings", "stop")
    bias = body.get("logit_bias") or {}
    if not isinstance(bias, dict):
        raise APIError(400, "'logit_bias' must be an object of token id to bias", "logit_bias")
    try:
        bias = {int(k): float(v) for k, v in bias.items()}
    except (TypeError, ValueError):
        raise APIError(400, "'logit_bias' keys must be token ids and values numbers", "logit_bias") from None
    seed = body.get("seed")
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
        raise APIError(400, "'seed' must be an integer", "seed")
    return dict(
        max_tokens=max_tokens if max_tokens is not None and max_tokens > 0 else None,
        temperature=_num(body, "temperature", 0.8, 0, 2), top_p=_num(body, "top_p", 0.95, 0, 1),
        top_k=_num(body, "top_k", 40, 0, n_vocab, integer=True), min_p=_num(body, "min_p", 0.05, 0, 1),
        presence_penalty=_num(body, "presence_penalty", 0.0, -2, 2),
        frequency_penalty=_num(body, "frequency_penalty", 0.0, -2, 2),
        repeat_penalty=_num(body, "repeat_penalty", 1.0, 0, 10), seed=seed, stop=stop, logit_bias=bias,
        ignore_eos=bool(body.get("ignore_eos", False)))


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
        content = m.get("content", "")
        if isinstance(content, list):   # OpenAI content parts: keep the text ones
            content = "".join(p.get("text", "") for p in content if isinstance(p, dict) and p.get("type") == "text")
        if content is not None and not isinstance(content, str):
            raise APIError(400, f"messages[{i}].content must be a string", f"messages[{i}].content")
        out.append({"role": m["role"], "content": content or ""})
    return out


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


def now() -> int:
    return int(time.time())


def usage(n_prompt: int, n_gen: int) -> dict:
    return {"prompt_tokens": n_prompt, "completion_tokens": n_gen, "total_tokens": n_prompt + n_gen}
