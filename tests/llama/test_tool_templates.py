"""Tool calls with the real chat templates of Hermes 2 Pro, Qwen 2.5, Llama 3.1/3.2, Mistral Nemo, Mistral Small 3.2
and Gemma 4 (tests/fixtures/chat_templates, from llama.cpp's models/templates): the format each is given, the tools
rendered into its prompt, the parser reading back the calls the template itself writes into the history, the
model's own reply shapes, forced-call grammars, and the format's control tokens kept in the reply's text."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from llampy.llama.chat import ChatTemplate
from llampy.llama.grammar import Grammar
from llampy.llama.sampling import Candidates
from llampy.llama.tools import chat_plan, check_tools, detect_format, object_arguments, parse, plan
from llampy.llama.tools_gemma4 import parse_value

from .grammar_corpus import check_schema

TEMPLATES = Path(__file__).resolve().parents[1] / "fixtures" / "chat_templates"
FORMATS = {
    "NousResearch-Hermes-2-Pro-Llama-3-8B-tool_use": "hermes",
    "Qwen-Qwen2.5-7B-Instruct": "hermes",
    "meta-llama-Llama-3.1-8B-Instruct": "llama3",
    "meta-llama-Llama-3.2-3B-Instruct": "llama3",
    "mistralai-Mistral-Nemo-Instruct-2407": "mistral",
    "Mistral-Small-3.2-24B-Instruct-2506": "mistral",
    "google-gemma-4-31B-it": "gemma4",
}
TOOLS = [
    {"type": "function", "function": {
        "name": "get_weather", "description": "The current weather in a city",
        "parameters": {"type": "object", "properties": {
            "city": {"type": "string", "description": "The city's name", "maxLength": 20},
            "unit": {"type": "string", "description": "Degrees", "enum": ["celsius", "fahrenheit"]}},
            "required": ["city"], "additionalProperties": False}}},
    {"type": "function", "function": {
        "name": "add", "description": "Add two integers",
        "parameters": {"type": "object", "properties": {"a": {"type": "integer", "description": "first"},
                                                        "b": {"type": "integer", "description": "second"}},
                       "required": ["a", "b"], "additionalProperties": False}}},
]
PARAMS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
# what each family's model writes for a call of get_weather(city="Paris") (the shapes llama.cpp's tests parse)
REPLIES = {
    "NousResearch-Hermes-2-Pro-Llama-3-8B-tool_use":
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>',
    "Qwen-Qwen2.5-7B-Instruct": '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>',
    "meta-llama-Llama-3.1-8B-Instruct": '{"name": "get_weather", "parameters": {"city": "Paris"}}',
    "meta-llama-Llama-3.2-3B-Instruct": '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}}',
    "mistralai-Mistral-Nemo-Instruct-2407":
        '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}, "id": "a1B2c3D4e"}]',
    "Mistral-Small-3.2-24B-Instruct-2506": '[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}',
    "google-gemma-4-31B-it": '<|tool_call>call:get_weather{city:<|"|>Paris<|"|>}<tool_call|>',
}


def source(name: str) -> str:
    return (TEMPLATES / f"{name}.jinja").read_text()


def template(name: str) -> ChatTemplate:
    """The template as a GGUF holds it: Hermes 2 Pro's is its ``tool_use`` variant beside a ChatML default."""
    if name.endswith("-tool_use"):
        from llampy.llama.chat import CHATML
        return ChatTemplate(CHATML, "<s>", "</s>", tool_use=ChatTemplate(source(name), "<s>", "</s>"))
    return ChatTemplate(source(name), "<s>", "</s>")


def openai_call(name: str, args: dict, id: str = "a1B2c3D4e") -> dict:
    return {"id": id, "type": "function", "function": {"name": name, "arguments": json.dumps(args)}}


@pytest.fixture(scope="module")
def vocab(smollm2_path):
    from llampy.gguf import GGUFReader
    from llampy.llama.vocab import Vocab
    return Vocab.from_metadata(GGUFReader(smollm2_path).metadata)


@pytest.mark.parametrize("name", sorted(FORMATS))
def test_each_family_gets_its_format_and_object_arguments(name):
    src = source(name)
    assert detect_format(src) == FORMATS[name]
    assert object_arguments(src)        # every one of these reads earlier calls' arguments as an object


@pytest.mark.parametrize("name", sorted(FORMATS))
def test_tools_rendered_into_the_prompt(name):
    tmpl = template(name)
    tp, _ = chat_plan(tmpl, ASK, TOOLS, "auto")
    prompt = tmpl.render(tp.messages, tools=tp.tools)
    for t in TOOLS:
        f = t["function"]
        assert f["name"] in prompt and f["description"] in prompt, name
        for p in f["parameters"]["properties"].values():
            assert p["description"] in prompt, name
    assert "What is the weather in Paris?" in prompt
    fmt = FORMATS[name]
    if fmt == "hermes":
        assert "<tools>" in prompt and "</tools>" in prompt and "<tool_call>" in prompt
    elif fmt == "llama3":       # the tools go into the first user turn, as JSON
        assert '"name": "get_weather"' in prompt.split("<|start_header_id|>user<|end_header_id|>")[1]
    elif fmt == "mistral":
        listed = prompt.split("[AVAILABLE_TOOLS]")[1].split("[/AVAILABLE_TOOLS]")[0]
        assert [t["function"]["name"] for t in json.loads(listed)] == ["get_weather", "add"]
    else:                       # gemma4: declarations in Gemma's notation
        assert "<|tool>declaration:get_weather{description:<|\"|>The current weather in a city<|\"|>" in prompt
        decl = prompt.split("<|tool>declaration:add")[1].split("<tool|>")[0]
        assert parse_value(decl)[0]["parameters"]["required"] == ["a", "b"]
    none, _ = chat_plan(tmpl, ASK, TOOLS, "none")        # tool_choice none: the tools are not shown
    assert "get_weather" not in tmpl.render(none.messages, tools=none.tools)


def _written_by_template(tmpl: ChatTemplate, history: list, assistant: dict) -> str:
    """The text the template writes for ``assistant`` after ``history``, from where the generation prompt ends
    (less the empty thought Gemma 4's generation prompt adds, which a written turn does not have)."""
    prompt = tmpl.render(history, add_generation_prompt=True, tools=TOOLS)
    after = tmpl.render(history + [assistant], add_generation_prompt=False, tools=TOOLS)
    if not after.startswith(prompt):
        prompt = prompt.removesuffix("<|channel>thought\n<channel|>")
    assert after.startswith(prompt)
    return after[len(prompt):]


@pytest.mark.parametrize("name", sorted(FORMATS))
def test_parser_reads_the_calls_the_template_writes(name):
    """An earlier reply's calls, given as OpenAI sends them (arguments as JSON text), are written into the history
    by the real template in the family's format; the family's parser reads the same calls back from that text."""
    tmpl, fmt = template(name), FORMATS[name]
    one = [openai_call("get_weather", {"city": "Paris", "unit": "celsius"})]
    two = one + [openai_call("add", {"a": 2, "b": 40}, "Zz9Yy8Xx7")]
    for calls in ([one] if fmt == "llama3" else [one, two]):      # Llama 3.x's template refuses parallel calls
        history = chat_plan(tmpl, ASK + [{"role": "assistant", "content": None, "tool_calls": calls}], TOOLS,
                            "auto")[0].messages
        text = _written_by_template(tmpl, history[:-1], history[-1])
        _, got = parse(fmt, text)
        assert [(c.name, json.loads(c.arguments)) for c in got] == \
            [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls], (name, text)
        if fmt == "mistral":        # the ids the template wrote come back, so the next turn renders again
            assert [c.id for c in got] == [c["id"] for c in calls]


@pytest.mark.parametrize("name", sorted(FORMATS))
def test_model_reply_to_openai_calls_and_back_into_the_history(name):
    """A model's reply in the family's format becomes OpenAI tool_calls; those, with the tool's result, render
    into the next prompt (Mistral's templates accept only the 9-character ids the parser keeps or makes)."""
    tmpl, fmt = template(name), FORMATS[name]
    content, calls = parse(fmt, "Let me check. " + REPLIES[name] if fmt in ("hermes", "gemma4") else REPLIES[name])
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [("get_weather", {"city": "Paris"})]
    assert content == ("Let me check." if fmt in ("hermes", "gemma4") else "")
    if fmt == "mistral":
        assert len(calls[0].id) == 9 and calls[0].id.isalnum()
    msgs = ASK + [{"role": "assistant", "content": None, "tool_calls": [c.to_openai() for c in calls]},
                  {"role": "tool", "tool_call_id": calls[0].id, "name": "get_weather", "content": '{"temp": 21}'}]
    tp, _ = chat_plan(tmpl, msgs, TOOLS, "auto")
    prompt = tmpl.render(tp.messages, tools=tp.tools)
    assert "Paris" in prompt and "21" in prompt
    assert prompt.count("get_weather") >= 2          # declared, called


@pytest.mark.parametrize("fmt, text", [
    ("hermes", '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Par'),      # cut short
    ("mistral", '[TOOL_CALLS]get_weather[ARGS]{"city": '),
    ("gemma4", '<|tool_call>call:get_weather{city:<|"|>Paris'),
    ("gemma4", '<|tool_call>call:get_weather{city:Paris}<tool_call|>'),                  # a bare string
    ("gemma4", "The weather is fine."),
])
def test_malformed_or_partial_calls_stay_content(fmt, text):
    assert parse(fmt, text) == (text, [])


def test_gemma4_values():
    text = '{a:1,b:-2.5e3,c:<|"|>x, y: {z}<|"|>,d:[true,false,null,<|"|><|"|>],e:{},f:[]}'
    v, end = parse_value(text)
    assert end == len(text)
    assert v == {"a": 1, "b": -2500.0, "c": "x, y: {z}", "d": [True, False, None, ""], "e": {}, "f": []}
    content, calls = parse("gemma4", '<|tool_call>call:add{a:1,b:2}<tool_call|><|tool_call>call:get_weather'
                                     '{city:<|"|>Oslo<|"|>}<tool_call|>')
    assert content == "" and [(c.name, json.loads(c.arguments)) for c in calls] == \
        [("add", {"a": 1, "b": 2}), ("get_weather", {"city": "Oslo"})]


def _sample(vocab, grammar, seed, n=160):
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
    return toks, g


@pytest.mark.parametrize("name", sorted(FORMATS))
def test_forced_calls_parse_back_and_match_the_schema(vocab, name):
    """tool_choice required / a named tool: whatever the grammar lets random logits write parses back to a call
    of an allowed tool whose arguments satisfy its schema (Gemma's notation: enforced up to string lengths)."""
    src, fmt = source(name), FORMATS[name]
    tools, _ = check_tools(TOOLS)
    accepted = 0
    for choice in ("required", "add", "get_weather"):
        p = plan(src, ASK, tools, choice, vocab=vocab)
        assert p.format == fmt and p.grammar is not None
        for seed in range(4):
            toks, g = _sample(vocab, p.grammar, seed)
            if not g.is_accepting():        # random logits may wander into a long string; the grammar holds
                continue
            accepted += 1
            text = vocab.detokenize(toks, special=True)
            content, calls = parse(fmt, text)
            assert len(calls) == 1 and content == "", text
            assert choice == "required" or calls[0].name == choice
            schema = PARAMS[calls[0].name]
            if fmt == "gemma4":
                schema = json.loads(json.dumps(schema).replace('"maxLength": 20', '"maxLength": 1000'))
            check_schema(schema, calls[0].arguments)
    assert accepted >= 3, name


def _vocab_with_control(path, texts):
    """SmolLM2's vocabulary with ``texts`` appended as control tokens (as Mistral's and Gemma 4's markers are)."""
    from llampy.gguf import GGUFReader
    from llampy.llama.vocab import Vocab
    md = {k: v for k, v in GGUFReader(path).metadata.items() if k.startswith("tokenizer.")}
    md["tokenizer.ggml.tokens"] = list(md["tokenizer.ggml.tokens"]) + list(texts)
    md["tokenizer.ggml.token_type"] = np.concatenate([np.asarray(md["tokenizer.ggml.token_type"]),
                                                      np.full(len(texts), 3, dtype=np.int32)])
    return Vocab.from_metadata(md)


@pytest.mark.parametrize("name, markers", [
    ("mistralai-Mistral-Nemo-Instruct-2407", ["[TOOL_CALLS]"]),
    ("Mistral-Small-3.2-24B-Instruct-2506", ["[TOOL_CALLS]", "[ARGS]", "[CALL_ID]"]),
    ("google-gemma-4-31B-it", ["<|tool_call>", "<tool_call|>", '<|"|>', "<|channel>", "<channel|>"]),
])
def test_control_token_markers_are_kept_in_the_text(smollm2_path, name, markers):
    """Where the markers are control tokens, a forced call writes them as tokens, and the reply's text keeps
    them only through the plan's keep_tokens (llama.cpp's preserved tokens): without, nothing could be parsed."""
    from llampy.llama.vocab import StreamDecoder
    v = _vocab_with_control(smollm2_path, markers)
    ids = {v.token_to_id[m] for m in markers}
    tp, g = chat_plan(template(name), ASK, TOOLS, {"type": "function", "function": {"name": "add"}}, vocab=v)
    assert ids <= tp.keep_tokens
    for seed in range(6):
        toks, gr = _sample(v, g, seed)
        if gr.is_accepting():
            break
    assert gr.is_accepting() and set(toks) & ids

    def text(keep):
        dec = StreamDecoder(v, special=False, keep=keep)
        return "".join(dec.feed(t) for t in toks) + dec.flush()

    _, calls = tp.parse(text(tp.keep_tokens))
    assert len(calls) == 1 and calls[0].name == "add"
    check_schema(PARAMS["add"], calls[0].arguments)
    assert tp.parse(text(frozenset()))[1] == []
