"""A server on an encoder (the tiny BERT of tests/fixtures/tiny_more): /v1/embeddings through the openai client
gives llama.cpp's pooled embeddings, /v1/rerank (llama-server's Jina/Cohere and TEI shapes) the classification
head's scores, and generation routes are refused."""
from __future__ import annotations

import httpx
import numpy as np
import pytest

from llampy.server.rerank import rerank_tokens

from tests.llama.test_fidelity_tiny_more import tiny_more_model
from tests.server.conftest import serve_in_thread


@pytest.fixture(scope="module")
def bert_server():
    from llampy.server.app import Server, create_app
    path, ref = tiny_more_model("bert")
    server = Server(path, n_parallel=1, n_ctx=256)
    url, uv, t = serve_in_thread(create_app(server))
    yield url, server, ref
    uv.should_exit = True
    t.join(timeout=5)
    server.engine.stop()


def test_embeddings_through_the_openai_client(bert_server):
    openai = pytest.importorskip("openai")
    url, server, ref = bert_server
    client = openai.OpenAI(base_url=url + "/v1", api_key="none")
    texts = [p["prompt"] for p in ref["prompts"]]
    got = client.embeddings.create(model="default", input=texts)
    assert [d.index for d in got.data] == [0, 1, 2]
    for d, p in zip(got.data, ref["prompts"]):
        want = np.asarray(p["embeddings"]["mean"])       # the file's pooling_type is mean
        want /= np.linalg.norm(want)
        v = np.asarray(d.embedding)
        assert abs(np.linalg.norm(v) - 1) < 1e-5
        assert v @ want >= 1 - 1e-3
    assert got.usage.prompt_tokens == sum(len(p["prompt_ids"]) for p in ref["prompts"])


def test_rerank_jina_shape(bert_server):
    """Tokens and scores as llama.cpp's: each pair laid out as format_prompt_rerank ([CLS] query [SEP] document:
    WPM adds no EOS), scored by the rank-pooling head (make_tiny_more.py recorded them through libllama)."""
    url, server, ref = bert_server
    rr = ref["rerank"]
    query, docs = rr["query"], rr["documents"]
    toks = [rerank_tokens(server.model.vocab, server.model.metadata, query, d) for d in docs]
    assert toks == rr["tokens"]
    r = httpx.post(url + "/v1/rerank", json={"model": "default", "query": query, "documents": docs, "top_n": 2},
                   timeout=60)
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["object"] == "list" and len(body["results"]) == 2
    order = [int(i) for i in np.argsort(rr["scores"])[::-1][:2]]
    assert [x["index"] for x in body["results"]] == order
    for x in body["results"]:
        assert abs(x["relevance_score"] - rr["scores"][x["index"]]) < 1e-4
    assert body["usage"]["prompt_tokens"] == sum(len(t) for t in toks)


def test_rerank_tei_shape_and_errors(bert_server):
    url, server, ref = bert_server
    r = httpx.post(url + "/rerank", json={"query": "q", "texts": ["a", "b"], "return_text": True}, timeout=60)
    assert r.status_code == 200, r.text
    body = r.json()
    assert isinstance(body, list) and {x["text"] for x in body} == {"a", "b"} and "score" in body[0]
    assert httpx.post(url + "/v1/rerank", json={"documents": ["a"]}).status_code == 400
    assert httpx.post(url + "/v1/rerank", json={"query": "q", "documents": []}).status_code == 400


def test_generation_refused_on_an_encoder(bert_server):
    url, server, ref = bert_server
    r = httpx.post(url + "/v1/completions", json={"prompt": "hello", "max_tokens": 4}, timeout=60)
    assert r.status_code == 501, r.text
    assert "encoder" in r.json()["error"]["message"]


def test_rerank_refused_without_a_classification_head(server_url):
    r = httpx.post(server_url + "/v1/rerank", json={"query": "q", "documents": ["a"]}, timeout=60)
    assert r.status_code == 501 and "classification head" in r.json()["error"]["message"]


def test_rerank_with_a_decoder_reranker():
    """A Qwen3 Reranker-shaped model: the pairs through its rerank template, the score P(yes) as llama.cpp's."""
    from llampy.server.app import Server, create_app
    path, ref = tiny_more_model("qwen3-rerank")
    server = Server(path, n_parallel=1, n_ctx=256)
    url, uv, t = serve_in_thread(create_app(server))
    try:
        rr = ref["rerank"]
        r = httpx.post(url + "/v1/rerank", json={"query": rr["query"], "documents": rr["documents"]}, timeout=60)
        assert r.status_code == 200, r.text
        got = {x["index"]: x["relevance_score"] for x in r.json()["results"]}
        assert np.allclose([got[i] for i in range(len(rr["scores"]))], rr["scores"], atol=1e-4)
    finally:
        uv.should_exit = True
        t.join(timeout=5)
        server.engine.stop()
