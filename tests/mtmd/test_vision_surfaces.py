"""Images through every surface, against llama.cpp's libmtmd on the tiny gemma3 projector (tests/fixtures/tiny_vision):
the server (the openai client with an image_url part; llama.cpp's multimodal_data on /completion; capabilities;
bad input as 400s while it keeps serving), the Python API (OpenAI content parts) and ``llampy run --image``.

The chat reference is llama.cpp's greedy continuation of the prompt the tiny model's template renders for one user
message [text, image] (make_tiny_vision.py's PROMPT_CHAT)."""
from __future__ import annotations

import base64
import json

import numpy as np
import pytest

pytest.importorskip("PIL")

from tests.mtmd.test_vision_gemma3 import HERE, LM, REF
from tests.server.conftest import serve_in_thread

MMPROJ = HERE / REF["mmproj"]
PNG = (HERE / "square32.png").read_bytes()
DATA_URL = "data:image/png;base64," + base64.b64encode(PNG).decode()
MESSAGES = [{"role": "user", "content": [{"type": "text", "text": "What is it?"},
                                         {"type": "image_url", "image_url": {"url": DATA_URL}}]}]


def _lm_or_skip():
    if not LM.exists():
        pytest.skip(f"{LM} not found (the shared tiny models)")


@pytest.fixture(scope="module")
def vision_server():
    _lm_or_skip()
    from llampy.server.app import Server, create_app
    server = Server(LM, n_parallel=1, n_ctx=256, mmproj=MMPROJ)
    url, uv, t = serve_in_thread(create_app(server))
    yield url, server
    uv.should_exit = True
    t.join(timeout=5)
    server.engine.stop()


def test_chat_with_an_image_through_the_openai_client(vision_server):
    openai = pytest.importorskip("openai")
    url, server = vision_server
    client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0)
    ref = REF["chat"]
    want = server.model.vocab.detokenize(ref["ids"])
    r = client.chat.completions.create(model="default", messages=MESSAGES, max_tokens=len(ref["ids"]), temperature=0,
                                       logprobs=True, top_logprobs=1)
    assert r.choices[0].message.content == want
    got_lp = [c.logprob for c in r.choices[0].logprobs.content]
    # the reference is an AVX2 build's; llampy's default float order is the AVX-512 build's (test_vision_gemma3's TOL)
    assert np.allclose(got_lp, [s["logprob"] for s in ref["steps"]], atol=0.1)
    n_enc = server.mtmd.n_encoded
    again = client.chat.completions.create(model="default", messages=MESSAGES, max_tokens=2, temperature=0)
    assert again.choices[0].message.content == server.model.vocab.detokenize(ref["ids"][:2])
    assert server.mtmd.n_encoded == n_enc          # the same bytes: not encoded again


def test_completion_with_multimodal_data(vision_server):
    import httpx
    url, server = vision_server
    gen = REF["generations"][0]
    body = {"prompt": {"prompt_string": gen["prompt"], "multimodal_data": [base64.b64encode(PNG).decode()]},
            "n_predict": len(gen["ids"]), "temperature": 0, "n_probs": 1, "cache_prompt": False}
    j = httpx.post(url + "/completion", json=body, timeout=120).json()
    assert [p["id"] for p in j["completion_probabilities"]] == gen["ids"]
    props = httpx.get(url + "/props").json()
    assert props["modalities"]["vision"] is True and props["media_marker"] == "<__media__>"
    assert "multimodal" in httpx.get(url + "/v1/models").json()["data"][0]["capabilities"]


@pytest.mark.parametrize("content,msg", [
    ([{"type": "image_url", "image_url": {"url": "data:image/png;base64," + base64.b64encode(b"hello").decode()}}],
     "failed to decode image"),
    ([{"type": "image_url", "image_url": {"url": "https://example.com/cat.png"}}], "remote image URLs are not fetched"),
    ([{"type": "text", "text": "<__media__> and"}, {"type": "image_url", "image_url": {"url": DATA_URL}}],
     "number of media markers in text (2) does not match number of images (1)"),
    ([{"type": "image_url", "image_url": {"url": "data:text/plain;base64,aGk="}}], "is not an image type"),
], ids=["not-an-image", "remote-url", "marker-count", "not-image-type"])
def test_bad_images_are_400s(vision_server, content, msg):
    import httpx
    url, _ = vision_server
    r = httpx.post(url + "/v1/chat/completions", json={"messages": [{"role": "user", "content": content}],
                                                        "max_tokens": 2}, timeout=60)
    assert r.status_code == 400 and msg in r.json()["error"]["message"]
    assert httpx.get(url + "/health").status_code == 200


def test_images_without_a_projector_are_400s_on_every_route():
    _lm_or_skip()
    from fastapi.testclient import TestClient
    from llampy.server.app import Server, create_app
    server = Server(LM, n_parallel=1, n_ctx=128, tune_process=False)
    try:
        c = TestClient(create_app(server))
        r = c.post("/v1/chat/completions", json={"messages": MESSAGES, "max_tokens": 2})
        assert r.status_code == 400 and "you may need to provide the mmproj" in r.json()["error"]["message"]
        r = c.post("/completion", json={"prompt": {"prompt_string": "<__media__>", "multimodal_data": [
            base64.b64encode(PNG).decode()]}, "n_predict": 2})
        assert r.status_code == 400 and "does not support multimodal requests" in r.json()["error"]["message"]
        assert c.get("/props").json()["modalities"]["vision"] is False
        assert c.get("/v1/models").json()["data"][0]["capabilities"] == ["completion"]
    finally:
        server.engine.stop()


def test_python_api_with_content_parts():
    _lm_or_skip()
    from llampy.llama.api import Llama
    llm = Llama(str(LM), n_ctx=256, n_batch=256, n_ubatch=256, mmproj_path=str(MMPROJ), tune_process=False)
    ref = REF["chat"]
    out = llm.create_chat_completion(MESSAGES, max_tokens=len(ref["ids"]), temperature=0)
    assert out["choices"][0]["message"]["content"] == llm.model.vocab.detokenize(ref["ids"])
    assert out["usage"]["prompt_tokens"] == ref["n_past"]
    plain = Llama(str(LM), n_ctx=256, tune_process=False)
    with pytest.raises(ValueError, match="image input needs a projector"):
        plain.create_chat_completion(MESSAGES, max_tokens=1)


def test_cli_run_with_images(capsys):
    _lm_or_skip()
    from llampy.cli import main
    gen = REF["generations"][3]                    # two images
    args = ["run", str(LM), "--mmproj", str(MMPROJ), "-p", gen["prompt"], "-n", str(len(gen["ids"])), "--temp", "0",
            "-c", "256", "--json"] + [a for n in gen["images"] for a in ("--image", str(HERE / n))]
    assert main(args) == 0
    assert json.loads(capsys.readouterr().out)["tokens"] == gen["ids"]
    assert main(["run", str(LM), "--image", str(HERE / "square32.png"), "-p", "x", "-n", "1"]) == 1
    assert "--image needs --mmproj" in capsys.readouterr().err
    assert main(["run", str(LM), "--mmproj", str(MMPROJ), "--image", str(HERE / "make_tiny_vision.py"), "-p", "x",
                 "-n", "1"]) == 1
    err = capsys.readouterr().err
    assert "failed to decode image" in err and err.count("\n") == 1


@pytest.mark.slow
def test_chat_page_attaches_an_image(vision_server, tmp_path):
    """The chat page in headless Chromium: the server has a projector, so the page offers an image button; the
    image goes as an image_url part, and the greedy reply is llama.cpp's (make_tiny_vision.py's PROMPT_CHAT)."""
    import os
    import shutil

    playwright = pytest.importorskip("playwright.sync_api")
    from tests.server.test_chat_page import ARGS, CHROMIUM
    if not shutil.which(CHROMIUM) and not os.path.exists(CHROMIUM):
        pytest.skip("no chromium: run scripts/system-deps.sh")
    url, server = vision_server
    ref = REF["chat"]
    want = server.model.vocab.detokenize(ref["ids"])
    with playwright.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=ARGS, headless=True)
        try:
            page = browser.new_page()
            errors = []
            page.on("pageerror", lambda e: errors.append(str(e)))
            page.goto(url + "/")
            page.wait_for_selector("#attach:not([hidden])", timeout=10_000)
            page.set_input_files("#image", str(HERE / "square32.png"))
            page.wait_for_selector("#attached:not([hidden])", timeout=10_000)
            page.click("summary")
            page.fill("#temperature", "0")
            page.fill("#max_tokens", str(len(ref["ids"])))
            page.fill("#msg", "What is it?")
            page.press("#msg", "Enter")
            page.wait_for_selector(".assistant[data-done='1']", timeout=120_000)
            reply = page.evaluate("document.querySelector('.assistant').textContent")
            classes = page.get_attribute(".assistant", "class")
            thumbs = page.locator(".user img").count()
            still_attached = page.is_visible("#attached")
        finally:
            browser.close()
    assert not errors and "error" not in classes, reply
    assert reply == want
    assert thumbs == 1 and not still_attached        # the image shows in the message and is sent once
