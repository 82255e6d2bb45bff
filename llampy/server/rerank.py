"""POST /rerank (also /v1/rerank, /reranking, /v1/reranking): llama-server's reranking. The Jina/Cohere request
shape ``{"query", "documents", "top_n"}`` answers ``{"model", "object": "list", "usage", "results": [{"index",
"relevance_score"}]}``; with ``"texts"`` instead of ``"documents"`` (Hugging Face TEI's shape) the answer is the
bare list of ``{"index", "score"}`` (with ``"text"`` when ``return_text`` is set). Results are sorted by score,
highest first, and cut to top_n. A document's score is the classification head's first output on
query + document, laid out as llama-server's format_prompt_rerank does."""
from __future__ import annotations

import asyncio

from fastapi import Request as HTTPRequest

from .oai import APIError

RERANK_PATHS = ("/rerank", "/v1/rerank", "/reranking", "/v1/reranking")
MAX_DOCUMENTS = 128


def add_sep(vocab, md: dict) -> bool:
    """llama.cpp's add_sep: on for WPM (BERT) and the roberta-style BPE pre-tokenizers, or as the file says."""
    if "tokenizer.ggml.add_sep_token" in md:
        return bool(md["tokenizer.ggml.add_sep_token"])
    return vocab.type == "wpm" or md.get("tokenizer.ggml.pre") in ("jina-v1-en", "jina-v2-code", "roberta-bpe")


def rerank_tokens(vocab, md: dict, query: str, doc: str) -> list[int]:
    """The tokens of one (query, document) pair (llama-server's format_prompt_rerank): the file's rerank template
    (tokenizer.chat_template.rerank, {query} and {document} replaced) when it has one, else
    [BOS] query [EOS] [SEP] document [EOS], each special token where the vocabulary adds it."""
    template = md.get("tokenizer.chat_template.rerank")
    if isinstance(template, str):
        prompt = template.replace("{query}", query).replace("{document}", doc)
        return vocab.tokenize(prompt, add_special=False, parse_special=True)
    eos = vocab.eos if vocab.eos is not None else vocab.sep
    out = [vocab.bos] if vocab.add_bos and vocab.bos is not None else []
    out += vocab.tokenize(query, add_special=False, parse_special=False)
    if vocab.add_eos and eos is not None:
        out.append(eos)
    if add_sep(vocab, md) and vocab.sep is not None:
        out.append(vocab.sep)
    out += vocab.tokenize(doc, add_special=False, parse_special=False)
    if vocab.add_eos and eos is not None:
        out.append(eos)
    return out


def add_rerank_routes(app, server) -> None:
    from .app import read_json

    async def rerank(http: HTTPRequest):
        body = await read_json(http)
        server.check_model(body)
        if not server.can_rank():
            raise APIError(501, "This model has no classification head for reranking: load a reranker (for example "
                                "a BERT cross-encoder with cls.output)", type="not_supported_error")
        query = body.get("query")
        if not isinstance(query, str):
            raise APIError(400, '"query" must be provided' if query is None else '"query" must be a string', "query")
        tei = "texts" in body
        docs = body.get("texts" if tei else "documents")
        if not isinstance(docs, list) or not docs or not all(isinstance(d, str) for d in docs):
            raise APIError(400, '"documents" must be a non-empty string array', "texts" if tei else "documents")
        if len(docs) > MAX_DOCUMENTS:
            raise APIError(400, f"{len(docs)} documents; one request ranks at most {MAX_DOCUMENTS}", "documents")
        top_n = body.get("top_n", len(docs))
        if isinstance(top_n, bool) or not isinstance(top_n, int) or top_n < 0:
            raise APIError(400, '"top_n" must be a non-negative integer', "top_n")
        vocab, md = server.model.vocab, server.model.metadata
        toks = [await asyncio.to_thread(rerank_tokens, vocab, md, query, d) for d in docs]
        for t in toks:
            if len(t) > server.rank_n_ctx():
                raise APIError(400, f"a query and document take {len(t)} tokens, more than {server.rank_n_ctx()}",
                               "documents", code="context_length_exceeded")
        scores = []
        for t in toks:     # one pair per engine job: generating slots get their steps in between
            scores += await asyncio.wrap_future(server.engine.run_job(lambda t=t: server.rank([t])))
        label = "score" if tei else "relevance_score"
        results = [{"index": i, label: s} for i, s in enumerate(scores)]
        if tei and body.get("return_text"):
            for r in results:
                r["text"] = docs[r["index"]]
        results.sort(key=lambda r: -r[label])
        results = results[:top_n]
        if tei:
            return results
        n = sum(len(t) for t in toks)
        return {"model": body.get("model") or server.model_id, "object": "list",
                "usage": {"prompt_tokens": n, "total_tokens": n}, "results": results}

    for path in RERANK_PATHS:
        app.post(path)(rerank)
