"""llama-server's sampling fields beyond OpenAI's, checked and turned into ``Chain.from_params`` settings.

Each is honoured (the sampler exists in llampy/llama/sampling.py, with llama.cpp's semantics) or the request is a
400 naming it: typical_p, min_keep, top_n_sigma, xtc_probability/xtc_threshold, dynatemp_range/exponent,
repeat_last_n, mirostat (1, 2) with mirostat_tau/eta, the DRY fields, and ``samplers`` (llama.cpp's order: a list
of names or a string of letters). Defaults are llama-server's (common/common.h). ``SCHEMA`` describes them for
/openapi.json and the routes' field lists (oai.SCHEMAS).
"""
from __future__ import annotations

import math

from .oai import APIError, _is_int

_INT32 = 2 ** 31 - 1


def _number(body: dict, key: str, default, lo=-math.inf, hi=math.inf, integer: bool = False):
    v = body.get(key)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, (int, float)) or (integer and not _is_int(v)):
        raise APIError(400, f"'{key}' must be {'an integer' if integer else 'a number'}, got {v!r}", key)
    if not math.isfinite(v) or not lo <= v <= hi:
        raise APIError(400, f"'{key}' must be between {lo} and {hi}, got {v!r}", key)
    return v


def llama_sampling(body: dict) -> dict:
    """The request's llama-server sampler settings, as Chain.from_params keywords. -1 in repeat_last_n and
    dry_penalty_last_n is the whole history (llama.cpp: the context size; a slot's history never exceeds it)."""
    from ..llama.sampling import sampler_order
    out = dict(
        typical_p=_number(body, "typical_p", 1.0),
        min_keep=_number(body, "min_keep", 0, 0, _INT32, integer=True),
        top_n_sigma=_number(body, "top_n_sigma", -1.0),
        xtc_probability=_number(body, "xtc_probability", 0.0, 0, 1),
        xtc_threshold=_number(body, "xtc_threshold", 0.1, 0, 1),
        dynatemp_range=_number(body, "dynatemp_range", 0.0),
        dynatemp_exponent=_number(body, "dynatemp_exponent", 1.0),
        repeat_last_n=_number(body, "repeat_last_n", 64, -1, _INT32, integer=True),
        mirostat=_number(body, "mirostat", 0, 0, 2, integer=True),
        mirostat_tau=_number(body, "mirostat_tau", 5.0),
        mirostat_eta=_number(body, "mirostat_eta", 0.1),
        dry_multiplier=_number(body, "dry_multiplier", 0.0, 0),
        dry_base=_number(body, "dry_base", 1.75),
        dry_allowed_length=_number(body, "dry_allowed_length", 2, 0, _INT32, integer=True),
        dry_penalty_last_n=_number(body, "dry_penalty_last_n", -1, -1, _INT32, integer=True),
    )
    if out["dry_base"] < 1:              # llama-server replaces a base below 1 by its default
        out["dry_base"] = 1.75
    brk = body.get("dry_sequence_breakers")
    if brk is not None:
        if not isinstance(brk, list) or not brk or not all(isinstance(b, str) and b for b in brk):
            raise APIError(400, "'dry_sequence_breakers' must be a non-empty list of non-empty strings",
                           "dry_sequence_breakers")
        out["dry_sequence_breakers"] = brk
    smp = body.get("samplers")
    if smp is not None:
        try:
            out["samplers"] = sampler_order(smp)
        except ValueError as e:
            raise APIError(400, f"'samplers': {e}", "samplers") from None
    return out


_NUM = {"type": "number"}
SCHEMA = {
    "typical_p": {"type": "number", "description": "locally typical sampling (1: off)"},
    "min_keep": {"type": "integer", "minimum": 0, "description": "the fewest tokens a filter leaves"},
    "top_n_sigma": {"type": "number", "description": "keep logits within n standard deviations of the top (<= 0: "
                                                     "off)"},
    "xtc_probability": {"type": "number", "minimum": 0, "maximum": 1, "description": "chance XTC removes the top "
                                                                                      "choices (0: off)"},
    "xtc_threshold": {"type": "number", "minimum": 0, "maximum": 1, "description": "XTC's probability threshold "
                                                                                    "(> 0.5: off)"},
    "dynatemp_range": _NUM, "dynatemp_exponent": _NUM,
    "repeat_last_n": {"type": "integer", "minimum": -1, "description": "tokens the penalties look back (-1: the "
                                                                       "context)"},
    "mirostat": {"type": "integer", "enum": [0, 1, 2]}, "mirostat_tau": _NUM, "mirostat_eta": _NUM,
    "dry_multiplier": {"type": "number", "minimum": 0, "description": "DRY repetition penalty (0: off)"},
    "dry_base": _NUM, "dry_allowed_length": {"type": "integer", "minimum": 0},
    "dry_penalty_last_n": {"type": "integer", "minimum": -1, "description": "tokens DRY scans (-1: the context)"},
    "dry_sequence_breakers": {"type": "array", "items": {"type": "string"}, "minItems": 1},
    "samplers": {"anyOf": [{"type": "array", "items": {"type": "string"}}, {"type": "string"}],
                 "description": "the samplers' order: names (penalties, dry, top_n_sigma, top_k, typ_p, top_p, "
                                "min_p, xtc, temperature) or their letters (edskypmxt)"},
    "cache_prompt": {"type": "boolean", "description": "reuse the slot's cached prompt prefix (default true)"},
    "id_slot": {"type": "integer", "minimum": -1, "description": "the slot to run in (-1: any)"},
    "timings_per_token": {"type": "boolean", "description": "llama-server's timings in every streamed chunk"},
    "speculative.n_max": {"type": "integer", "minimum": 0, "description": "the most tokens drafted per step for "
                                                                          "this request (0: no drafting)"},
    "speculative.n_min": {"type": "integer", "minimum": 0, "description": "a shorter model draft is dropped"},
    "lora": {"type": "array", "items": {"type": "object", "properties": {"id": {"type": "integer", "minimum": 0},
                                                                          "scale": {"type": "number"}}},
             "description": "LoRA adapters for this request: [{id, scale}]; the adapters not listed take scale 0"},
    "speculative.p_min": {"type": "number", "minimum": 0, "maximum": 1,
                          "description": "the draft model stops below this probability of its top token"},
}


def request_options(body: dict, n_parallel: int) -> dict:
    """cache_prompt, id_slot, timings_per_token and the speculative.* overrides, checked."""
    cp = body.get("cache_prompt", True)
    if not isinstance(cp, bool):
        raise APIError(400, "'cache_prompt' must be a boolean", "cache_prompt")
    sid = body.get("id_slot", -1)
    if sid is None:
        sid = -1
    if not _is_int(sid) or not -1 <= sid < n_parallel:
        raise APIError(400, f"'id_slot' must be -1 or a slot number below {n_parallel}", "id_slot")
    tpt = body.get("timings_per_token", False)
    if not isinstance(tpt, bool):
        raise APIError(400, "'timings_per_token' must be a boolean", "timings_per_token")
    # an empty list is no override (llama-server: the server's scales), unlike POST /lora-adapters' empty body
    return {"cache_prompt": cp, "id_slot": sid, "timings_per_token": tpt, "lora": lora_scales(body.get("lora")) or None,
            "spec_n_max": _number(body, "speculative.n_max", None, 0, _INT32, integer=True),
            "spec_n_min": _number(body, "speculative.n_min", None, 0, _INT32, integer=True),
            "spec_p_min": _number(body, "speculative.p_min", None, 0, 1)}


def lora_scales(raw, param: str = "lora") -> dict | None:
    """llama-server's lora lists ([{"id": i, "scale": s}], a request's "lora" and POST /lora-adapters' body) ->
    {id: scale}; None when absent. A later entry of the same id wins, as in llama-server."""
    if raw is None:
        return None
    if not isinstance(raw, list) or not all(isinstance(e, dict) for e in raw):
        raise APIError(400, f"'{param}' must be an array of objects with 'id' and 'scale' fields", param)
    out = {}
    for e in raw:
        i, sc = e.get("id"), e.get("scale", 0.0)
        if not _is_int(i) or i < 0:
            raise APIError(400, f"'{param}': each entry needs an 'id', a LoRA adapter number from 0", param)
        if isinstance(sc, bool) or not isinstance(sc, (int, float)) or not math.isfinite(sc):
            raise APIError(400, f"'{param}': the scale of adapter {i} must be a finite number", param)
        out[int(i)] = float(sc)
    return out


def logit_bias(body: dict, n_vocab: int) -> list:
    """llama-server's logit_bias: an object {token id or text: bias} or a list of [token id or text, bias] pairs;
    a bias is a finite number, or false to ban the token. Returns [(id or text, bias)]; a text stands for each token
    of its tokenization (``resolve_logit_bias``). Ids outside the vocabulary, non-finite numbers and other values are
    400s (llama-server skips them)."""
    raw = body.get("logit_bias")
    if raw is None:
        return []
    if isinstance(raw, dict):
        pairs = list(raw.items())
    elif isinstance(raw, list):
        if not all(isinstance(el, list) and len(el) == 2 for el in raw):
            raise APIError(400, "'logit_bias' as a list holds [token, bias] pairs", "logit_bias")
        pairs = [tuple(el) for el in raw]
    else:
        raise APIError(400, "'logit_bias' must be an object {token: bias} or a list of [token, bias] pairs",
                       "logit_bias")
    out = []
    for key, v in pairs:
        if v is False:
            bias = -math.inf
        elif isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
            raise APIError(400, f"'logit_bias' values must be finite numbers or false (ban), got {v!r}",
                           "logit_bias")
        else:
            bias = float(v)
        if isinstance(key, str) and key.lstrip("-").isdigit():
            key = int(key)
        if _is_int(key):
            if not 0 <= key < n_vocab:
                raise APIError(400, f"'logit_bias' names the token id {key}, outside the vocabulary "
                                    f"(0..{n_vocab - 1})", "logit_bias")
        elif not isinstance(key, str) or not key:
            raise APIError(400, f"'logit_bias' keys must be token ids or texts, got {key!r}", "logit_bias")
        out.append((key, bias))
    return out


def resolve_logit_bias(pairs: list, vocab) -> dict:
    """{token id: total bias} of logit_bias's pairs: a text biases each token of its tokenization (no special
    tokens parsed, as llama-server); biases of the same token add up (llama.cpp applies every entry)."""
    out: dict[int, float] = {}
    for key, bias in pairs:
        ids = [key] if isinstance(key, int) else vocab.tokenize(key, add_special=False, parse_special=False)
        for i in ids:
            out[i] = out.get(i, 0.0) + bias
    return out
