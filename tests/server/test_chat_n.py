"""/v1/chat/completions with n > 1, through the openai client: choice j is the reply a request with seed + j gets
alone; streamed choices arrive interleaved, each with its index, and add up to the whole replies."""
from __future__ import annotations

from openai import OpenAI

MSGS = [{"role": "user", "content": "Name a fruit."}]


def test_chat_n_choices_are_the_seeded_replies(server_url):
    client = OpenAI(base_url=server_url + "/v1", api_key="none")
    r = client.chat.completions.create(model="default", messages=MSGS, n=3, seed=7, temperature=0.9, max_tokens=8)
    assert [c.index for c in r.choices] == [0, 1, 2]
    for j, c in enumerate(r.choices):
        alone = client.chat.completions.create(model="default", messages=MSGS, seed=7 + j, temperature=0.9,
                                               max_tokens=8)
        assert c.message.content == alone.choices[0].message.content
        assert c.finish_reason == alone.choices[0].finish_reason
    assert r.usage.completion_tokens >= 3 and r.usage.prompt_tokens == alone.usage.prompt_tokens


def test_chat_n_streamed(server_url):
    client = OpenAI(base_url=server_url + "/v1", api_key="none")
    whole = client.chat.completions.create(model="default", messages=MSGS, temperature=0, max_tokens=8)
    texts, finish = {}, {}
    for ch in client.chat.completions.create(model="default", messages=MSGS, n=2, temperature=0, max_tokens=8,
                                             stream=True, stream_options={"include_usage": True}):
        for c in ch.choices:
            texts[c.index] = texts.get(c.index, "") + (c.delta.content or "")
            if c.finish_reason:
                finish[c.index] = c.finish_reason
        if ch.usage is not None:
            usage = ch.usage
    # greedy: both choices are the one reply
    assert texts == {0: whole.choices[0].message.content, 1: whole.choices[0].message.content}
    assert finish == {0: whole.choices[0].finish_reason, 1: whole.choices[0].finish_reason}
    assert usage.completion_tokens == 2 * whole.usage.completion_tokens
