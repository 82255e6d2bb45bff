"""`llampy embed` (llama.cpp's llama-embedding): embeddings of one or more prompts, pooled as the model's
pooling_type says (or --pooling), normalised as --embd-normalize says; with rank pooling, the reranker's scores.
``llampy.cli`` wires it in."""
from __future__ import annotations

import json
import sys

import numpy as np


def add_embed_parser(sub) -> None:
    p = sub.add_parser("embed", help="embeddings of prompts (llama-embedding)")
    p.add_argument("model", nargs="?", default=None, help="GGUF path, or 'smollm2' (default) / 'gemma3'")
    p.add_argument("-p", "--prompt", required=True, help="the text; several prompts split by --embd-separator")
    p.add_argument("--embd-separator", default="\n", help="what separates prompts (default: a newline)")
    p.add_argument("--pooling", choices=["none", "mean", "cls", "last", "rank"], default=None,
                   help="default: the file's pooling_type (an encoder's), else mean")
    p.add_argument("--embd-normalize", type=int, default=2,
                   help="-1 none, 0 max absolute (int16 scale), 1 taxicab, 2 euclidean (default), >2 p-norm")
    p.add_argument("--embd-output-format", choices=["", "json", "json+", "array"], default="",
                   help="'' lines of numbers (default), 'json' OpenAI's shape, 'json+' with the cosine similarity "
                        "matrix, 'array' a JSON array of arrays")
    p.add_argument("-c", "--ctx-size", type=int, default=0, help="default: the model's training context, at most 4096")
    p.add_argument("-t", "--threads", type=int, default=None)
    p.set_defaults(func=cmd_embed)


def normalize(v: np.ndarray, mode: int) -> np.ndarray:
    """common_embd_normalize: -1 none, 0 max absolute scaled to int16, 1 taxicab, 2 euclidean, >2 p-norm."""
    v = np.asarray(v, np.float64)
    if mode < 0:
        return v
    if mode == 0:
        s = np.abs(v).max() / 32760.0
    elif mode == 2:
        s = np.sqrt((v * v).sum())
    else:
        s = (np.abs(v) ** mode).sum() ** (1.0 / mode)
    return v / s if s > 0 else v * 0.0


def cmd_embed(args) -> int:
    from .llama.batch import Batch
    from .llama.context import Context, ContextError
    from .llama.model import Model
    from .models import resolve_model
    model = Model(resolve_model(args.model), n_threads=args.threads)
    hp = model.hparams
    pooling = args.pooling or getattr(hp, "pooling_type", None)
    pooling = pooling if pooling in ("none", "mean", "cls", "last", "rank") else "mean"
    n_ctx = args.ctx_size or min(hp.n_ctx_train or 4096, 4096)
    prompts = args.prompt.split(args.embd_separator) if args.embd_separator else [args.prompt]
    ctx = Context(model, n_ctx=n_ctx, n_batch=n_ctx, n_ubatch=n_ctx, embeddings=True, pooling=pooling)
    out = []      # one vector per prompt (pooled), or per token (pooling none)
    for text in prompts:
        toks = model.vocab.tokenize(text, add_special=True, parse_special=True)
        if not toks:
            raise ContextError("cannot embed an empty prompt")
        if len(toks) > n_ctx:
            raise ContextError(f"a prompt has {len(toks)} tokens, more than the context ({n_ctx}); use a larger -c")
        ctx.kv_clear()
        ctx.decode(Batch.from_tokens(toks, logits_all=True))
        if pooling == "none":
            out += [ctx.get_embeddings_ith(i) for i in range(len(toks))]
        else:
            out.append(ctx.get_embeddings_seq(0))
    if pooling == "rank":     # llama-embedding prints the scores as they are
        for i, v in enumerate(out):
            print(f"rerank score {i}: {float(v[0]):8.3f}")
        return 0
    vecs = [normalize(v, args.embd_normalize) for v in out]
    fmt = args.embd_output_format
    if fmt == "":
        for i, v in enumerate(vecs):
            print(f"embedding {i}: " + " ".join(f"{x:9.6f}" for x in v))
    elif fmt == "array":
        print(json.dumps([[float(x) for x in v] for v in vecs]))
    else:
        res = {"object": "list", "data": [{"object": "embedding", "index": i, "embedding": [float(x) for x in v]}
                                          for i, v in enumerate(vecs)]}
        if fmt == "json+" and len(vecs) > 1:
            unit = [v / max(np.linalg.norm(v), 1e-12) for v in vecs]
            res["cosineSimilarity"] = [[float(a @ b) for b in unit] for a in unit]
        json.dump(res, sys.stdout)
        print()
    return 0
