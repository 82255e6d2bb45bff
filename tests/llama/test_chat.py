"""Chat templates from GGUF metadata, in jinja2's sandbox."""
from __future__ import annotations

import pytest

from llampy.gguf import GGUFReader
from llampy.llama.chat import ChatTemplate, ChatTemplateError, template_from_metadata

MSGS = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello!"}, {"role": "user", "content": "Name a color."}]


def test_smollm2_template_renders_chatml(smollm2_path):
    t = template_from_metadata(GGUFReader(smollm2_path).metadata)
    out = t.render(MSGS)
    assert out == ("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n"
                   "<|im_start|>assistant\nHello!<|im_end|>\n<|im_start|>user\nName a color.<|im_end|>\n"
                   "<|im_start|>assistant\n")
    assert not t.render(MSGS, add_generation_prompt=False).endswith("<|im_start|>assistant\n")


@pytest.mark.slow
def test_gemma3_template(gemma3_path):
    md = GGUFReader(gemma3_path).metadata
    assert "tokenizer.chat_template" not in md          # this file ships none: ChatML, as llama.cpp falls back
    assert template_from_metadata(md).render(MSGS[1:2]).startswith("<|im_start|>user")
    t = template_from_metadata(md, "gemma")
    out = t.render(MSGS[1:])
    assert out.startswith("<bos><start_of_turn>user\nHi<end_of_turn>\n<start_of_turn>model\nHello!")
    assert out.endswith("<start_of_turn>model\n")


def test_sandbox_and_raise_exception():
    with pytest.raises(ChatTemplateError, match="unsafe"):
        ChatTemplate("{{ ''.__class__.__mro__[1].__subclasses__() }}").render(MSGS)
    with pytest.raises(ChatTemplateError, match="roles must alternate"):
        ChatTemplate("{{ raise_exception('roles must alternate') }}").render(MSGS)
    assert ChatTemplate("{{ messages | tojson }}").render([{"role": "user", "content": "é"}]) == \
        '[{"role": "user", "content": "é"}]'


def test_override_and_fallback():
    assert template_from_metadata({}, "gemma").render(MSGS[1:2]).startswith("<start_of_turn>user")
    assert template_from_metadata({}).render(MSGS[1:2]) == "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
