"""Reasoning (llampy/llama/reasoning.py): the thinking block split from the content for <think> and Gemma 4's
channel tags, the request fields' checks, and reasoning_format / chat_template_kwargs on create_chat_completion."""
from __future__ import annotations

import pytest

from llampy.llama.reasoning import (ReasoningSplitter, check_reasoning_format, check_template_kwargs, split_reasoning,
                                    splitter_for, tags)

from .test_tool_templates import source

GEMMA4 = ("<|channel>thought", "<channel|>")
# a reply with a thinking block, in a shape a small model writes under a grammar
THINK = r'root ::= "<think>" [a-z ]{3,20} "</think>" [A-Z] [a-z ]{2,16} "."'
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.mark.parametrize("pieces, opened, tag, reasoning, content", [
    (["<|chan", "nel>thought\nI r", "eason<chan", "nel|>", "Answer"], False, GEMMA4, "I reason", "Answer"),
    (["<|channel>thought\n<channel|>", "Hi"], False, GEMMA4, "", "Hi"),
    (["<think>x</think>y"], False, GEMMA4, "", "<think>x</think>y"),      # another family's tags stay content
    (["thinking", " on<channel|>done"], True, GEMMA4, "thinking on", "done"),
])
def test_splitter_with_gemma4_tags(pieces, opened, tag, reasoning, content):
    sp = ReasoningSplitter(opened, tag)
    got = [sp.feed(p) for p in pieces] + [sp.flush()]
    assert "".join(r for r, _ in got).strip() == reasoning and "".join(c for _, c in got) == content
    assert split_reasoning("".join(pieces), opened, tag) == (reasoning, content)


def test_tags_and_when_to_split():
    assert tags(source("google-gemma-4-31B-it")) == GEMMA4
    assert tags(source("Qwen-Qwen2.5-7B-Instruct")) == ("<think>", "</think>")
    qwen = source("Qwen-Qwen2.5-7B-Instruct")           # no think tags in the template
    assert splitter_for(qwen, "...<|im_start|>assistant\n", "auto") is None
    assert splitter_for(qwen, "...<|im_start|>assistant\n", "deepseek") is not None
    opened = splitter_for(qwen, "...<|im_start|>assistant\n<think>\n", "auto")
    assert opened is not None and opened.opened
    assert splitter_for(source("google-gemma-4-31B-it"), "<|turn>model\n", "none") is None
    sp = splitter_for(source("google-gemma-4-31B-it"), "<|turn>model\n", None)
    assert sp.tags == GEMMA4 and sp.split("<|channel>thought\nhm<channel|>Yes.") == ("hm", "Yes.")


def test_field_checks():
    assert check_reasoning_format(None) == "auto" and check_reasoning_format("none") == "none"
    with pytest.raises(ValueError, match="reasoning_format"):
        check_reasoning_format("yes")
    assert check_template_kwargs(None) == {}
    assert check_template_kwargs({"enable_thinking": False, "x": [1]}) == {"enable_thinking": False, "x": [1]}
    for bad, says in [([1], "object"), ({"not an identifier": 1}, "object"), ({"messages": []}, "messages"),
                      ({"enable_thinking": "false"}, "boolean")]:
        with pytest.raises(ValueError, match=says):
            check_template_kwargs(bad)


# a template that shows its kwargs in the prompt and has think tags (so "auto" splits)
KW_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
               "<|im_start|>assistant\n{% if enable_thinking is defined and not enable_thinking %}"
               "<think>\n\n</think>\n\n{% endif %}{{ prefix | default('') }}")


@pytest.mark.slow
def test_api_reasoning_format_and_template_kwargs():
    from llampy.llama.api import Llama
    llm = Llama(None, n_ctx=512, chat_template=KW_TEMPLATE)
    kw = dict(max_tokens=48, temperature=1.0, seed=5, grammar=THINK)
    m = llm.create_chat_completion(ASK, **kw)["choices"][0]["message"]         # auto: the template has <think>
    assert m["reasoning_content"] and "<think>" not in m["content"] and m["content"].endswith(".")
    chunks = list(llm.create_chat_completion(ASK, stream=True, **kw))
    deltas = [c["choices"][0]["delta"] for c in chunks]
    assert "".join(d.get("reasoning_content", "") for d in deltas).strip() == m["reasoning_content"]
    assert "".join(d.get("content", "") for d in deltas) == m["content"]
    kept = llm.create_chat_completion(ASK, reasoning_format="none", **kw)["choices"][0]["message"]
    assert kept["content"].startswith("<think>") and "reasoning_content" not in kept
    # the kwargs reach the template: its prompt grows by what they add
    n = llm.create_chat_completion(ASK, max_tokens=1)["usage"]["prompt_tokens"]
    off = llm.create_chat_completion(ASK, max_tokens=1, chat_template_kwargs={"enable_thinking": False})
    longer = llm.create_chat_completion(ASK, max_tokens=1, chat_template_kwargs={"prefix": "Well, let me see"})
    assert off["usage"]["prompt_tokens"] > n and longer["usage"]["prompt_tokens"] > n
    for bad in ({"reasoning_format": "yes"}, {"chat_template_kwargs": {"enable_thinking": "no"}},
                {"chat_template_kwargs": {"add_generation_prompt": False}}):
        with pytest.raises(ValueError):
            llm.create_chat_completion(ASK, max_tokens=1, **bad)
