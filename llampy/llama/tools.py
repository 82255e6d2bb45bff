"""Tool calls (OpenAI ``tools``/``tool_choice``): how the tools reach the chat template, how a call is parsed back
out of the reply, and the grammar that forces a call, per template family, as llama.cpp's common/chat.cpp picks
them from the template's source:

- ``hermes`` (Hermes 2 Pro, Qwen 2.5/3: the template mentions ``<tool_call>``): ``<tool_call>{"name": ...,
  "arguments": {...}}</tool_call>``, one block per call.
- ``llama3`` (the template has an ``ipython`` role): a bare ``{"name": ..., "parameters": {...}}``.
- ``mistral`` (the template mentions ``[TOOL_CALLS]``): ``[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]``.
- ``generic`` (anything else, SmolLM2 and Gemma 3 among them): the tools and an instruction go into a system
  message, and the reply is JSON, ``{"tool_call": {"name", "arguments"}}`` (``{"tool_calls": [...]}`` with parallel
  calls) or ``{"response": "..."}``, always constrained by a schema of those shapes (the output cannot be parsed
  otherwise).

``tool_choice``: "none" (tools are not shown, nothing is parsed), "auto", "required" (the reply must be a call),
or {"type": "function", "function": {"name": ...}} (a call of that tool). A forced call is constrained by a grammar
built from the tools' parameter schemas; under "auto" only the generic format is constrained.
"""
from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass

from .grammar import JSON_OPTIONS, GrammarError, LlamaGrammar

GENERIC_SYSTEM = ("Respond in JSON format, either with `tool_call` (a request to call tools) or with `response` reply "
                  "to the user's request")


class ToolError(ValueError):
    """Malformed tools or tool_choice."""


@dataclass
class ToolCall:
    name: str
    arguments: str          # JSON text, as OpenAI sends it
    id: str = ""

    def __post_init__(self):
        self.id = self.id or f"call_{uuid.uuid4().hex[:24]}"

    def to_openai(self, index: int | None = None) -> dict:
        d = {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}
        return d if index is None else {"index": index, **d}


@dataclass
class ToolPlan:
    """What one request with tools does: the template's inputs, the constraint, how to read the reply."""
    format: str                     # hermes | llama3 | mistral | generic | none
    messages: list
    tools: list | None              # as the template receives them
    grammar: LlamaGrammar | None
    parallel: bool = False

    def parse(self, text: str) -> tuple[str, list]:
        return parse(self.format, text)


# ------------------------------------------------------------------------------------------------ validation
def check_tools(tools, tool_choice="auto") -> tuple[list, object]:
    """Tools as a list of {"type": "function", "function": {"name", "description"?, "parameters"?}} and the
    tool_choice normalised to "none" | "auto" | "required" | a tool name."""
    if tools is None:
        tools = []
    if not isinstance(tools, list):
        raise ToolError("'tools' must be a list of tools")
    out = []
    for i, t in enumerate(tools):
        f = t.get("function") if isinstance(t, dict) else None
        if not isinstance(t, dict) or t.get("type", "function") != "function" or not isinstance(f, dict):
            raise ToolError(f"tools[{i}] must be {{'type': 'function', 'function': {{'name': ...}}}}")
        name = f.get("name")
        if not isinstance(name, str) or not re.fullmatch(r"[A-Za-z0-9_.\-]{1,64}", name):
            raise ToolError(f"tools[{i}].function.name must be 1-64 letters, digits, '_', '.' or '-'")
        params = f.get("parameters", {"type": "object", "properties": {}})
        if not isinstance(params, dict):
            raise ToolError(f"tools[{i}].function.parameters must be a JSON schema object")
        out.append({"type": "function", "function": {**f, "parameters": params}})
    names = [t["function"]["name"] for t in out]
    if len(set(names)) != len(names):
        raise ToolError("tool names must be unique")
    if tool_choice is None:
        tool_choice = "auto"
    if isinstance(tool_choice, dict):
        fn = tool_choice.get("function")
        name = fn.get("name") if isinstance(fn, dict) else None
        if tool_choice.get("type") != "function" or not isinstance(name, str):
            raise ToolError("'tool_choice' must be 'none', 'auto', 'required' or "
                            "{'type': 'function', 'function': {'name': ...}}")
        if name not in names:
            raise ToolError(f"'tool_choice' names the function {name!r}, which is not among the tools")
        return out, name
    if tool_choice not in ("none", "auto", "required"):
        raise ToolError(f"'tool_choice' must be 'none', 'auto', 'required' or a function, got {tool_choice!r}")
    if tool_choice == "required" and not out:
        raise ToolError("'tool_choice': 'required' needs at least one tool")
    return out, tool_choice


# ------------------------------------------------------------------------------------------------ formats
def detect_format(source: str) -> str:
    """The tool-call format of a chat template, by the markers llama.cpp's chat.cpp looks for."""
    if "<tool_call>" in source:
        return "hermes"
    if "[TOOL_CALLS]" in source:
        return "mistral"
    if "<|start_header_id|>ipython<|end_header_id|>" in source or (
            "<|start_header_id|>" in source and "ipython" in source):
        return "llama3"
    return "generic"


def _call_schema(tool: dict, args_key: str = "arguments") -> dict:
    f = tool["function"]
    return {"type": "object", "properties": {"name": {"const": f["name"]}, args_key: f["parameters"]},
            "required": ["name", args_key], "additionalProperties": False}


def _any(schemas: list) -> dict:
    return schemas[0] if len(schemas) == 1 else {"anyOf": schemas}


def _json_rule(schema: dict) -> str:
    return "%json " + json.dumps({**schema, "x-guidance": JSON_OPTIONS}, ensure_ascii=False)


def _token_or_text(vocab, text: str) -> str:
    """A Lark terminal for ``text``: the special token of that text where the vocabulary has one (a grammar
    cannot spell a special token), else the literal."""
    if vocab is not None:
        i = vocab.token_to_id.get(text)
        if i is not None and (vocab.is_control(i) or (text.startswith("<") and text.endswith(">"))):
            return f"<[{i}]>"
    return json.dumps(text)


def plan(template_source: str, messages: list, tools: list, tool_choice, parallel: bool = False,
         vocab=None, response_schema: dict | None = None) -> ToolPlan:
    """The request's plan. ``tools``/``tool_choice`` as check_tools returns them."""
    if not tools or tool_choice == "none":
        return ToolPlan("none", messages, None, None, parallel)
    fmt = detect_format(template_source)
    chosen = [t for t in tools if tool_choice in ("auto", "required") or t["function"]["name"] == tool_choice]
    forced = tool_choice != "auto"
    if fmt == "generic":
        calls = [_call_schema(t) for t in chosen]
        call = ({"type": "object", "properties": {"tool_calls": {"type": "array", "items": _any(calls),
                                                                  "minItems": 1}},
                 "required": ["tool_calls"], "additionalProperties": False} if parallel else
                {"type": "object", "properties": {"tool_call": _any(calls)}, "required": ["tool_call"],
                 "additionalProperties": False})
        schema = call if forced else {"anyOf": [call, {
            "type": "object", "properties": {"response": response_schema or {"type": "string"}},
            "required": ["response"], "additionalProperties": False}]}
        listing = json.dumps([t["function"] for t in tools], ensure_ascii=False, indent=2)
        system = (f"You can call any of the following tools to satisfy the user's requests: {listing}\n\n"
                  f"{GENERIC_SYSTEM}")
        msgs = _add_system(_generic_history(messages), system)
        return ToolPlan(fmt, msgs, tools, LlamaGrammar.from_json_schema(schema), parallel)
    grammar = None
    if forced:
        if fmt == "hermes":
            block = f'{_token_or_text(vocab, "<tool_call>")} "\\n"? call "\\n"? {_token_or_text(vocab, "</tool_call>")}'
            start = f"start: {block}" + (f' ("\\n" {block})*' if parallel else "")
            lark = f"%llguidance {{}}\n{start}\ncall: {_json_rule(_any([_call_schema(t) for t in chosen]))}\n"
        elif fmt == "llama3":
            lark = f"%llguidance {{}}\nstart: call\ncall: " \
                   f"{_json_rule(_any([_call_schema(t, 'parameters') for t in chosen]))}\n"
        else:   # mistral
            more = ' (", " call)*' if parallel else ""
            lark = (f'%llguidance {{}}\nstart: {_token_or_text(vocab, "[TOOL_CALLS]")} "[" call{more} "]"\n'
                    f"call: {_json_rule(_any([_call_schema(t) for t in chosen]))}\n")
        grammar = LlamaGrammar.from_string(lark)
    return ToolPlan(fmt, messages, tools, grammar, parallel)


def _add_system(messages: list, text: str) -> list:
    """llama.cpp's add_system: the text joins the first system message, or becomes one."""
    if messages and messages[0].get("role") == "system":
        return [{**messages[0], "content": (messages[0].get("content") or "") + "\n\n" + text}] + messages[1:]
    return [{"role": "system", "content": text}] + list(messages)


def _generic_history(messages: list) -> list:
    """Earlier calls and results as plain text for a template that knows no tools: an assistant's calls become
    the JSON it would have written, a tool's result a message of role 'tool' with its content."""
    out = []
    for m in messages:
        calls = m.get("tool_calls")
        if m.get("role") == "assistant" and calls:
            body = [{"name": c["function"]["name"], "arguments": _loads_or_text(c["function"].get("arguments"))}
                    for c in calls]
            out.append({"role": "assistant", "content": json.dumps({"tool_calls": body}, ensure_ascii=False)})
        else:
            out.append({k: v for k, v in m.items() if k in ("role", "content")})
    return out


def _loads_or_text(s):
    try:
        return json.loads(s) if isinstance(s, str) else s
    except json.JSONDecodeError:
        return s


# ------------------------------------------------------------------------------------------------ parsing
def _args_text(v) -> str:
    return v if isinstance(v, str) else json.dumps(v, ensure_ascii=False)


def _calls_from(objs) -> list:
    out = []
    for o in objs:
        if isinstance(o, dict) and isinstance(o.get("name"), str):
            args = o.get("arguments", o.get("parameters", {}))
            out.append(ToolCall(o["name"], _args_text(args), o.get("id") if isinstance(o.get("id"), str) else ""))
    return out


def _json_at(text: str, i: int):
    """The JSON value starting at text[i] (after whitespace) and the index past it, or (None, i)."""
    dec = json.JSONDecoder()
    j = i
    while j < len(text) and text[j].isspace():
        j += 1
    try:
        v, end = dec.raw_decode(text, j)
        return v, end
    except json.JSONDecodeError:
        return None, i


def _partial_response(text: str) -> str:
    """The text of a generic reply cut short (max_tokens) inside ``{"response": "...``: what the string holds so
    far; any other text unchanged."""
    m = re.match(r'\s*\{\s*"response"\s*:\s*"', text)
    if not m:
        return text
    body = text[m.end():]
    for cut in range(len(body), max(len(body) - 8, -1), -1):     # drop a half-written escape at the end
        try:
            return json.loads('"' + body[:cut].rstrip("\\") + '"')
        except json.JSONDecodeError:
            continue
    return text


def parse(fmt: str, text: str) -> tuple[str, list]:
    """(content, [ToolCall]) from a reply in format ``fmt``; text that is not a well-formed call stays content."""
    if fmt == "none":
        return text, []
    if fmt == "generic":
        v, end = _json_at(text, 0)
        if not isinstance(v, dict) or text[end:].strip():
            return _partial_response(text), []
        if isinstance(v.get("tool_calls"), list):
            return "", _calls_from(v["tool_calls"])
        if isinstance(v.get("tool_call"), dict):
            return "", _calls_from([v["tool_call"]])
        if "response" in v:
            r = v["response"]
            return (r if isinstance(r, str) else json.dumps(r, ensure_ascii=False)), []
        return text, []
    if fmt == "hermes":
        calls, content, pos = [], [], 0
        for m in re.finditer(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", text, re.S):
            v, _ = _json_at(m.group(1), 0)
            got = _calls_from([v]) if isinstance(v, dict) else []
            if got:
                content.append(text[pos:m.start()])
                calls += got
                pos = m.end()
        content.append(text[pos:])
        return ("".join(content).strip() if calls else text), calls
    if fmt == "llama3":
        m = re.match(r'\s*(?:<\|python_tag\|>)?\s*\{\s*(?:"type"\s*:\s*"function"\s*,\s*)?"name"\s*:', text)
        if m:
            v, end = _json_at(text, text.index("{"))
            got = _calls_from([v]) if isinstance(v, dict) else []
            if got:
                return text[end:].strip(), got
        return text, []
    if fmt == "mistral":
        i = text.find("[TOOL_CALLS]")
        if i >= 0:
            v, end = _json_at(text, i + len("[TOOL_CALLS]"))
            got = _calls_from(v if isinstance(v, list) else [v])
            if got:
                return (text[:i] + text[end:]).strip(), got
        return text, []
    raise GrammarError(f"unknown tool-call format {fmt!r}")


# ------------------------------------------------------------------------------------------------ requests
def chat_plan(template, messages: list, tools, tool_choice, parallel_tool_calls=None, vocab=None,
              grammar: LlamaGrammar | None = None) -> tuple[ToolPlan, LlamaGrammar | None]:
    """The plan of a chat request and the one grammar that constrains its reply. ``template`` is a ChatTemplate
    (its tool_use variant is the one that renders with tools). A grammar or response_format together with tools:
    in the generic format a JSON schema becomes the shape of the plain response; elsewhere it is refused (the
    reply could not be both)."""
    tools, choice = check_tools(tools, tool_choice)
    # llama-server's default: one call per reply unless the request asks for more (OpenAI's is True; a small model
    # asked for "one or more" calls keeps adding them until max_tokens)
    parallel = bool(parallel_tool_calls)
    source = template.tool_use.source if (tools and getattr(template, "tool_use", None)) else template.source
    if not tools or choice == "none":
        return ToolPlan("none", messages, None, None, parallel), grammar
    response_schema = None
    if grammar is not None:
        if detect_format(source) != "generic" or grammar.kind != "json_schema" or choice != "auto":
            raise ToolError("a grammar or response_format together with tools is supported only for a JSON schema, "
                            "with tool_choice 'auto', on a template without its own tool-call format")
        response_schema = grammar.source
    p = plan(source, messages, tools, choice, parallel, vocab, response_schema)
    return p, p.grammar


def tool_call_deltas(calls: list) -> list:
    """Streamed chunks' deltas for finished calls: one delta per call, carrying its index, id, name and the whole
    arguments text (the openai client joins argument pieces by index; one piece is a valid stream)."""
    return [{"tool_calls": [c.to_openai(i)]} for i, c in enumerate(calls)]


# ------------------------------------------------------------------------------------------------ reasoning
THINK_OPEN, THINK_CLOSE = "<think>", "</think>"


def wants_reasoning(template_source: str, prompt: str, reasoning_format: str | None) -> bool:
    """Whether a reply's <think> block is split off (llama.cpp's --reasoning-format): "none" keeps it in the
    content; "auto", the default, splits it where the template knows think tags or opened one; "deepseek" asks for
    the split whatever the template."""
    if reasoning_format == "none":
        return False
    return (reasoning_format in ("deepseek", "deepseek-legacy") or THINK_OPEN in template_source
            or prompt.rstrip().endswith(THINK_OPEN))


class ReasoningSplitter:
    """Splits a reply into reasoning (inside <think>...</think>) and content, incrementally for streams: ``feed``
    returns (reasoning, content) text that is safe to send (a tail that may be the start of a tag is held back);
    ``flush`` the rest. ``opened``: the prompt ended with <think> (the reply starts inside it)."""

    def __init__(self, opened: bool = False):
        self.state = "think" if opened else "start"
        self.buf = ""

    def feed(self, text: str) -> tuple[str, str]:
        self.buf += text
        reasoning, content = "", ""
        while True:
            if self.state == "start":
                s = self.buf.lstrip()
                if s.startswith(THINK_OPEN):
                    self.buf, self.state = s[len(THINK_OPEN):], "think"
                    continue
                if THINK_OPEN.startswith(s) and s:       # might still become <think>
                    return reasoning, content
                if not s:
                    return reasoning, content
                self.state = "content"
            if self.state == "think":
                i = self.buf.find(THINK_CLOSE)
                if i >= 0:
                    reasoning += self.buf[:i]
                    self.buf, self.state = self.buf[i + len(THINK_CLOSE):].lstrip(), "content"
                    continue
                keep = _partial_tail(self.buf, THINK_CLOSE)
                reasoning += self.buf[:len(self.buf) - keep]
                self.buf = self.buf[len(self.buf) - keep:]
                return reasoning, content
            content += self.buf
            self.buf = ""
            return reasoning, content

    def flush(self) -> tuple[str, str]:
        rest, self.buf = self.buf, ""
        return (rest, "") if self.state == "think" else ("", rest)


def _partial_tail(text: str, tag: str) -> int:
    """The length of the longest end of ``text`` that is a proper start of ``tag``."""
    for k in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:k]):
            return k
    return 0


def split_reasoning(text: str, opened: bool = False) -> tuple[str, str]:
    """(reasoning, content) of a whole reply."""
    sp = ReasoningSplitter(opened)
    r1, c1 = sp.feed(text)
    r2, c2 = sp.flush()
    return (r1 + r2).strip(), c1 + c2
