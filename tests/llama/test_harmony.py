"""gpt-oss's chat format (harmony): llama.cpp's own cases for its gpt-oss parser (tests/test-chat.cpp of the 0.3.36
sdist, "GPT-OSS format tests"), read through llampy's splitter and tool-call parser, whole and streamed piece by
piece; and gpt-oss's template (models/templates/openai-gpt-oss-120b.jinja) rendering tools and earlier calls."""
from __future__ import annotations

import json

import pytest

from llampy.llama import reasoning, tools
from llampy.llama.chat import ChatTemplate

from tests.paths import ROOT

TEMPLATE = (ROOT / "tests" / "fixtures" / "chat_templates" / "openai-gpt-oss-120b.jinja").read_text()
SPECIAL = {"type": "function", "function": {"name": "special_function", "description": "I'm special", "parameters": {
    "type": "object", "properties": {"arg1": {"type": "integer", "description": "The arg."}}, "required": ["arg1"]}}}
EDIT = {"type": "function", "function": {"name": "edit", "description": "Edit a file", "parameters": {
    "type": "object", "properties": {"oldString": {"type": "string"}, "newString": {"type": "string"},
                                     "replaceAll": {"type": "boolean"}}, "required": ["oldString", "newString"]}}}
HELLO = "Hello, world!\nWhat's up?"
THINK = "<|channel|>analysis<|message|>I'm\nthinking<|end|>"
CALL = [("special_function", {"arg1": 1})]

# (reply, reasoning_format, tools, reasoning, content, calls): llama.cpp's expectations for each reply
CASES = [
    ("<|channel|>final<|message|>" + HELLO, "auto", None, "", HELLO, []),
    ("<|channel|>commentary<|message|>" + HELLO, "auto", None, "", HELLO, []),
    (THINK + "<|start|>assistant<|channel|>final<|message|>" + HELLO, "auto", None, "I'm\nthinking", HELLO, []),
    (THINK + "<|start|>assistant<|channel|>final<|message|>" + HELLO, "none", None, "", THINK + HELLO, []),
    ("<|channel|>analysis<|message|>I'm\nthinking", "auto", None, "I'm\nthinking", "", []),
    (' to=functions.special_function<|channel|>analysis<|message|>{"arg1": 1}', "auto", [SPECIAL], "", "", CALL),
    ('<|channel|>analysis to=functions.special_function<|message|>{"arg1": 1}', "auto", [SPECIAL], "", "", CALL),
    (' to=functions.special_function<|channel|>analysis <|constrain|>json<|message|>{"arg1": 1}', "auto", [SPECIAL],
     "", "", CALL),
    ('<|channel|>commentary to=functions.special_function<|message|>{"arg1": 1}', "auto", [SPECIAL], "", "", CALL),
    (THINK + '<|start|>assistant to=functions.special_function<|channel|>analysis<|message|>{"arg1": 1}', "auto",
     [SPECIAL], "I'm\nthinking", "", CALL),
    ("<|channel|>analysis<|message|>Thinking about edit...<|end|><|start|>assistant<|channel|>commentary "
     'to=functions.edit <|constrain|>json<|message|>{"oldString": "if (part < railCount - 1) {", "newString": '
     '"if (part < 4) {", "replaceAll": false}', "auto", [EDIT], "Thinking about edit...", "",
     [("edit", {"oldString": "if (part < railCount - 1) {", "newString": "if (part < 4) {", "replaceAll": False})]),
    ("<|channel|>analysis<|message|>I need to output the invoice details in JSON<|end|><|start|>assistant<|channel|>"
     'final <|constrain|>json<|message|>{"amount": 123.45, "date": "2025-12-03"}', "auto", None,
     "I need to output the invoice details in JSON", '{"amount": 123.45, "date": "2025-12-03"}', []),
    # gpt-oss's built-in tools: consumed, no content
    ("<|channel|>analysis<|message|>I will execute python to say hello<|end|><|start|>assistant to=container.exec"
     "<|channel|>commentary<|message|>python3 -c 'print(\"hello\")'", "auto", None,
     "I will execute python to say hello", "", []),
    ("<|channel|>analysis<|message|>I will execute python to say hello<|end|><|start|>assistant<|channel|>commentary "
     'to=python <|constrain|>code<|message|>print("hello")', "auto", None, "I will execute python to say hello", "",
     []),
    # a stray "<|channel|>commentary to=assistant" before the real channel
    ("<|channel|>commentary to=assistant" + THINK + "<|start|>assistant<|channel|>final<|message|>" + HELLO, "auto",
     None, "I'm\nthinking", HELLO, []),
    (THINK + "<|start|>assistant<|channel|>commentary to=assistant<|channel|>final<|message|>" + HELLO, "auto", None,
     "I'm\nthinking", HELLO, []),
]


def _read(reply, fmt, tool_list, stream):
    think = reasoning.splitter_for(TEMPLATE, "<|start|>assistant", fmt)
    if stream:         # piece by piece, as a stream's deltas arrive
        r, c = [], []
        for i in range(0, len(reply), 3):
            a, b = think.feed(reply[i:i + 3])
            r.append(a)
            c.append(b)
        a, b = think.flush()
        text_r, content = ("".join(r) + a).strip(), "".join(c) + b
    else:
        text_r, content = think.split(reply)
    calls = []
    if tool_list:
        content, calls = tools.parse(tools.detect_format(TEMPLATE), content)
    return text_r, content, [(c.name, json.loads(c.arguments)) for c in calls]


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("case", range(len(CASES)))
def test_llama_cpp_cases(case, stream):
    reply, fmt, tool_list, want_r, want_c, want_calls = CASES[case]
    assert _read(reply, fmt, tool_list, stream) == (want_r, want_c, want_calls)


def test_template_renders_tools_history_and_reasoning():
    """Tools in the developer message, an earlier call with its reasoning (the template's ``thinking``, from
    reasoning_content) and the tool's result as harmony messages; the prompt ends where the reply starts."""
    tp = tools.plan(TEMPLATE, tools.template_messages(TEMPLATE, [
        {"role": "user", "content": "Call it"},
        {"role": "assistant", "content": "", "reasoning_content": "I should call it",
         "tool_calls": [{"id": "c1", "type": "function",
                         "function": {"name": "special_function", "arguments": '{"arg1": 1}'}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "done"}]), [SPECIAL], "auto")
    assert tp.format == "gpt-oss" and tp.grammar is None
    prompt = ChatTemplate(TEMPLATE).render(tp.messages, add_generation_prompt=True, tools=tp.tools)
    assert "namespace functions" in prompt and "type special_function = " in prompt
    assert "<|channel|>analysis<|message|>I should call it<|end|>" in prompt
    assert 'to=functions.special_function<|channel|>commentary json<|message|>{"arg1": 1}<|call|>' in prompt
    assert '<|start|>functions.special_function to=assistant<|channel|>commentary<|message|>"done"<|end|>' in prompt
    assert prompt.endswith("<|start|>assistant")


def test_forced_tool_choice_is_refused_clearly():
    with pytest.raises(tools.ToolError, match="gpt-oss"):
        tools.plan(TEMPLATE, [{"role": "user", "content": "x"}], [SPECIAL], "required")
