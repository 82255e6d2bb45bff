"""Tool calls (OpenAI ``tools``/``tool_choice``): how the tools reach the chat template, how a call is parsed back
out of the reply, and the grammar that forces a call, per template family, as llama.cpp's common/chat.cpp picks
them from the template's source:

- ``hermes`` (Hermes 2 Pro, Qwen 2.5/3: the template mentions ``<tool_call>``): ``<tool_call>{"name": ...,
  "arguments": {...}}</tool_call>``, one block per call.
- ``llama3`` (the template has an ``ipython`` role): a bare ``{"name": ..., "parameters": {...}}``.
- ``mistral`` (the template mentions ``[TOOL_CALLS]``): Mistral Nemo's ``[TOOL_CALLS][{"name": ..., "arguments":
  {...}, "id": ...}, ...]``, or, where the template has ``[ARGS]`` (Mistral Small 3.2, Devstral),
  ``[TOOL_CALLS]NAME[CALL_ID]ID[ARGS]{...}`` per call. Call ids are 9 letters and digits, the only ids Mistral's
  templates take back in the history.
- ``gemma4`` (the template writes ``'<|tool_call>call:'``): ``<|tool_call>call:NAME{key:value}<tool_call|>`` in
  Gemma's own notation (llampy/llama/tools_gemma4.py), reasoning in ``<|channel>thought ... <channel|>``.
- ``gpt-oss`` (the template writes ``<|channel|>``): OpenAI's harmony messages, a call being
  ``<|channel|>commentary to=functions.NAME <|constrain|>json<|message|>{...}`` (llampy/llama/tools_harmony.py); only
  tool_choice "auto" (llama.cpp constrains a forced call by a grammar of those messages, llampy refuses it).
- ``generic`` (anything else, SmolLM2 and Gemma 3 among them): the tools and an instruction go into a system
  message, and the reply is JSON, ``{"tool_call": {"name", "arguments"}}`` (``{"tool_calls": [...]}`` with parallel
  calls) or ``{"response": "..."}``, always constrained by a schema of those shapes (the output cannot be parsed
  otherwise).

``tool_choice``: "none" (tools are not shown, nothing is parsed), "auto", "required" (the reply must be a call),
or {"type": "function", "function": {"name": ...}} (a call of that tool). A forced call is constrained by a grammar
built from the tools' parameter schemas; under "auto" only the generic format is constrained.

As llama.cpp does around the template: earlier calls' arguments reach a template that reads them as objects
(found by rendering a probe conversation, as llama.cpp's template capabilities are) as objects rather than JSON text,
and a call's message gets content "" where it has none; a format's markers that are control tokens of the
vocabulary (``[TOOL_CALLS]``, ``<|tool_call>``, ...) are kept in the reply's text (llama.cpp's preserved tokens),
or the reply could not be parsed.
"""
from __future__ import annotations

import functools
import json
import random
import re
import string
import uuid
from dataclasses import dataclass

from . import reasoning
from . import tools_gemma4 as gemma4
from . import tools_harmony as harmony
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

    @classmethod
    def mistral(cls, name: str, arguments: str, id: str = "") -> "ToolCall":
        """A call whose id Mistral's templates take back: the model's own if it is 9 letters and digits."""
        if not re.fullmatch(r"[A-Za-z0-9]{9}", id or ""):
            id = "".join(random.choices(string.ascii_letters + string.digits, k=9))
        return cls(name, arguments, id)

    def to_openai(self, index: int | None = None) -> dict:
        d = {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}
        return d if index is None else {"index": index, **d}


@dataclass
class ToolPlan:
    """What one request with tools does: the template's inputs, the constraint, how to read the reply."""
    format: str                     # hermes | llama3 | mistral | gemma4 | gpt-oss | generic | none
    messages: list
    tools: list | None              # as the template receives them
    grammar: LlamaGrammar | None
    parallel: bool = False
    keep_tokens: frozenset = frozenset()    # control tokens the reply's text keeps (the format's markers)
    source: str = ""                        # the chat template that renders the request

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
    if gemma4.DETECT in source:
        return "gemma4"
    if harmony.is_harmony(source):
        return "gpt-oss"
    if "<tool_call>" in source:
        return "hermes"
    if "[TOOL_CALLS]" in source:
        return "mistral"
    if "<|start_header_id|>ipython<|end_header_id|>" in source or (
            "<|start_header_id|>" in source and "ipython" in source):
        return "llama3"
    return "generic"


def _call_schema(tool: dict, args_key: str = "arguments", with_id: bool = False) -> dict:
    f = tool["function"]
    props, required = {"name": {"const": f["name"]}, args_key: f["parameters"]}, ["name", args_key]
    if with_id:         # Mistral Nemo writes the call's id itself (llama.cpp's grammar asks for it too)
        props["id"], required = {"type": "string", "pattern": "^[a-zA-Z0-9]{9}$"}, required + ["id"]
    return {"type": "object", "properties": props, "required": required, "additionalProperties": False}


MARKERS = {"hermes": ("<tool_call>", "</tool_call>"), "llama3": ("<|python_tag|>",),
           "mistral": ("[TOOL_CALLS]", "[CALL_ID]", "[ARGS]"), "gemma4": gemma4.MARKERS, "gpt-oss": harmony.MARKERS}


def keep_tokens(vocab, texts) -> frozenset:
    """The ids of those of ``texts`` that are single tokens of the vocabulary."""
    if vocab is None:
        return frozenset()
    return frozenset(i for i in (vocab.token_to_id.get(t) for t in texts) if i is not None)


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
    if forced and fmt == "gpt-oss":
        raise ToolError("tool_choice 'required' or a named function is not supported with gpt-oss's chat format "
                        "(harmony messages); use 'auto'")
    if forced:
        if fmt == "hermes":
            block = f'{_token_or_text(vocab, "<tool_call>")} "\\n"? call "\\n"? {_token_or_text(vocab, "</tool_call>")}'
            start = f"start: {block}" + (f' ("\\n" {block})*' if parallel else "")
            lark = f"%llguidance {{}}\n{start}\ncall: {_json_rule(_any([_call_schema(t) for t in chosen]))}\n"
        elif fmt == "llama3":
            lark = f"%llguidance {{}}\nstart: call\ncall: " \
                   f"{_json_rule(_any([_call_schema(t, 'parameters') for t in chosen]))}\n"
        elif fmt == "gemma4":
            lark = gemma4.call_rules(chosen, parallel, lambda text: _token_or_text(vocab, text))
        elif "[ARGS]" in template_source:       # mistral, one [TOOL_CALLS]NAME[CALL_ID]ID[ARGS]{...} per call
            call_id = f' ({_token_or_text(vocab, "[CALL_ID]")} /[a-zA-Z0-9]{{9}}/)?' \
                if "[CALL_ID]" in template_source else ""
            alts = " | ".join(f'{json.dumps(t["function"]["name"])}{call_id} {_token_or_text(vocab, "[ARGS]")} '
                              f'args{i}' for i, t in enumerate(chosen))
            args = "".join(f'args{i}: {_json_rule(t["function"]["parameters"])}\n' for i, t in enumerate(chosen))
            lark = (f'%llguidance {{}}\nstart: call{"+" if parallel else ""}\n'
                    f'call: {_token_or_text(vocab, "[TOOL_CALLS]")} ({alts})\n{args}')
        else:   # mistral nemo
            more = ' (", " call)*' if parallel else ""
            lark = (f'%llguidance {{}}\nstart: {_token_or_text(vocab, "[TOOL_CALLS]")} "[" call{more} "]"\n'
                    f"call: {_json_rule(_any([_call_schema(t, with_id=True) for t in chosen]))}\n")
        grammar = LlamaGrammar.from_string(lark)
    return ToolPlan(fmt, messages, tools, grammar, parallel, keep_tokens(vocab, MARKERS[fmt]))


PROBE_ARG = "llampy-probe-value"


@functools.lru_cache(maxsize=32)
def object_arguments(template_source: str) -> bool:
    """Whether a template reads a call's arguments as an object: it renders a conversation with an earlier call
    whose arguments are {"arg": PROBE_ARG} and writes the value out (llama.cpp's supports_object_arguments).
    Templates that only concatenate the arguments as text fail here and get JSON text."""
    from .chat import ChatTemplate, ChatTemplateError
    call = {"id": "call00001", "type": "function", "function": {"name": "tool1", "arguments": {"arg": PROBE_ARG}}}
    msgs = [{"role": "user", "content": "User message"},
            {"role": "assistant", "content": "", "tool_calls": [call]},
            {"role": "tool", "tool_call_id": "call00001", "content": "Tool response"},
            {"role": "assistant", "content": "The tool response was 'tool response'"},
            {"role": "user", "content": "User message"}]
    tools = [{"type": "function", "function": {
        "name": "tool1", "description": "Tool description", "parameters": {
            "type": "object", "properties": {"arg": {"type": "string", "description": "Arg description"}},
            "required": ["arg"]}}}]
    try:
        return PROBE_ARG in ChatTemplate(template_source).render(msgs, tools=tools)
    except ChatTemplateError:
        return False


def template_messages(template_source: str, messages: list) -> list:
    """The messages as the template wants them: earlier calls' JSON-text arguments as objects where it reads
    objects, and content "" instead of none beside calls (llama.cpp's func_args_not_string and
    requires_non_null_content); for gpt-oss's template, reasoning_content as its ``thinking``."""
    if harmony.is_harmony(template_source):
        messages = harmony.template_messages(messages)
    if not any(isinstance(m, dict) and m.get("tool_calls") for m in messages):
        return messages
    objects = object_arguments(template_source)
    out = []
    for m in messages:
        calls = m.get("tool_calls") if isinstance(m, dict) else None
        if calls and isinstance(calls, list):
            m = {**m, "content": m.get("content") or ""}
            if objects:
                m["tool_calls"] = [_with_object_arguments(c) for c in calls]
        out.append(m)
    return out


def _with_object_arguments(call):
    f = call.get("function") if isinstance(call, dict) else None
    if not isinstance(f, dict) or not isinstance(f.get("arguments"), str):
        return call
    args = _loads_or_text(f["arguments"])
    return {**call, "function": {**f, "arguments": args}} if isinstance(args, dict) else call


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
        return _parse_mistral(text)
    if fmt == "gpt-oss":
        calls, content, pos = [], [], 0
        for name, start, end in harmony.call_headers(text):
            if start < pos:
                continue
            v, jend = _json_at(text, end)
            if not isinstance(v, dict):
                continue
            content.append(text[pos:start])
            calls.append(ToolCall(name, _args_text(v)))
            pos = jend
        content.append(text[pos:])
        return ("".join(content).strip() if calls else text), calls
    if fmt == "gemma4":
        content, calls = gemma4.parse_calls(text)
        return content, [ToolCall(name, json.dumps(args, ensure_ascii=False)) for name, args in calls]
    raise GrammarError(f"unknown tool-call format {fmt!r}")


_MISTRAL_ARGS = re.compile(r"\[TOOL_CALLS\]\s*([A-Za-z0-9_.\-]+)(?:\[CALL_ID\]([A-Za-z0-9]+))?\[ARGS\]")


def _parse_mistral(text: str) -> tuple[str, list]:
    """Nemo's ``[TOOL_CALLS][{...}, ...]`` or Small 3.2's ``[TOOL_CALLS]NAME[CALL_ID]ID[ARGS]{...}`` blocks."""
    calls, content, pos = [], [], 0
    for m in _MISTRAL_ARGS.finditer(text):
        if m.start() < pos:
            continue
        v, end = _json_at(text, m.end())
        if not isinstance(v, dict):
            continue
        content.append(text[pos:m.start()])
        calls.append(ToolCall.mistral(m.group(1), _args_text(v), m.group(2) or ""))
        pos = end
    if calls:
        content.append(text[pos:])
        return "".join(content).strip(), calls
    i = text.find("[TOOL_CALLS]")
    if i >= 0:
        v, end = _json_at(text, i + len("[TOOL_CALLS]"))
        got = [ToolCall.mistral(c.name, c.arguments, c.id) for c in _calls_from(v if isinstance(v, list) else [v])]
        if got:
            return (text[:i] + text[end:]).strip(), got
    return text, []


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
    keep = keep_tokens(vocab, reasoning.markers(source))
    if not tools or choice == "none":
        return ToolPlan("none", template_messages(source, messages), None, None, parallel, keep, source), grammar
    response_schema = None
    if grammar is not None:
        if detect_format(source) != "generic" or grammar.kind != "json_schema" or choice != "auto":
            raise ToolError("a grammar or response_format together with tools is supported only for a JSON schema, "
                            "with tool_choice 'auto', on a template without its own tool-call format")
        response_schema = grammar.source
    p = plan(source, template_messages(source, messages), tools, choice, parallel, vocab, response_schema)
    p.keep_tokens, p.source = p.keep_tokens | keep, source
    return p, p.grammar


def tool_call_deltas(calls: list) -> list:
    """Streamed chunks' deltas for finished calls: one delta per call, carrying its index, id, name and the whole
    arguments text (the openai client joins argument pieces by index; one piece is a valid stream)."""
    return [{"tool_calls": [c.to_openai(i)]} for i, c in enumerate(calls)]
