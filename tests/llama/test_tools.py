"""Tool calls (llampy/llama/tools.py): validation, the format picked from the template, parsing each family's
replies, the grammars of forced calls, and the Python API on SmolLM2 with its own template (generic format) and
with a Hermes-style template."""
from __future__ import annotations

import json

import numpy as np
import pytest

from llampy.llama.chat import ChatTemplate
from llampy.llama.grammar import Grammar
from llampy.llama.sampling import Candidates
from llampy.llama.tools import ToolError, chat_plan, check_tools, detect_format, parse, plan

from .grammar_corpus import check_schema

TOOLS = [
    {"type": "function", "function": {
        "name": "get_weather", "description": "The current weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20}},
                       "required": ["city"], "additionalProperties": False}}},
    {"type": "function", "function": {
        "name": "add", "parameters": {"type": "object", "properties": {"a": {"type": "integer"},
                                                                      "b": {"type": "integer"}},
                                      "required": ["a", "b"], "additionalProperties": False}}},
]
PARAMS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
HERMES = ("{%- if tools %}<|im_start|>system\nYou may call functions: <tools>{% for t in tools %}{{ t | tojson }}"
          "{% endfor %}</tools>\nFor each call reply <tool_call>{\"name\": <name>, \"arguments\": <args>}</tool_call>"
          "<|im_end|>\n{% endif %}{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + "
          "(message['content'] or '') + '<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}"
          "{{ '<|im_start|>assistant\n' }}{% endif %}")
LLAMA3 = "{% for m in messages %}<|start_header_id|>{{ m.role }}<|end_header_id|>{% endfor %}ipython"
MISTRAL = "{% for m in messages %}[INST]{{ m.content }}[/INST]{% endfor %}{% if tools %}[TOOL_CALLS]{% endif %}"


@pytest.fixture(scope="module")
def vocab(smollm2_path):
    from llampy.gguf import GGUFReader
    from llampy.llama.vocab import Vocab
    return Vocab.from_metadata(GGUFReader(smollm2_path).metadata)


def test_check_tools():
    tools, choice = check_tools(TOOLS, None)
    assert choice == "auto" and [t["function"]["name"] for t in tools] == ["get_weather", "add"]
    assert check_tools(TOOLS, {"type": "function", "function": {"name": "add"}})[1] == "add"
    no_params = check_tools([{"type": "function", "function": {"name": "ping"}}])[0]
    assert no_params[0]["function"]["parameters"] == {"type": "object", "properties": {}}
    for tools, choice, says in [("x", "auto", "list"), ([{"function": {"name": "a b"}}], "auto", "name"),
                                (TOOLS + TOOLS[:1], "auto", "unique"), (TOOLS, "maybe", "tool_choice"),
                                (TOOLS, {"type": "function", "function": {"name": "zzz"}}, "not among"),
                                ([], "required", "at least one")]:
        with pytest.raises(ToolError, match=says):
            check_tools(tools, choice)


def test_format_detection():
    assert detect_format(HERMES) == "hermes" and detect_format(LLAMA3) == "llama3"
    assert detect_format(MISTRAL) == "mistral" and detect_format("{{ messages }}") == "generic"


@pytest.mark.parametrize("fmt, text, content, calls", [
    ("hermes", 'Let me look. <tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>',
     "Let me look.", [("add", {"a": 1, "b": 2})]),
    ("hermes", '<tool_call>{"name": "add", "arguments": {"a": 1, "b": 2}}</tool_call>\n<tool_call>{"name": '
               '"get_weather", "arguments": {"city": "Oslo"}}</tool_call>', "",
     [("add", {"a": 1, "b": 2}), ("get_weather", {"city": "Oslo"})]),
    ("hermes", "<tool_call>not json</tool_call>", "<tool_call>not json</tool_call>", []),
    ("llama3", '{"name": "add", "parameters": {"a": 3, "b": 4}}', "", [("add", {"a": 3, "b": 4})]),
    ("llama3", '<|python_tag|>{"type": "function", "name": "add", "parameters": {"a": 3, "b": 4}}', "",
     [("add", {"a": 3, "b": 4})]),
    ("llama3", "The answer is 7.", "The answer is 7.", []),
    ("mistral", '[TOOL_CALLS][{"name": "add", "arguments": {"a": 5, "b": 6}, "id": "abcdefghi"}]', "",
     [("add", {"a": 5, "b": 6})]),
    ("generic", '{"tool_call": {"name": "add", "arguments": {"a": 1, "b": 1}}}', "", [("add", {"a": 1, "b": 1})]),
    ("generic", '{"tool_calls": [{"name": "add", "arguments": {"a": 1, "b": 1}}, {"name": "add", "arguments": '
                '{"a": 2, "b": 2}}]}', "", [("add", {"a": 1, "b": 1}), ("add", {"a": 2, "b": 2})]),
    ("generic", '{"response": "It is sunny."}', "It is sunny.", []),
    ("generic", '{"response": "Cut sho', "Cut sho", []),
    ("none", '{"response": "x"}', '{"response": "x"}', []),
])
def test_parse(fmt, text, content, calls):
    got_content, got = parse(fmt, text)
    assert got_content == content
    assert [(c.name, json.loads(c.arguments)) for c in got] == calls
    assert all(c.id.startswith("call_") or c.id == "abcdefghi" for c in got)


def _sample_forced(vocab, grammar, seed, n=120):
    """Random logits under a forced-call grammar: the text it lets through."""
    rng = np.random.default_rng(seed)
    g = Grammar(vocab, grammar)
    toks = []
    for _ in range(n):
        c = Candidates(rng.standard_normal(vocab.n_tokens).astype(np.float32))
        g.apply(c)
        t = int(c.ids[np.argmax(c.logits[:])])
        g.accept(t)
        if vocab.is_eog(t):
            break
        toks.append(t)
    return vocab.detokenize(toks, special=True), g


@pytest.mark.parametrize("source, fmt", [(HERMES, "hermes"), (LLAMA3, "llama3"), (MISTRAL, "mistral"),
                                         ("{{ messages }}", "generic")])
def test_forced_call_grammars_parse_back(vocab, source, fmt):
    tools, _ = check_tools(TOOLS)
    for choice in ("required", "add"):
        p = plan(source, ASK, tools, choice, vocab=vocab)
        assert p.format == fmt and p.grammar is not None
        text, g = _sample_forced(vocab, p.grammar, seed=len(fmt))
        if not g.is_accepting():         # random logits may wander into a long string; the grammar still holds
            continue
        content, calls = parse(fmt, text)
        assert len(calls) == 1 and content == "", text
        assert choice == "required" or calls[0].name == "add"
        check_schema(PARAMS[calls[0].name], calls[0].arguments)


def test_plans():
    tmpl = ChatTemplate(HERMES)
    p, g = chat_plan(tmpl, ASK, TOOLS, "auto")
    assert p.format == "hermes" and g is None and p.tools       # auto: unconstrained, parsed afterwards
    assert "<tools>" in tmpl.render(p.messages, tools=p.tools)
    p, g = chat_plan(tmpl, ASK, TOOLS, "none")
    assert p.format == "none" and p.tools is None and g is None
    p, g = chat_plan(ChatTemplate("{{ messages }}"), ASK, TOOLS, "auto")
    assert p.format == "generic" and g is not None and p.messages[0]["role"] == "system"
    assert "get_weather" in p.messages[0]["content"] and "`tool_call`" in p.messages[0]["content"]
    hist = ASK + [{"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "add", "arguments": '{"a": 1, "b": 2}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "3"}]
    p, _ = chat_plan(ChatTemplate("{{ messages }}"), hist, TOOLS, "auto")
    assert json.loads(p.messages[2]["content"]) == {"tool_calls": [{"name": "add", "arguments": {"a": 1, "b": 2}}]}
    from llampy.llama.grammar import LlamaGrammar
    with pytest.raises(ToolError, match="together with tools"):
        chat_plan(tmpl, ASK, TOOLS, "auto", grammar=LlamaGrammar.from_string('root ::= "x"'))


@pytest.mark.slow
def test_api_tool_calls_generic_and_hermes():
    from llampy.llama.api import Llama
    for template in (None, HERMES):
        llm = Llama(None, n_ctx=1024, chat_template=template)
        for seed in (0, 1):
            r = llm.create_chat_completion(ASK, tools=TOOLS, tool_choice="required", max_tokens=64, temperature=1.0,
                                           seed=seed)
            c = r["choices"][0]
            assert c["finish_reason"] == "tool_calls" and c["message"]["content"] is None, c
            call = c["message"]["tool_calls"][0]
            check_schema(PARAMS[call["function"]["name"]], call["function"]["arguments"])
        r = llm.create_chat_completion(ASK, tools=TOOLS, max_tokens=64, temperature=1.0, seed=0,
                                       tool_choice={"type": "function", "function": {"name": "add"}}, stream=True)
        chunks = list(r)
        deltas = [ch["choices"][0]["delta"] for ch in chunks]
        calls = [tc for d in deltas for tc in d.get("tool_calls", [])]
        assert len(calls) == 1 and calls[0]["function"]["name"] == "add" and calls[0]["index"] == 0
        assert chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"
        r = llm.create_chat_completion(ASK, tools=TOOLS, tool_choice="none", max_tokens=4, temperature=0)
        assert "tool_calls" not in r["choices"][0]["message"]


@pytest.mark.parametrize("pieces, opened, reasoning, content", [
    (["<th", "ink>I r", "eason</th", "ink>", "Answer ", "here"], False, "I reason", "Answer here"),
    (["plain ", "answer"], False, "", "plain answer"),
    (["<b>bold</b>"], False, "", "<b>bold</b>"),
    (["still ", "thinking"], True, "still thinking", ""),
    (["a</thi", "nk>\n\nb"], True, "a", "b"),
])
def test_reasoning_splitter_streams_what_the_whole_split_gives(pieces, opened, reasoning, content):
    from llampy.llama.reasoning import ReasoningSplitter, split_reasoning
    sp = ReasoningSplitter(opened)
    got = [sp.feed(p) for p in pieces] + [sp.flush()]
    assert "".join(r for r, _ in got).strip() == reasoning and "".join(c for _, c in got) == content
    assert split_reasoning("".join(pieces), opened) == (reasoning, content)
