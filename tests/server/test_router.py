"""Several models behind one server (--models-dir): tiny models of SmolLM2's vocabulary in a folder, routed by the
request's 'model', loaded on first use, unloaded by keep_alive, by --models-max and by /models/unload; through HTTP
on loopback and the openai client."""
from __future__ import annotations

import concurrent.futures as cf
import os
import time

import httpx
import pytest

from .conftest import SHARED, serve_in_thread

TINY = SHARED / "fixtures" / "tiny"
NAMES = ["qwen2-Q8_0", "qwen3-Q8_0", "granite-Q8_0"]


@pytest.fixture(scope="module")
def routed(tmp_path_factory):
    from llampy.server.app import Server, create_app
    from llampy.server.router import Router, RouterApp
    d = tmp_path_factory.mktemp("models")
    for n in NAMES:
        os.symlink(TINY / f"{n}.gguf", d / f"{n}.gguf")
    (d / "mmproj-x.gguf").write_bytes(b"not a model")          # a projector is not listed as a model
    router = Router(d, lambda p, name: Server(p, 2, 512, alias=name), create_app, keep_alive=60, models_max=2)
    url, uv, t = serve_in_thread(RouterApp(router))
    yield url, router
    uv.should_exit = True
    t.join(timeout=5)
    router.close()


def chat(url, model, text="Hello", **kw):
    return httpx.post(url + "/v1/chat/completions", timeout=120,
                      json={"model": model, "messages": [{"role": "user", "content": text}], "max_tokens": 4,
                            "temperature": 0, **kw})


def states(url) -> dict:
    return {m["id"]: m["status"]["value"] for m in httpx.get(url + "/v1/models", timeout=60).json()["data"]}


def unload_all(url) -> None:
    for name, st in states(url).items():
        if st == "loaded":
            assert httpx.post(url + "/models/unload", json={"model": name}, timeout=60).status_code == 200


def test_models_listed_loaded_on_use_and_routed(routed):
    url, router = routed
    unload_all(url)
    assert states(url) == {n: "unloaded" for n in NAMES}
    from openai import OpenAI
    client = OpenAI(base_url=url + "/v1", api_key="none")
    r = client.chat.completions.create(model="qwen2-Q8_0", messages=[{"role": "user", "content": "Hi"}],
                                       max_tokens=4, temperature=0)
    assert r.model == "qwen2-Q8_0" and r.usage.completion_tokens >= 1
    assert states(url)["qwen2-Q8_0"] == "loaded"
    # the same reply as the model gives served alone: the routing changes nothing
    from llampy.llama.api import Llama
    alone = Llama(str(TINY / "qwen2-Q8_0.gguf"), n_ctx=256).create_chat_completion(
        [{"role": "user", "content": "Hi"}], max_tokens=4, temperature=0)
    assert r.choices[0].message.content == alone["choices"][0]["message"]["content"]
    # GET routes name the model in the query
    props = httpx.get(url + "/props", params={"model": "qwen2-Q8_0"}, timeout=60).json()
    assert props["model_alias"] == "qwen2-Q8_0" and props["total_slots"] == 2


def test_several_models_under_load(routed):
    """8 concurrent chats spread over two models: all answered, both models loaded side by side."""
    url, router = routed
    with cf.ThreadPoolExecutor(8) as ex:
        rs = list(ex.map(lambda i: chat(url, NAMES[i % 2], f"Count to {i}"), range(8)))
    assert [r.status_code for r in rs] == [200] * 8
    assert [r.json()["model"] for r in rs] == [NAMES[i % 2] for i in range(8)]
    st = states(url)
    assert st["qwen2-Q8_0"] == st["qwen3-Q8_0"] == "loaded"


def test_models_max_unloads_the_least_recently_used(routed):
    url, router = routed
    # whatever was loaded before: the two most recently used of these three stay
    assert chat(url, "qwen3-Q8_0").status_code == 200
    assert chat(url, "qwen2-Q8_0").status_code == 200        # qwen3 is now the least recently used
    assert chat(url, "granite-Q8_0").status_code == 200
    st = states(url)
    assert st == {"qwen2-Q8_0": "loaded", "qwen3-Q8_0": "unloaded", "granite-Q8_0": "loaded"}


def test_keep_alive_and_unload(routed):
    url, router = routed
    assert chat(url, "granite-Q8_0", keep_alive=0).status_code == 200
    assert states(url)["granite-Q8_0"] == "unloaded"          # keep_alive 0: unloaded once the reply is sent
    assert chat(url, "qwen2-Q8_0", keep_alive="1s").status_code == 200
    t0 = time.time()
    while states(url)["qwen2-Q8_0"] == "loaded" and time.time() - t0 < 10:
        time.sleep(0.2)
    assert states(url)["qwen2-Q8_0"] == "unloaded"
    r = httpx.post(url + "/models/load", json={"model": "qwen3-Q8_0"}, timeout=120)
    assert r.status_code == 200 and states(url)["qwen3-Q8_0"] == "loaded"
    r = httpx.post(url + "/models/unload", json={"model": "qwen3-Q8_0"}, timeout=60)
    assert r.status_code == 200 and r.json()["unloaded"] and states(url)["qwen3-Q8_0"] == "unloaded"


def test_bad_model_requests(routed):
    url, _ = routed
    r = httpx.post(url + "/v1/chat/completions", json={"messages": [{"role": "user", "content": "Hi"}]})
    assert r.status_code == 400 and "'model' is required" in r.text
    r = chat(url, "no-such-model")
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
    r = chat(url, "mmproj-x")
    assert r.status_code == 404
    r = chat(url, "qwen2-Q8_0", keep_alive="soon")
    assert r.status_code == 400 and "keep_alive" in r.text
    r = httpx.post(url + "/v1/completions", content=b"{not json", headers={"content-type": "application/json"})
    assert r.status_code == 400
    r = httpx.get(url + "/props")
    assert r.status_code == 400 and "'model' is required" in r.text


def test_keep_alive_parsing():
    from llampy.server.oai import APIError
    from llampy.server.router import parse_keep_alive
    assert parse_keep_alive("5m") == 300 and parse_keep_alive("1h30m") == 5400 and parse_keep_alive(10) == 10
    assert parse_keep_alive("-1") == -1 and parse_keep_alive("2.5s") == 2.5 and parse_keep_alive(None) is None
    for bad in ("5 minutes", True, [], "m"):
        with pytest.raises(APIError):
            parse_keep_alive(bad)


def test_scan_models_names(tmp_path):
    from llampy.server.router import scan_models
    for f in ("a.gguf", "big-00001-of-00002.gguf", "big-00002-of-00002.gguf", "mmproj-a.gguf", "notes.txt"):
        (tmp_path / f).write_bytes(b"x")
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "b.gguf").write_bytes(b"x")
    assert sorted(scan_models(tmp_path)) == ["a", "b", "big"]


def test_list_show_ps_commands(routed, capsys):
    import json
    from llampy.cli import main
    url, router = routed
    assert chat(url, "qwen3-Q8_0", keep_alive=-1).status_code == 200
    assert main(["ps", "--url", url, "--json"]) == 0
    ps = json.loads(capsys.readouterr().out)
    q3 = [m for m in ps if m["id"] == "qwen3-Q8_0"]
    assert q3 and q3[0]["expires_at"] is None and q3[0]["meta"]["n_parallel"] == 2    # keep_alive -1: forever
    assert main(["ps", "--url", url]) == 0
    out = capsys.readouterr().out
    assert "qwen3-Q8_0" in out and "Forever" in out
    assert main(["list", "--models-dir", str(router.dir), "--json"]) == 0
    names = {m["name"] for m in json.loads(capsys.readouterr().out)}
    assert set(NAMES) <= names and "mmproj-x" not in names
    assert main(["show", "qwen3-Q8_0", "--models-dir", str(router.dir), "--json"]) == 0
    s = json.loads(capsys.readouterr().out)
    assert (s["architecture"], s["quantization"], s["context_length"], s["embedding_length"]) == \
        ("qwen3", "Q8_0", 256, 64)
    assert s["parameters"] == 3268992           # llama.cpp's llama_model_n_params on this file
    assert main(["show", "qwen3-Q8_0", "--models-dir", str(router.dir), "--template"]) == 0
    assert "<|im_start|>" in capsys.readouterr().out
    assert main(["show", "nothing-here", "--models-dir", str(router.dir)]) == 1
    assert main(["ps", "--url", "http://127.0.0.1:9"]) == 1


def test_memory_running_short_unloads_idle_models(routed, monkeypatch):
    """Below --models-max, a model is still unloaded (least recently used, idle) when the memory left would not
    hold the next one's file."""
    import llampy.server.router as rt
    url, router = routed
    unload_all(url)
    # keep_alive given: an earlier test's keep_alive 0 / 1s stays with a model until a request sets another
    assert chat(url, "qwen2-Q8_0", keep_alive=60).status_code == 200
    monkeypatch.setattr(rt, "_mem_available", lambda: router.mem_margin)     # less than any file + the margin
    assert chat(url, "qwen3-Q8_0", keep_alive=60).status_code == 200
    assert states(url) == {"qwen2-Q8_0": "unloaded", "qwen3-Q8_0": "loaded", "granite-Q8_0": "unloaded"}
    monkeypatch.undo()
    assert chat(url, "granite-Q8_0", keep_alive=60).status_code == 200    # memory enough again: two side by side
    st = states(url)
    assert st["qwen3-Q8_0"] == st["granite-Q8_0"] == "loaded"
