"""Gemma 4's tool calls, as llama.cpp's common/parsers/gemma4.cpp reads and constrains them.

A call is ``<|tool_call>call:NAME{key:value,...}<tool_call|>``, in Gemma's own notation rather than JSON: keys are
bare, strings sit between ``<|"|>`` marks, numbers, ``true``, ``false`` and ``null`` as in JSON, and dicts and
lists as in JSON (the chat template writes earlier calls that way, keys sorted, no spaces). Reasoning is a
``<|channel>thought ... <channel|>`` block before the reply.

``parse_value`` turns the notation into Python values (the arguments are then sent as JSON, as OpenAI's
``tool_calls`` carry them); ``call_rules`` writes the Lark rules of a forced call. llama.cpp constrains the
arguments only to be a Gemma dict (its TODO: "extend json-schema-to-grammar"); here a tool's parameter schema
shapes them where the notation can say it: the listed keys in the template's sorted order (required ones
mandatory), each value by its type, enum and const, nested objects and arrays, anyOf/oneOf and type lists. String
lengths, patterns, formats and numeric bounds are not enforced; a schema without a usable type takes any value.
"""
from __future__ import annotations

import json
import re

Q = '<|"|>'                                  # Gemma's string quote
CALL_OPEN, CALL_CLOSE = "<|tool_call>", "<tool_call|>"
THOUGHT_OPEN, THOUGHT_CLOSE = "<|channel>thought", "<channel|>"
MARKERS = ("<|channel>", "<channel|>", CALL_OPEN, CALL_CLOSE, "<|turn>", Q)     # llama.cpp's preserved tokens
DETECT = "'<|tool_call>call:'"               # in the template source (llama.cpp's detection)

_NUMBER = re.compile(r"-?(?:0|[1-9][0-9]*)(?:\.[0-9]+)?(?:[eE][+-]?[0-9]+)?")
_CALL = re.compile(re.escape(CALL_OPEN) + r"call:([A-Za-z0-9_.\-]+)(?=\{)")


class NotGemma(ValueError):
    """Text that is not a value in Gemma's notation."""


def parse_value(text: str, i: int = 0):
    """The value at text[i] and the index past it (llama.cpp's gemma4-value)."""
    i = _space(text, i)
    if text.startswith(Q, i):
        j = text.find(Q, i + len(Q))
        if j < 0:
            raise NotGemma("an unterminated string")
        return text[i + len(Q):j], j + len(Q)
    if text.startswith("{", i):
        out, i = {}, _space(text, i + 1)
        if text.startswith("}", i):
            return out, i + 1
        while True:
            j = i
            while j < len(text) and text[j] not in ":}":
                j += 1
            if j == i or j >= len(text) or text[j] != ":":
                raise NotGemma("a key without ':'")
            out[text[i:j]], i = parse_value(text, j + 1)
            i = _space(text, i)
            if text.startswith(",", i):
                i = _space(text, i + 1)
            elif text.startswith("}", i):
                return out, i + 1
            else:
                raise NotGemma("a dict without '}'")
    if text.startswith("[", i):
        out, i = [], _space(text, i + 1)
        if text.startswith("]", i):
            return out, i + 1
        while True:
            v, i = parse_value(text, i)
            out.append(v)
            i = _space(text, i)
            if text.startswith(",", i):
                i += 1
            elif text.startswith("]", i):
                return out, i + 1
            else:
                raise NotGemma("a list without ']'")
    for word, v in (("true", True), ("false", False), ("null", None)):
        if text.startswith(word, i):
            return v, i + len(word)
    m = _NUMBER.match(text, i)
    if m:
        s = m.group()
        return (float(s) if any(c in s for c in ".eE") else int(s)), m.end()
    raise NotGemma(f"no value at {text[i:i + 12]!r}")


def _space(text: str, i: int) -> int:
    while i < len(text) and text[i].isspace():
        i += 1
    return i


def parse_calls(text: str) -> tuple[str, list]:
    """(content, [(name, arguments dict)]) of a reply: every well-formed call taken out, the rest is content; a
    call cut short (max_tokens) or malformed stays in the content."""
    calls, content, pos = [], [], 0
    for m in _CALL.finditer(text):
        if m.start() < pos:
            continue
        try:
            args, end = parse_value(text, m.end())
        except NotGemma:
            continue
        if not isinstance(args, dict) or not text.startswith(CALL_CLOSE, end):
            continue
        content.append(text[pos:m.start()])
        calls.append((m.group(1), args))
        pos = end + len(CALL_CLOSE)
    content.append(text[pos:])
    return ("".join(content).strip() if calls else text), calls


# ------------------------------------------------------------------------------------------------ grammar
# a string's text: anything without '<|' (so it cannot run into the closing mark when that is spelled as text)
_STRING_TEXT = r'/(?:[^<]|<+[^<|])*<*/'
_INT = r"/-?(?:0|[1-9][0-9]*)/"
_NUM = r"/-?(?:0|[1-9][0-9]*)(?:\.[0-9]+)?(?:[eE][+-]?[0-9]+)?/"


class _Rules:
    """Lark rules for Gemma values shaped by JSON schemas; ``q`` is the quote's terminal (a token where the
    vocabulary has one)."""

    def __init__(self, q: str):
        self.q, self.rules, self.n = q, [], 0
        self.any_value = "gv_any"
        self.rules += [
            f"gv_any: gv_str | gv_dict | gv_list | {_NUM} | \"true\" | \"false\" | \"null\"",
            f"gv_str: {q} {_STRING_TEXT} {q}",
            'gv_dict: "{" (gv_key ":" gv_any ("," gv_key ":" gv_any)*)? "}"',
            r"gv_key: /[^:}<]+/",
            'gv_list: "[" (gv_any ("," gv_any)*)? "]"',
        ]

    def new(self, body: str) -> str:
        self.n += 1
        name = f"gv{self.n}"
        self.rules.append(f"{name}: {body}")
        return name

    def literal(self, v) -> str:
        if isinstance(v, str):
            return f"{self.q} {json.dumps(v, ensure_ascii=False)} {self.q}"
        if isinstance(v, bool) or v is None:
            return json.dumps(v)
        if isinstance(v, (int, float)):
            return json.dumps(json.dumps(v))
        return self.any_value        # an object or list const: not spelled out

    def value(self, s) -> str:
        if not isinstance(s, dict):
            return self.any_value
        if "const" in s:
            return self.literal(s["const"])
        if isinstance(s.get("enum"), list) and s["enum"]:
            return self.new(" | ".join(self.literal(v) for v in s["enum"]))
        alts = s.get("anyOf") or s.get("oneOf")
        if isinstance(alts, list) and alts:
            return self.new(" | ".join(self.value(a) for a in alts))
        t = s.get("type")
        if isinstance(t, list) and t:
            return self.new(" | ".join(self.value({**s, "type": x}) for x in t))
        if t == "string":
            return "gv_str"
        if t == "integer":
            return _INT
        if t == "number":
            return _NUM
        if t == "boolean":
            return '("true" | "false")'
        if t == "null":
            return '"null"'
        if t == "array":
            item = self.value(s.get("items"))
            return self.new(f'"[" ({item} ("," {item})*)? "]"')
        if t == "object" or "properties" in s:
            return self.object(s)
        return self.any_value

    def object(self, s: dict) -> str:
        props = s.get("properties")
        if not isinstance(props, dict) or not props:
            return "gv_dict"
        required = set(s.get("required") or [])
        items = [(k, self.value(v)) for k, v in sorted(props.items())]     # the template's dictsort order
        memo: dict = {}

        def tail(i: int, first: bool) -> str | None:
            """The rule of the members from i on, a comma before each but the first written; None past the end."""
            if i == len(items):
                return None
            if (i, first) not in memo:
                key, val = items[i]
                rest = tail(i + 1, False)
                one = ("" if first else '"," ') + f"{json.dumps(key + ':')} {val}" + (f" {rest}" if rest else "")
                if key in required:
                    memo[i, first] = self.new(one)
                else:
                    skip = tail(i + 1, first)
                    memo[i, first] = self.new(f"({one}) | {skip}" if skip else f"({one})?")
            return memo[i, first]
        return self.new(f'"{{" {tail(0, True)} "}}"')


def call_rules(tools: list, parallel: bool, term) -> str:
    """Lark source of a forced call (or calls, when ``parallel``) of one of ``tools``, after an optional thought.
    ``term(text)`` gives a marker's terminal (its special token where the vocabulary has one)."""
    r = _Rules(term(Q))
    alts = [f'{json.dumps("call:" + t["function"]["name"])} {r.object(t["function"]["parameters"])}' for t in tools]
    call = f'{term(CALL_OPEN)} ({" | ".join(alts)}) {term(CALL_CLOSE)}'
    thought = f'({term("<|channel>")} "thought" /[^<]*/ {term(THOUGHT_CLOSE)})?'
    head = f"start: {thought} call" + (" call*" if parallel else "")
    return "%llguidance {}\n" + "\n".join([head, f"call: {call}"] + r.rules) + "\n"
