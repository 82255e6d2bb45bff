"""llama.cpp's logits for a model file (and LoRA adapters), computed by libllama in a child process (the Python that
imports llama_cpp, tests/llamacpp.py), for tests that check llama.cpp reads files llampy writes."""
from __future__ import annotations

import json
import subprocess
import tempfile
from pathlib import Path

import numpy as np

from tests import llamacpp

_ORACLE = r'''
import ctypes, json, sys
import numpy as np
import llama_cpp as L
L.llama_backend_init()
req = json.load(sys.stdin)
mp = L.llama_model_default_params(); mp.n_gpu_layers = 0
model = L.llama_model_load_from_file(req["model"].encode(), mp)
if not model:
    json.dump({"error": "model load failed"}, sys.stdout); sys.exit(0)
cp = L.llama_context_default_params(); cp.n_ctx = req["n_ctx"]; cp.n_batch = req["n_ctx"]
cp.n_ubatch = req["n_ubatch"] or req["n_ctx"]; cp.type_k = req["type_k"]; cp.type_v = req["type_v"]
cp.n_threads = cp.n_threads_batch = 2
ctx = L.llama_init_from_model(model, cp)
if req["loras"]:
    ads = []
    for path, _ in req["loras"]:
        a = L.llama_adapter_lora_init(model, path.encode())
        if not a:
            json.dump({"error": "lora load failed: " + path}, sys.stdout); sys.exit(0)
        ads.append(a)
    arr = (L.llama_adapter_lora_p_ctypes * len(ads))(*ads)
    sc = (ctypes.c_float * len(ads))(*[s for _, s in req["loras"]])
    L.llama_set_adapters_lora(ctx, arr, len(ads), sc)
toks = req["tokens"]; n = len(toks)
b = L.llama_batch_init(n, 0, 1)
for i, t in enumerate(toks):
    b.token[i] = t; b.pos[i] = i; b.n_seq_id[i] = 1; b.seq_id[i][0] = 0; b.logits[i] = 1
b.n_tokens = n
if L.llama_decode(ctx, b) != 0:
    json.dump({"error": "decode failed"}, sys.stdout); sys.exit(0)
nv = L.llama_vocab_n_tokens(L.llama_model_get_vocab(model))
out = np.stack([np.ctypeslib.as_array(L.llama_get_logits_ith(ctx, i), shape=(nv,)).copy() for i in range(n)])
np.save(req["out"], out)
json.dump({"ok": True}, sys.stdout)
'''


def llamacpp_logits(model, tokens: list[int], loras=(), n_ctx: int = 256, type_k: int = 1, type_v: int = 1,
                    n_ubatch: int = 0) -> np.ndarray:
    """libllama's logits [n_tokens, n_vocab] for ``tokens`` decoded as one batch on the CPU; ``loras``: (path,
    scale) pairs applied with llama_set_adapters_lora; type_k / type_v: the KV cache's ggml types (F16 = 1);
    n_ubatch: the micro-batch size (0: the whole batch in one; 1: token by token, each a decode step). Skips (fails
    in CI) without llama.cpp's build; raises AssertionError when libllama refuses the file."""
    py = llamacpp.python()
    if py is None:
        llamacpp.missing("a Python with llama_cpp")
    with tempfile.TemporaryDirectory() as d:
        out = str(Path(d) / "logits.npy")
        req = {"model": str(model), "tokens": [int(t) for t in tokens], "n_ctx": n_ctx,
               "loras": [[str(p), float(s)] for p, s in loras], "out": out, "type_k": int(type_k),
               "type_v": int(type_v), "n_ubatch": int(n_ubatch)}
        r = subprocess.run([py, "-c", _ORACLE], input=json.dumps(req), capture_output=True, text=True, timeout=300)
        assert r.returncode == 0, r.stderr[-3000:]
        res = json.loads(r.stdout.strip().splitlines()[-1])
        assert "error" not in res, f"libllama: {res['error']}\n{r.stderr[-3000:]}"
        return np.load(out)


_TOKENIZE = r'''
import json, sys
import llama_cpp as L
L.llama_backend_init()
req = json.load(sys.stdin)
mp = L.llama_model_default_params(); mp.vocab_only = True
model = L.llama_model_load_from_file(req["model"].encode(), mp)
vocab = L.llama_model_get_vocab(model)
out = []
for t in req["texts"]:
    b = t.encode("utf-8"); n = 2 * len(b) + 8; buf = (L.llama_token * n)()
    r = L.llama_tokenize(vocab, b, len(b), buf, n, req["add_special"], req["parse_special"])
    out.append(list(buf[:r]))
json.dump(out, sys.stdout)
'''


def llamacpp_tokenize(model, texts: list[str], add_special: bool = True, parse_special: bool = False) -> list:
    """libllama's token ids for each text (llama_tokenize on a vocab-only load)."""
    py = llamacpp.python()
    if py is None:
        llamacpp.missing("a Python with llama_cpp")
    req = {"model": str(model), "texts": texts, "add_special": add_special, "parse_special": parse_special}
    r = subprocess.run([py, "-c", _TOKENIZE], input=json.dumps(req), capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout.strip().splitlines()[-1])
