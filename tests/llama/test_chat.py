"""Chat templates: the models' real templates, HF's helpers, llama.cpp's fallbacks, and the sandbox."""
from __future__ import annotations

import json

import pytest

from llampy.gguf import GGUFReader
from llampy.llama.chat import (BUILTIN, ChatTemplate, ChatTemplateError, template_from_metadata, template_names)

SYS_CONV = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
            {"role": "assistant", "content": "Hello!"}, {"role": "user", "content": "Name a color."}]

CHATML_TEXT = ("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n"
               "<|im_start|>assistant\nHello!<|im_end|>\n<|im_start|>user\nName a color.<|im_end|>\n")


@pytest.fixture(scope="module")
def smollm2_md(smollm2_path):
    return GGUFReader(smollm2_path).metadata


def test_smollm2_real_template_read_with_gguf_py(smollm2_path, smollm2_md):
    import gguf                                   # the oracle reader: the template text the file really holds
    src = gguf.GGUFReader(smollm2_path).fields["tokenizer.chat_template"].contents()
    assert smollm2_md["tokenizer.chat_template"] == src
    t = template_from_metadata(smollm2_md)
    assert t.source == src and (t.bos_token, t.eos_token) == ("<|im_start|>", "<|im_end|>")
    assert t.render(SYS_CONV) == CHATML_TEXT + "<|im_start|>assistant\n"
    assert t.render(SYS_CONV, add_generation_prompt=False) == CHATML_TEXT
    # without a system turn, SmolLM2's template adds its own
    assert t.render(SYS_CONV[1:2]) == ("<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by "
                                       "Hugging Face<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n"
                                       "<|im_start|>assistant\n")


def test_gemma3_falls_back_to_chatml_and_renders_its_own_format(gemma3_path):
    md = GGUFReader(gemma3_path).metadata
    assert "tokenizer.chat_template" not in md                  # this file ships none
    t = template_from_metadata(md)
    assert t.name == "chatml" and (t.bos_token, t.eos_token) == ("<bos>", "<eos>")
    assert t.render(SYS_CONV) == CHATML_TEXT + "<|im_start|>assistant\n"     # llama.cpp's fallback, same text
    g = template_from_metadata(md, "gemma")                     # Gemma 3's own template, built in
    assert g.render(SYS_CONV) == ("<bos><start_of_turn>user\nBe brief.\n\nHi<end_of_turn>\n"
                                  "<start_of_turn>model\nHello!<end_of_turn>\n"
                                  "<start_of_turn>user\nName a color.<end_of_turn>\n<start_of_turn>model\n")
    assert g.render(SYS_CONV, add_generation_prompt=False).endswith("Name a color.<end_of_turn>\n")
    parts = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "  What is it? "}]}]
    assert g.render(parts) == "<bos><start_of_turn>user\n<start_of_image>What is it?<end_of_turn>\n" \
                              "<start_of_turn>model\n"
    with pytest.raises(ChatTemplateError, match="Conversation roles must alternate"):
        g.render([{"role": "user", "content": "a"}, {"role": "user", "content": "b"}])


def test_builtin_llama3():
    t = ChatTemplate(BUILTIN["llama3"], bos_token="<|begin_of_text|>")
    assert t.render(SYS_CONV[:2]) == ("<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nBe brief."
                                      "<|eot_id|><|start_header_id|>user<|end_header_id|>\n\nHi<|eot_id|>"
                                      "<|start_header_id|>assistant<|end_header_id|>\n\n")


SANDBOX_ESCAPES = [
    "{{ ''.__class__.__mro__[1].__subclasses__() }}",
    "{{ ''.__class__.__mro__ }}",
    "{{ raise_exception.__globals__ }}",
    "{{ cycler.__init__.__globals__.os.system('touch {marker}') }}",
    "{{ self.__init__.__globals__ }}",
    "{% set _ = messages.append({'role': 'x'}) %}",               # the messages are immutable
    "{% set _ = messages[0].update({'role': 'x'}) %}",
    "{{ 'a' * 100000000 }}",                                      # memory exhaustion
    "{{ 7 ** 100000000 }}",
    "{% for i in range(1000000000) %}{% endfor %}",
]


@pytest.mark.parametrize("src", SANDBOX_ESCAPES)
def test_sandbox_escapes_raise_clear_errors(src, tmp_path):
    marker = tmp_path / "pwned"
    msgs = [{"role": "user", "content": "x"}]
    with pytest.raises(ChatTemplateError, match="chat template"):
        ChatTemplate(src.replace("{marker}", str(marker))).render(msgs)
    assert not marker.exists()
    assert msgs == [{"role": "user", "content": "x"}]


def test_raise_exception_and_template_bugs_surface_as_errors():
    with pytest.raises(ChatTemplateError, match="roles must alternate"):
        ChatTemplate("{{ raise_exception('roles must alternate') }}").render(SYS_CONV)
    with pytest.raises(ChatTemplateError, match="does not parse"):
        ChatTemplate("{% for m in messages %}")
    with pytest.raises(ChatTemplateError, match="TypeError"):
        ChatTemplate("{{ messages[0].content + 1 }}").render(SYS_CONV)
    with pytest.raises(ChatTemplateError, match="role"):
        ChatTemplate("x").render([{"content": "no role"}])


def test_hf_helpers():
    t = ChatTemplate("{{ messages | tojson }}|{{ {'b': '<é>', 'a': 1} | tojson(indent=2, sort_keys=True) }}")
    out = t.render([{"role": "user", "content": "é <b> & 'q'"}])
    left, right = out.split("|")
    assert left == '[{"role": "user", "content": "é <b> & \'q\'"}]'        # no \\u escapes, no HTML escaping
    assert right == json.dumps({"a": 1, "b": "<é>"}, indent=2, ensure_ascii=False)
    ns = ("{% set ns = namespace(n=0) %}{% for m in messages %}{% if m.role == 'user' %}{% set ns.n = ns.n + 1 %}"
          "{% endif %}{% if loop.index > 3 %}{% break %}{% endif %}{% if m.role == 'system' %}{% continue %}"
          "{% endif %}{{ m.role[0] }}{% endfor %}{{ ns.n }}")
    assert ChatTemplate(ns).render(SYS_CONV) == "ua2"
    assert ChatTemplate("{{ strftime_now('%Y') | int > 2000 }}").render([]) == "True"
    assert ChatTemplate("{% generation %}{{ 'gen' }}{% endgeneration %}").render([]) == "gen"
    assert ChatTemplate("{{ tools | tojson }},{{ date_string != '' }},{{ flag }}").render(
        [], tools=None, flag=7) == "null,True,7"


def test_trim_and_lstrip_blocks_as_hf():
    src = ("{% for m in messages %}\n"
           "    {% if m.role == 'user' %}\n"
           "U:{{ m.content }}\n"
           "    {% endif %}\n"
           "{% endfor %}\n")
    assert ChatTemplate(src).render(SYS_CONV) == "U:Hi\nU:Name a color.\n"


def test_named_templates_tool_use_and_overrides():
    tokens = ["<unk>", "<s>", "</s>"]
    md = {"tokenizer.ggml.tokens": tokens, "tokenizer.ggml.bos_token_id": 1, "tokenizer.ggml.eos_token_id": 2,
          "tokenizer.chat_template": "{{ bos_token }}default:{{ messages | length }}{{ eos_token }}",
          "tokenizer.chat_template.tool_use": "tools:{{ tools | map(attribute='name') | join(',') }}",
          "tokenizer.chat_template.rag": "rag"}
    assert template_names(md) == ["rag", "tool_use"]
    t = template_from_metadata(md)
    assert t.render(SYS_CONV) == "<s>default:4</s>"
    assert t.render(SYS_CONV, tools=[{"name": "f"}, {"name": "g"}]) == "tools:f,g"
    assert template_from_metadata(md, "rag").render([]) == "rag"
    assert template_from_metadata(md, "gemma").render(SYS_CONV[1:2]).startswith("<s><start_of_turn>user\nHi")
    assert template_from_metadata(md, "{{ 'src' }}").render([]) == "src"
    with pytest.raises(ChatTemplateError, match="unknown chat template 'chatm'"):
        template_from_metadata(md, "chatm")
    only_tools = {k: v for k, v in md.items() if k != "tokenizer.chat_template"}
    assert template_from_metadata(only_tools).name == "tool_use"     # llama.cpp prefers it over ChatML
    assert template_from_metadata({}).render(SYS_CONV[1:2]) == "<|im_start|>user\nHi<|im_end|>\n" \
                                                                "<|im_start|>assistant\n"


@pytest.mark.parametrize("value", [[], ["{{ x }}"], 7])
def test_template_of_another_type_in_the_file_is_the_files_error(value):
    """A file whose tokenizer.chat_template is not a string (a fuzzed or broken converter's file) is refused by name."""
    import numpy as np
    md = {"tokenizer.chat_template": np.array(value) if isinstance(value, list) else value,
          "tokenizer.ggml.tokens": ["<s>", "</s>"], "tokenizer.ggml.bos_token_id": np.uint32(0)}
    with pytest.raises(ChatTemplateError, match="tokenizer.chat_template in the model file is a"):
        template_from_metadata(md)
