"""llama-server's routes and fields on a real server on loopback: CORS, /props, /slots (save, restore, erase),
/infill and `suffix` (a tiny model given FIM tokens), /v1/completions with several prompts, n and echo,
/apply-template, and the sampling fields (honoured, or a 400 naming them)."""
from __future__ import annotations

import json

import httpx
import openai
import pytest

from tests.paths import TINY

from .conftest import N_CTX, N_PARALLEL, load_ref, serve_in_thread, sse_datas

REF = load_ref()


def post(url, path, body, **kw):
    return httpx.post(url + path, json=body, timeout=120, **kw)


def erase(url, sid):
    r = post(url, f"/slots/{sid}?action=erase", {})
    assert r.status_code == 200, r.text


# ---------------------------------------------------------------------------------------------------- CORS
def test_cors_localhost_by_default(server_url):
    r = httpx.get(server_url + "/health", headers={"Origin": "http://localhost:5173"})
    assert r.headers["access-control-allow-origin"] == "http://localhost:5173"
    r = httpx.get(server_url + "/health", headers={"Origin": "https://evil.example"})
    assert "access-control-allow-origin" not in r.headers
    pre = httpx.options(server_url + "/v1/chat/completions",
                        headers={"Origin": "http://127.0.0.1:3000", "Access-Control-Request-Method": "POST",
                                 "Access-Control-Request-Headers": "content-type, authorization"})
    assert pre.status_code == 204
    assert pre.headers["access-control-allow-origin"] == "http://127.0.0.1:3000"
    assert "POST" in pre.headers["access-control-allow-methods"]
    assert pre.headers["access-control-allow-headers"] == "content-type, authorization"
    no = httpx.options(server_url + "/v1/chat/completions",
                       headers={"Origin": "https://evil.example", "Access-Control-Request-Method": "POST"})
    assert no.status_code == 403 and "access-control-allow-origin" not in no.headers


def test_cors_configured_origins_and_preflight_before_the_api_key(llama_server):
    from llampy.server.app import create_app
    url, uv, t = serve_in_thread(create_app(llama_server, api_key="k3y",
                                            cors={"origins": "https://app.example, https://b.example"}))
    try:
        pre = httpx.options(url + "/v1/models", headers={"Origin": "https://b.example",
                                                         "Access-Control-Request-Method": "GET"})
        assert pre.status_code == 204 and pre.headers["access-control-allow-origin"] == "https://b.example"
        # the 401 of a request without the key still carries the header, so the page can read the error
        r = httpx.get(url + "/v1/models", headers={"Origin": "https://app.example"})
        assert r.status_code == 401 and r.headers["access-control-allow-origin"] == "https://app.example"
        r = httpx.get(url + "/v1/models", headers={"Origin": "http://localhost:1", "Authorization": "Bearer k3y"})
        assert r.status_code == 200 and "access-control-allow-origin" not in r.headers
    finally:
        uv.should_exit = True
        t.join(timeout=5)
    url, uv, t = serve_in_thread(create_app(llama_server, cors={"origins": "*"}))
    try:
        r = httpx.get(url + "/health", headers={"Origin": "https://any.example"})
        assert r.headers["access-control-allow-origin"] == "*"
    finally:
        uv.should_exit = True
        t.join(timeout=5)


# ----------------------------------------------------------------------------------------- props, slots
def test_props_and_slots(server_url):
    p = httpx.get(server_url + "/props").json()
    assert p["total_slots"] == N_PARALLEL and p["n_ctx"] == N_CTX
    assert p["default_generation_settings"]["n_ctx"] == N_CTX // N_PARALLEL
    assert p["default_generation_settings"]["params"]["temperature"] == 0.8
    assert "im_start" in p["chat_template"] and p["eos_token"] == "<|im_end|>" and p["n_threads"] >= 1
    assert p["infill"] is False
    slots = httpx.get(server_url + "/slots").json()
    assert [s["id"] for s in slots] == list(range(N_PARALLEL))
    assert all({"n_ctx", "is_processing", "n_cached", "params", "next_token"} <= set(s) for s in slots)


def test_slot_shows_its_request_while_processing(server_url):
    import threading
    body = {"prompt": "Count: one, two,", "n_predict": 24, "temperature": 0, "ignore_eos": True, "id_slot": 3,
            "top_k": 7}
    th = threading.Thread(target=post, args=(server_url, "/completion", body))
    th.start()
    seen = None
    for _ in range(200):
        s = httpx.get(server_url + "/slots").json()[3]
        if s["is_processing"]:
            seen = s
            break
        th.join(timeout=0.05)
    th.join()
    assert seen is not None and seen["params"]["top_k"] == 7 and seen["params"]["n_predict"] == 24


@pytest.fixture
def save_dir(llama_server, tmp_path):
    old = llama_server.slot_save_path
    llama_server.slot_save_path = tmp_path
    yield tmp_path
    llama_server.slot_save_path = old


def test_slot_save_restore_erase(server_url, save_dir):
    prompt = "The history of the printing press begins in the fifteenth century, when"
    first = post(server_url, "/completion", {"prompt": prompt, "n_predict": 8, "temperature": 0, "id_slot": 1,
                                             "cache_prompt": True}).json()
    assert first["id_slot"] == 1
    n_prompt = first["tokens_evaluated"]
    r = post(server_url, "/slots/1?action=save", {"filename": "press.bin"})
    assert r.status_code == 200, r.text
    saved = r.json()
    assert saved["n_saved"] == n_prompt + first["tokens_predicted"] - 1 and saved["n_written"] > 0
    assert (save_dir / "press.bin").stat().st_size == saved["n_written"]
    assert post(server_url, "/slots/1?action=erase", {}).json()["n_erased"] == saved["n_saved"]
    erase(server_url, 2)
    r = post(server_url, "/slots/2?action=restore", {"filename": "press.bin"})
    assert r.status_code == 200, r.text
    assert r.json()["n_restored"] == saved["n_saved"]
    # slot 2 now holds the prompt: it is reused, and the text is the same as computed from scratch
    again = post(server_url, "/completion", {"prompt": prompt, "n_predict": 8, "temperature": 0,
                                             "id_slot": 2}).json()
    assert again["tokens_cached"] == n_prompt - 1 and again["content"] == first["content"]
    # without cache_prompt the prompt is decoded whole (nothing reused), with the same result
    cold = post(server_url, "/completion", {"prompt": prompt, "n_predict": 8, "temperature": 0, "id_slot": 2,
                                            "cache_prompt": False}).json()
    assert cold["tokens_cached"] == 0 and cold["content"] == first["content"]
    for body, status in (({"filename": "../x"}, 400), ({"filename": "none.bin"}, 404), ({}, 400)):
        assert post(server_url, "/slots/0?action=restore", body).status_code == status
    assert post(server_url, "/slots/9?action=save", {"filename": "x.bin"}).status_code == 400
    assert post(server_url, "/slots/0?action=dance", {}).status_code == 400


def test_slot_files_need_a_save_path(server_url):
    r = post(server_url, "/slots/0?action=save", {"filename": "x.bin"})
    assert r.status_code == 501 and "--slot-save-path" in r.json()["error"]["message"]


# -------------------------------------------------------------------------------------------- completions
def test_completions_several_prompts_and_n(server_url):
    client = openai.OpenAI(base_url=server_url + "/v1", api_key="none", max_retries=0)
    g = REF["greedy"]
    one = client.completions.create(model="default", prompt=g[0]["prompt"], max_tokens=5, temperature=0)
    r = client.completions.create(model="default", prompt=[g[0]["prompt"], g[1]["prompt"]], max_tokens=5,
                                  temperature=0.9, seed=3, n=2)
    assert [c.index for c in r.choices] == [0, 1, 2, 3]
    assert r.usage.prompt_tokens == len(g[0]["prompt_ids"]) + len(g[1]["prompt_ids"])
    assert 4 <= r.usage.completion_tokens <= 4 * 5       # every choice generates, none past max_tokens
    # n choices of one prompt draw with their own seeds: seed 3 and 4
    again = client.completions.create(model="default", prompt=g[0]["prompt"], max_tokens=5, temperature=0.9,
                                      seed=4)
    assert r.choices[1].text == again.choices[0].text
    greedy = client.completions.create(model="default", prompt=[g[0]["prompt"], g[1]["prompt"]], max_tokens=5,
                                       temperature=0)
    assert greedy.choices[0].text == one.choices[0].text
    # token-id prompts, as lists
    ids = client.completions.create(model="default", prompt=[g[0]["prompt_ids"], g[1]["prompt_ids"]],
                                    max_tokens=5, temperature=0)
    assert [c.text for c in ids.choices] == [c.text for c in greedy.choices]


def test_completions_stream_several_choices(server_url):
    r = post(server_url, "/v1/completions", {"prompt": ["Hello", "Goodbye"], "max_tokens": 4, "temperature": 0,
                                             "stream": True, "logprobs": 1,
                                             "stream_options": {"include_usage": True}})
    datas = sse_datas(r.text.splitlines())
    assert datas[-1] == "[DONE]"
    chunks = [json.loads(d) for d in datas[:-1]]
    usage = chunks[-1]["usage"]
    by = {0: [], 1: []}
    for c in chunks[:-1]:
        for ch in c["choices"]:
            by[ch["index"]].append(ch)
    full = post(server_url, "/v1/completions", {"prompt": ["Hello", "Goodbye"], "max_tokens": 4,
                                                "temperature": 0, "logprobs": 1}).json()
    for k in (0, 1):
        assert "".join(ch["text"] for ch in by[k]) == full["choices"][k]["text"]
        lp = full["choices"][k]["logprobs"]
        streamed = [ch["logprobs"] for ch in by[k] if ch["logprobs"]]
        assert [x for s in streamed for x in s["text_offset"]] == lp["text_offset"]
        assert [x for s in streamed for x in s["tokens"]] == lp["tokens"]
    assert usage["completion_tokens"] == full["usage"]["completion_tokens"]


def test_echo_with_prompt_logprobs_is_llamacpps(server_url):
    """echo + logprobs + max_tokens 0 scores a text (as lm-eval-harness does): the log-prob of each prompt token
    after the ones before it. On a prompt followed by llama.cpp's greedy continuation, those are llama.cpp's."""
    g = REF["greedy"][0]
    ids = g["prompt_ids"] + g["ids"][:3]
    r = post(server_url, "/v1/completions", {"prompt": ids, "max_tokens": 0, "echo": True, "logprobs": 2})
    assert r.status_code == 200, r.text
    c = r.json()["choices"][0]
    lp = c["logprobs"]
    assert c["finish_reason"] == "length" and r.json()["usage"]["completion_tokens"] == 0
    assert len(lp["tokens"]) == len(ids) and lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    for got, step in zip(lp["token_logprobs"][-3:], g["steps"][:3]):
        assert got == pytest.approx(step["logprob"], abs=1e-3)
    assert all(len(t) == 2 for t in lp["top_logprobs"][1:])
    assert c["text"] == "".join(lp["tokens"]) and lp["text_offset"][0] == 0
    # echo of a text prompt: the prompt itself, then the completion
    r = post(server_url, "/v1/completions", {"prompt": g["prompt"], "max_tokens": 3, "echo": True,
                                             "temperature": 0}).json()
    plain = post(server_url, "/v1/completions", {"prompt": g["prompt"], "max_tokens": 3,
                                                 "temperature": 0}).json()
    assert r["choices"][0]["text"] == g["prompt"] + plain["choices"][0]["text"]
    s = post(server_url, "/v1/completions", {"prompt": g["prompt"], "max_tokens": 3, "echo": True,
                                             "temperature": 0, "stream": True})
    parts = [json.loads(d) for d in sse_datas(s.text.splitlines())[:-1]]
    assert parts[0]["choices"][0]["text"] == g["prompt"]
    assert "".join(p["choices"][0]["text"] for p in parts) == r["choices"][0]["text"]


def test_apply_template(server_url, llama_server):
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there"}]
    r = post(server_url, "/apply-template", {"messages": msgs})
    assert r.status_code == 200, r.text
    prompt = r.json()["prompt"]
    assert prompt.endswith("<|im_start|>assistant\n") and "Hi there" in prompt
    chat = post(server_url, "/v1/chat/completions", {"messages": msgs, "max_tokens": 1}).json()
    n = len(llama_server.model.vocab.tokenize(prompt, add_special=True, parse_special=True))
    assert chat["usage"]["prompt_tokens"] == n          # what the chat route fed the model
    bare = post(server_url, "/apply-template", {"messages": msgs, "add_generation_prompt": False}).json()
    assert prompt.startswith(bare["prompt"]) and not bare["prompt"].endswith("assistant\n")
    assert post(server_url, "/apply-template", {"messages": "hi"}).status_code == 400


# ------------------------------------------------------------------------------------------- sampling fields
def _complete(url, **kw):
    r = post(url, "/completion", {"prompt": "The capital of France is", "n_predict": 6, **kw})
    assert r.status_code == 200, r.text
    return r.json()


@pytest.mark.slow
def test_sampling_fields_are_honoured(server_url, llama_server):
    greedy = _complete(server_url, temperature=0, return_tokens=True)
    first = greedy["tokens"][0]
    # top-n-sigma with a tiny n keeps the top token only: greedy whatever the temperature
    assert _complete(server_url, temperature=1.5, top_n_sigma=0.001, seed=1)["content"] == greedy["content"]
    # XTC always on with a low threshold removes the most likely tokens: the first token changes
    xtc = _complete(server_url, temperature=0, xtc_probability=1.0, xtc_threshold=0.001, return_tokens=True)
    assert xtc["tokens"][0] != first
    # logit_bias: by id (false bans), by text, as pairs
    text = llama_server.model.vocab.detokenize([first])
    for bias in ({str(first): False}, {text: -100}, [[first, False]], [[text, -100.0]]):
        got = _complete(server_url, temperature=0, logit_bias=bias, return_tokens=True)
        assert got["tokens"][0] != first, bias
    # the samplers order: top_k 1 then temperature is greedy at any temperature; temperature alone is not
    order = _complete(server_url, temperature=2.0, top_k=1, samplers=["top_k", "temperature"], seed=5)
    assert order["content"] == greedy["content"]
    assert _complete(server_url, temperature=2.0, top_k=1, samplers="t", seed=5)["content"] != greedy["content"]
    # mirostat and DRY run (seeded: the same twice)
    for kw in ({"mirostat": 2, "mirostat_tau": 3.0}, {"mirostat": 1}, {"dry_multiplier": 0.8},
               {"typical_p": 0.5, "min_keep": 2, "dynatemp_range": 0.3}):
        a, b = (_complete(server_url, temperature=0.8, seed=9, **kw)["content"] for _ in range(2))
        assert a == b, kw


def test_ignore_eos_bans_end_of_generation_tokens(server_url, llama_server):
    """ignore_eos bans every end-of-generation token (llama-server's logit_bias_eog, -inf added to the request's
    biases): with a bias that makes the end tokens the likeliest, the reply is ordinary tokens to the limit, not end
    tokens sampled and then ignored."""
    eog = sorted(llama_server.model.vocab.eog)
    bias = [[t, 100.0] for t in eog]
    ends = _complete(server_url, temperature=0, logit_bias=bias)
    assert ends["stop_type"] == "eos" and ends["tokens_predicted"] == 0
    for temp in (0, 0.8):
        got = _complete(server_url, temperature=temp, seed=3, logit_bias=bias, ignore_eos=True, return_tokens=True)
        assert got["stop_type"] == "limit" and len(got["tokens"]) == 6 and not set(got["tokens"]) & set(eog), got


@pytest.mark.slow
def test_dry_breaks_a_loop(server_url):
    prompt = "one two three one two three one two three one two three"
    base = {"prompt": prompt, "n_predict": 24, "temperature": 0}
    plain = post(server_url, "/completion", base).json()["content"]
    dry = post(server_url, "/completion", {**base, "dry_multiplier": 2.0, "dry_allowed_length": 2}).json()["content"]
    assert plain.count("one two three") > dry.count("one two three")


@pytest.mark.parametrize("field, value", [
    ("top_n_sigma", "x"), ("xtc_probability", 1.5), ("xtc_threshold", -0.1), ("typical_p", "0.5"),
    ("mirostat", 3), ("mirostat_tau", "x"), ("dry_multiplier", -1), ("dry_allowed_length", 1.5),
    ("dry_penalty_last_n", -2), ("dry_sequence_breakers", []), ("dry_sequence_breakers", "\n"),
    ("samplers", ["top_k", "nonsense"]), ("samplers", "kq"), ("samplers", 5), ("min_keep", -1),
    ("repeat_last_n", -5), ("dynatemp_range", "wide"), ("logit_bias", {"1": "1"}),
    ("logit_bias", {"1": True}), ("id_slot", N_PARALLEL), ("cache_prompt", "yes"), ("timings_per_token", 1),
])
def test_bad_sampling_field_is_400_naming_it(server_url, field, value):
    body = json.dumps({"prompt": "Hi", "n_predict": 1, field: value}, allow_nan=True)
    r = httpx.post(server_url + "/completion", content=body, headers={"content-type": "application/json"})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == field


def test_non_finite_numbers_are_400(server_url):
    for body in ('{"prompt": "Hi", "n_predict": 1, "typical_p": NaN}',
                 '{"prompt": "Hi", "n_predict": 1, "logit_bias": {"1": -Infinity}}'):
        r = httpx.post(server_url + "/completion", content=body, headers={"content-type": "application/json"})
        assert r.status_code == 400, r.text


def test_timings_per_token(server_url):
    r = post(server_url, "/completion", {"prompt": "Hi", "n_predict": 3, "stream": True, "timings_per_token": True})
    parts = [json.loads(d) for d in sse_datas(r.text.splitlines())]
    assert all("timings" in p for p in parts)
    assert parts[-1]["stop"] and parts[-1]["timings"]["predicted_n"] == parts[-1]["tokens_predicted"]
    c = post(server_url, "/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3,
                                                  "stream": True, "timings_per_token": True})
    chunks = [json.loads(d) for d in sse_datas(c.text.splitlines())[:-1]]
    assert any("timings" in ch for ch in chunks)


# ------------------------------------------------------------------------------------ fill in the middle
@pytest.fixture(scope="module")
def fim_url(tmp_path_factory):
    """A tiny random starcoder2 (SmolLM2's vocabulary) told that three of its tokens are FIM_PRE/SUF/MID."""
    from llampy.gguf import GGUFReader, GGUFWriter
    from llampy.server.app import Server, create_app
    path = tmp_path_factory.mktemp("fim") / "fim.gguf"
    w = GGUFWriter.from_reader(GGUFReader(TINY / "starcoder2-Q8_0.gguf"), path)
    for k, v in (("prefix", 6), ("suffix", 7), ("middle", 8)):
        w.add(f"tokenizer.ggml.fim_{k[:3]}_token_id", v)
    w.write()
    server = Server(path, n_parallel=2, n_ctx=512)
    url, uv, t = serve_in_thread(create_app(server))
    yield url, server
    uv.should_exit = True
    t.join(timeout=5)
    server.engine.stop()


def test_infill_is_llama_servers_layout(fim_url):
    url, server = fim_url
    v = server.model.vocab
    assert (v.fim["fim_pre"], v.fim["fim_suf"], v.fim["fim_mid"]) == (6, 7, 8) and v.fim["fim_rep"] == 4
    pre, suf = "def add(a, b):\n    ", "\n    return c\n"

    def tok(s):
        return v.tokenize(s, add_special=False, parse_special=False)
    # llama-server's format_prompt_infill with a FIM_REP token and no FIM_SEP: the repo line, then
    # FIM_PRE prefix FIM_SUF suffix FIM_MID
    want = [4] + tok("myproject\n") + [6] + tok(pre) + [7] + tok(suf) + [8]
    r = post(url, "/infill", {"input_prefix": pre, "input_suffix": suf, "n_predict": 6, "temperature": 0,
                              "return_tokens": True})
    assert r.status_code == 200, r.text
    got = r.json()
    assert got["tokens_evaluated"] == len(want)
    same = post(url, "/completion", {"prompt": want, "n_predict": 6, "temperature": 0, "return_tokens": True})
    assert got["tokens"] == same.json()["tokens"] and got["content"] == same.json()["content"]
    # input_extra chunks (no FIM_SEP: llama-server's snippet separator) come before the prefix
    ex = post(url, "/infill", {"input_prefix": pre, "input_suffix": suf, "n_predict": 1, "temperature": 0,
                               "input_extra": [{"filename": "a.py", "text": "x = 1\n"}]}).json()
    assert ex["tokens_evaluated"] == len(want) + len(tok("\n\n--- snippet ---\n\n")) + len(tok("x = 1\n"))
    # OpenAI's suffix on /v1/completions is the same fill-in-the-middle prompt
    oa = post(url, "/v1/completions", {"prompt": pre, "suffix": suf, "max_tokens": 6, "temperature": 0}).json()
    assert oa["choices"][0]["text"] == got["content"] and oa["usage"]["prompt_tokens"] == len(want)
    for body, param in (({"input_suffix": suf}, "input_prefix"), ({"input_prefix": pre, "input_suffix": 3},
                                                                   "input_suffix"),
                        ({"input_prefix": pre, "input_suffix": suf, "input_extra": [{"text": 1}]}, "input_extra")):
        r = post(url, "/infill", body)
        assert r.status_code == 400 and r.json()["error"]["param"] == param


def test_infill_needs_fim_tokens(server_url):
    r = post(server_url, "/infill", {"input_prefix": "a", "input_suffix": "b"})
    assert r.status_code == 501 and "Infill is not supported" in r.json()["error"]["message"]
