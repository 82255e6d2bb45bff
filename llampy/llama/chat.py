"""Chat templates: the Jinja template a GGUF stores (`tokenizer.chat_template`), rendered the way Hugging Face's
`apply_chat_template` renders it, inside jinja2's immutable sandbox: a template is untrusted input, so attribute
escapes (`''.__class__.__mro__`), mutation of the messages, and oversized repetition raise ChatTemplateError
instead of running.

What a template sees, as in HF (and llama.cpp's common/chat.cpp): `messages`, `add_generation_prompt`, `tools`
(None when absent), `bos_token`, `eos_token`, `date_string` (today, as llama.cpp passes it), plus any extra
keyword; the helpers `raise_exception(msg)`, `strftime_now(fmt)`, `namespace`, the `tojson` filter with HF's
arguments (ensure_ascii=False, indent, separators, sort_keys), `{% break %}`/`{% continue %}`, and HF's
`{% generation %}` block; trim_blocks and lstrip_blocks on, as HF sets them.

`template_from_metadata` picks the template as llama.cpp does: an override (a built-in name, a name stored in the
file as `tokenizer.chat_template.<name>`, or Jinja source), else the file's default, else its `tool_use` variant,
else ChatML. When `tools` are passed and the file has a `tool_use` template, that one renders.
"""
from __future__ import annotations

import json
from datetime import datetime

from jinja2 import nodes
from jinja2.exceptions import SecurityError, TemplateError
from jinja2.ext import Extension
from jinja2.sandbox import ImmutableSandboxedEnvironment

# llama.cpp's fallback (common/chat.cpp CHATML_TEMPLATE_SRC)
CHATML = ("{%- for message in messages -%}\n"
          "  {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' -}}\n"
          "{%- endfor -%}\n"
          "{%- if add_generation_prompt -%}\n"
          "  {{- '<|im_start|>assistant\\n' -}}\n"
          "{%- endif -%}")

# Meta-Llama-3-Instruct's template
LLAMA3 = ("{% set loop_messages = messages %}{% for message in loop_messages %}{% set content = "
          "'<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n'+ message['content'] | trim + "
          "'<|eot_id|>' %}{% if loop.index0 == 0 %}{% set content = bos_token + content %}{% endif %}{{ content }}"
          "{% endfor %}{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}"
          "{% endif %}")

# Gemma 3 instruction-tuned models' template (the system turn is folded into the first user turn)
GEMMA = """{{ bos_token }}
{%- if messages[0]['role'] == 'system' -%}
    {%- if messages[0]['content'] is string -%}
        {%- set first_user_prefix = messages[0]['content'] + '\\n\\n' -%}
    {%- else -%}
        {%- set first_user_prefix = messages[0]['content'][0]['text'] + '\\n\\n' -%}
    {%- endif -%}
    {%- set loop_messages = messages[1:] -%}
{%- else -%}
    {%- set first_user_prefix = "" -%}
    {%- set loop_messages = messages -%}
{%- endif -%}
{%- for message in loop_messages -%}
    {%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}
        {{ raise_exception("Conversation roles must alternate user/assistant/user/assistant/...") }}
    {%- endif -%}
    {%- if (message['role'] == 'assistant') -%}
        {%- set role = "model" -%}
    {%- else -%}
        {%- set role = message['role'] -%}
    {%- endif -%}
    {{ '<start_of_turn>' + role + '\\n' + (first_user_prefix if loop.first else "") }}
    {%- if message['content'] is string -%}
        {{ message['content'] | trim }}
    {%- elif message['content'] is iterable -%}
        {%- for item in message['content'] -%}
            {%- if item['type'] == 'image' -%}
                {{ '<start_of_image>' }}
            {%- elif item['type'] == 'text' -%}
                {{ item['text'] | trim }}
            {%- endif -%}
        {%- endfor -%}
    {%- else -%}
        {{ raise_exception("Invalid content type") }}
    {%- endif -%}
    {{ '<end_of_turn>\\n' }}
{%- endfor -%}
{%- if add_generation_prompt -%}
    {{'<start_of_turn>model\\n'}}
{%- endif -%}
"""

BUILTIN = {"chatml": CHATML, "llama3": LLAMA3, "gemma": GEMMA}

MAX_REPEAT = 1 << 20        # the longest string/list a template may build with `*`
MAX_POW_EXP = 4096          # the largest integer exponent `**` may take
MAX_INT_BITS = 1 << 16      # the largest integer `*` and `**` may build (one such operation is not interruptible)


class ChatTemplateError(ValueError):
    """A chat template failed to parse or render, raised an exception itself, or tried something unsafe."""


def _raise_exception(msg):
    raise ChatTemplateError(f"chat template: {msg}")


def _tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    """HF's tojson: plain json.dumps (Jinja's own escapes <, >, & and ' for HTML, which corrupts prompts)."""
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt):
    return datetime.now().strftime(fmt)


class GenerationBlock(Extension):
    """HF's `{% generation %}...{% endgeneration %}` (it marks assistant tokens for training masks); rendering
    only needs the body."""

    tags = {"generation"}

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return nodes.Scope(body, lineno=lineno)


class _Sandbox(ImmutableSandboxedEnvironment):
    """HF's sandbox, plus a cap on `*` and `**` so a template cannot exhaust memory or time with one expression."""

    intercepted_binops = frozenset(["*", "**"])

    def unsafe_undefined(self, obj, attribute):
        # jinja2 returns an Undefined that only fails when used further (`{{ f.__globals__ }}` prints nothing);
        # an escape attempt should fail loudly at once
        raise SecurityError(f"access to attribute {attribute!r} of a {type(obj).__name__} is not allowed")

    def call_binop(self, context, operator, left, right):
        if operator == "*":
            for seq, n in ((left, right), (right, left)):
                if isinstance(seq, (str, list, tuple)) and isinstance(n, int) and len(seq) * n > MAX_REPEAT:
                    raise SecurityError(f"repetition would build {len(seq) * n} items (limit {MAX_REPEAT})")
            if isinstance(left, int) and isinstance(right, int) \
                    and abs(left).bit_length() + abs(right).bit_length() > MAX_INT_BITS:
                raise SecurityError(f"the product would have more than {MAX_INT_BITS} bits")
        elif (operator == "**" and isinstance(right, int) and isinstance(left, (int, float))
              and abs(right) > MAX_POW_EXP and abs(left) > 1):
            raise SecurityError(f"exponent {right} is too large (limit {MAX_POW_EXP})")
        elif (operator == "**" and isinstance(left, int) and isinstance(right, int) and right > 0
              and abs(left).bit_length() * right > MAX_INT_BITS):
            # ((9**4096)**4096)**4096: each exponent is small, the result is not
            raise SecurityError(f"the power would have more than {MAX_INT_BITS} bits")
        return super().call_binop(context, operator, left, right)


def _environment() -> _Sandbox:
    env = _Sandbox(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols", GenerationBlock])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env


class ChatTemplate:
    """One Jinja chat template with the model's BOS and EOS strings; `tool_use` is the variant used with tools."""

    def __init__(self, source: str, bos_token: str = "", eos_token: str = "", name: str | None = None,
                 tool_use: "ChatTemplate | None" = None):
        if not isinstance(source, str):
            raise ChatTemplateError(f"a chat template must be a string, not {type(source).__name__}")
        self.source, self.name = source, name
        self.bos_token, self.eos_token = bos_token, eos_token
        self.tool_use = tool_use
        try:
            self.template = _environment().from_string(source)
        except TemplateError as e:
            raise ChatTemplateError(f"chat template does not parse: {e}") from None

    def render(self, messages: list, add_generation_prompt: bool = True, tools=None, **extra) -> str:
        """The prompt text for `messages` (dicts with a 'role'), ending with the assistant's opening when
        add_generation_prompt. Extra keywords reach the template as variables (e.g. enable_thinking)."""
        if tools and self.tool_use is not None:
            return self.tool_use.render(messages, add_generation_prompt, tools, **extra)
        if not isinstance(messages, (list, tuple)):
            raise ChatTemplateError("messages must be a list")
        for i, m in enumerate(messages):
            if not isinstance(m, dict) or not isinstance(m.get("role"), str):
                raise ChatTemplateError(f"message {i} must be an object with a string 'role'")
        ctx = {"date_string": datetime.now().strftime("%d %b %Y"), **extra}
        ctx.update(messages=list(messages), add_generation_prompt=add_generation_prompt, tools=tools,
                   bos_token=self.bos_token, eos_token=self.eos_token)
        try:
            return self.template.render(**ctx)
        except ChatTemplateError:
            raise
        except SecurityError as e:
            raise ChatTemplateError(f"chat template tried an unsafe operation: {e}") from None
        except TemplateError as e:
            raise ChatTemplateError(f"chat template failed: {e}") from None
        except RecursionError:
            raise ChatTemplateError("chat template failed: recursion too deep") from None
        except MemoryError:     # the caller's budget (server/render.py), not a fault of the messages
            raise
        except Exception as e:       # a template's own bug (None + str, bad index...): the caller's input error
            raise ChatTemplateError(f"chat template failed: {type(e).__name__}: {e}") from None

    def __repr__(self) -> str:
        return f"ChatTemplate(name={self.name!r}, {len(self.source)} chars)"


def _token_text(md: dict, key: str) -> str:
    tokens = md.get("tokenizer.ggml.tokens")
    i = md.get(key)
    if tokens is None or not isinstance(i, int) or isinstance(i, bool):
        return ""
    return str(tokens[int(i)]) if 0 <= int(i) < len(tokens) else ""


def template_names(md: dict) -> list:
    """The named templates a GGUF stores besides the default (`tokenizer.chat_template.<name>`)."""
    prefix = "tokenizer.chat_template."
    return sorted(k[len(prefix):] for k in md if k.startswith(prefix))


def _template_source(md: dict, key: str) -> str | None:
    """A template stored under `key`: a string, or None where the key is absent; any other type is the file's error."""
    src = md.get(key)
    if src is not None and not isinstance(src, str):
        raise ChatTemplateError(f"{key} in the model file is a {type(src).__name__}, not the template's text")
    return src


def template_from_metadata(md: dict, override: str | None = None) -> ChatTemplate:
    """The chat template for a model's metadata: `override` (a built-in name: chatml, llama3, gemma; a name stored
    in the file; or Jinja source), else the file's template, else its tool_use template, else ChatML."""
    bos = _token_text(md, "tokenizer.ggml.bos_token_id")
    eos = _token_text(md, "tokenizer.ggml.eos_token_id")
    tool_src = _template_source(md, "tokenizer.chat_template.tool_use")
    if override:
        if f"tokenizer.chat_template.{override}" in md:
            name, src = override, _template_source(md, f"tokenizer.chat_template.{override}")
        elif override in BUILTIN:
            name, src = override, BUILTIN[override]
        elif "{{" in override or "{%" in override:
            name, src = "override", override
        else:
            known = sorted(set(BUILTIN) | set(template_names(md)))
            raise ChatTemplateError(f"unknown chat template {override!r}: give Jinja source or one of {known}")
        return ChatTemplate(src, bos, eos, name=name)
    src = _template_source(md, "tokenizer.chat_template")
    if src:
        tool_use = ChatTemplate(tool_src, bos, eos, name="tool_use") if tool_src else None
        return ChatTemplate(src, bos, eos, name="default", tool_use=tool_use)
    if tool_src:
        return ChatTemplate(tool_src, bos, eos, name="tool_use")
    return ChatTemplate(CHATML, bos, eos, name="chatml")   # no template: ChatML, as llama.cpp falls back
