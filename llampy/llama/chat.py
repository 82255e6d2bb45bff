"""Chat templates: the Jinja template stored in the GGUF, rendered in jinja2's sandbox (a template is untrusted
input), with the helpers Hugging Face and llama.cpp templates expect."""
from __future__ import annotations

import json
from datetime import datetime

from jinja2 import TemplateError
from jinja2.exceptions import SecurityError
from jinja2.sandbox import ImmutableSandboxedEnvironment

BUILTIN = {
    "chatml": ("{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + "
               "'<|im_end|>' + '\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"),
    "llama3": ("{{ bos_token }}{% for message in messages %}{{ '<|start_header_id|>' + message['role'] + "
               "'<|end_header_id|>\n\n' + message['content'] | trim + '<|eot_id|>' }}{% endfor %}"
               "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}"),
    "gemma": ("{{ bos_token }}{% for message in messages %}{% set role = 'model' if message['role'] == 'assistant' "
              "else message['role'] %}{{ '<start_of_turn>' + role + '\n' + message['content'] | trim + "
              "'<end_of_turn>\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<start_of_turn>model\n' }}{% endif %}"),
}


class ChatTemplateError(ValueError):
    pass


def _raise(msg):
    raise ChatTemplateError(f"chat template: {msg}")


def _tojson(value, indent=None, ensure_ascii=False, sort_keys=False, separators=None):
    return json.dumps(value, indent=indent, ensure_ascii=ensure_ascii, sort_keys=sort_keys, separators=separators)


class ChatTemplate:
    def __init__(self, source: str, bos_token: str = "", eos_token: str = ""):
        self.source = source
        self.bos_token, self.eos_token = bos_token, eos_token
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                            extensions=["jinja2.ext.loopcontrols"])
        env.filters["tojson"] = _tojson
        env.globals["raise_exception"] = _raise
        env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
        try:
            self.template = env.from_string(source)
        except TemplateError as e:
            raise ChatTemplateError(f"chat template does not parse: {e}") from None

    def render(self, messages: list, add_generation_prompt: bool = True, tools=None, **extra) -> str:
        for m in messages:
            if not isinstance(m, dict) or "role" not in m:
                raise ChatTemplateError("each message must be an object with a 'role'")
        try:
            return self.template.render(messages=messages, add_generation_prompt=add_generation_prompt,
                                        bos_token=self.bos_token, eos_token=self.eos_token, tools=tools, **extra)
        except ChatTemplateError:
            raise
        except SecurityError as e:
            raise ChatTemplateError(f"chat template tried an unsafe operation: {e}") from None
        except TemplateError as e:
            raise ChatTemplateError(f"chat template failed: {e}") from None


def template_from_metadata(md: dict, override: str | None = None) -> ChatTemplate:
    tokens = md.get("tokenizer.ggml.tokens") or []

    def tok(key):
        i = md.get(key)
        return tokens[int(i)] if i is not None and 0 <= int(i) < len(tokens) else ""

    bos, eos = tok("tokenizer.ggml.bos_token_id"), tok("tokenizer.ggml.eos_token_id")
    if override:
        src = BUILTIN.get(override) or md.get(f"tokenizer.chat_template.{override}") or override
    else:
        src = md.get("tokenizer.chat_template") or BUILTIN["chatml"]   # no template: ChatML, as llama.cpp
    return ChatTemplate(src, bos, eos)
