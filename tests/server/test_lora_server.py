"""LoRA adapters in the server (llama-server's --lora, GET/POST /lora-adapters, a request's "lora"): greedy replies
against the same model decoded directly with and without the adapter, the server's scales changed at run time, and
requests of different scales decoded at once."""
from __future__ import annotations

import concurrent.futures as cf

import httpx
import numpy as np
import pytest

from .conftest import SHARED, serve_in_thread

MODEL = SHARED / "fixtures" / "tiny" / "qwen2-Q8_0.gguf"
PROMPT = [1, 5, 9, 13, 2, 7, 300, 400, 17, 12]
N = 8


def greedy(model, loras, n=N) -> list:
    from llampy.llama.batch import Batch
    from llampy.llama.context import Context
    ctx = Context(model, n_ctx=64)
    ctx.set_loras(loras)
    ctx.decode(Batch.from_tokens(PROMPT))
    out = []
    for i in range(n):
        t = int(np.argmax(ctx.get_logits_ith(-1)))
        out.append(t)
        ctx.decode(Batch.from_tokens([t], pos0=len(PROMPT) + i))
    return out


@pytest.fixture(scope="module")
def lora_server(tmp_path_factory):
    from llampy.llama.lora import LoraAdapter
    from llampy.server.app import Server, create_app
    from tests.llama.test_lora import random_pairs, write_lora
    path = write_lora(tmp_path_factory.mktemp("lora") / "a.gguf", "qwen2", random_pairs(MODEL, 4, 1, embd=False),
                      alpha=8.0)
    server = Server(MODEL, n_parallel=2, n_ctx=256, lora=[(path, 1.0)])
    want = {1.0: greedy(server.model, [(LoraAdapter(server.model, path), 1.0)]), 0.0: greedy(server.model, [])}
    assert want[1.0] != want[0.0]                  # the adapter changes the reply
    url, uv, t = serve_in_thread(create_app(server))
    yield url, server, path, want
    uv.should_exit = True
    t.join(timeout=5)
    server.engine.stop()


def complete(url, **kw) -> list:
    r = httpx.post(url + "/completion", json={"prompt": PROMPT, "n_predict": N, "temperature": 0, "ignore_eos": True,
                                              "return_tokens": True, **kw}, timeout=300)
    assert r.status_code == 200, r.text
    return r.json()["tokens"]


def test_scales_per_request_and_server_wide(lora_server):
    url, server, path, want = lora_server
    got = httpx.get(url + "/lora-adapters").json()
    assert got == [{"id": 0, "path": str(path), "scale": 1.0, "task_name": "", "prompt_prefix": ""}]
    assert complete(url) == want[1.0]
    assert complete(url, lora=[]) == want[1.0]                          # an empty list: the server's scales
    assert complete(url, lora=[{"id": 0, "scale": 0}]) == want[0.0]     # same prompt, cache of other scales
    assert complete(url, lora=[{"id": 0, "scale": 1.0}]) == want[1.0]
    r = httpx.post(url + "/lora-adapters", json=[{"id": 0, "scale": 0.0}])
    assert r.status_code == 200 and r.json() == {"success": True}
    assert httpx.get(url + "/lora-adapters").json()[0]["scale"] == 0.0
    assert complete(url) == want[0.0]
    assert httpx.post(url + "/lora-adapters", json=[{"id": 0, "scale": 1}]).status_code == 200
    assert complete(url) == want[1.0]


def test_requests_of_different_scales_at_once(lora_server):
    url, _, _, want = lora_server
    scales = [1.0, 0.0, 0.0, 1.0]
    with cf.ThreadPoolExecutor(4) as ex:
        got = list(ex.map(lambda s: complete(url, lora=[{"id": 0, "scale": s}], cache_prompt=False), scales))
    assert got == [want[s] for s in scales]


@pytest.mark.parametrize("route,body", [
    ("/completion", {"prompt": PROMPT, "lora": "x"}),
    ("/completion", {"prompt": PROMPT, "lora": [{"id": 3, "scale": 1}]}),
    ("/completion", {"prompt": PROMPT, "lora": [{"scale": 1}]}),
    ("/lora-adapters", {"id": 0, "scale": 1}),
    ("/lora-adapters", [{"id": 1, "scale": 1}]),
    ("/lora-adapters", [{"id": 0, "scale": "big"}]),
])
def test_bad_lora_fields(lora_server, route, body):
    url = lora_server[0]
    r = httpx.post(url + route, json=body, timeout=60)
    assert r.status_code == 400, r.text
    assert "lora" in r.text.lower() or "array" in r.text.lower() or "adapter" in r.text.lower()


def test_serve_refuses_bad_adapter_flags(tmp_path, capsys):
    from llampy.cli import main
    assert main(["serve", str(MODEL), "--lora", str(tmp_path / "none.gguf"), "--log-format", "none"]) == 2
    assert "not found" in capsys.readouterr().err
    assert main(["serve", str(MODEL), "--lora-scaled", str(MODEL), "big", "--log-format", "none"]) == 2
    assert "--lora-scaled" in capsys.readouterr().err
