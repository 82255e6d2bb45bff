"""llampy imatrix: the sums of squared activations against libllama's own (collected in a child process through
llama.cpp's eval callback, as llama-imatrix collects them), the file llama-quantize reads, and the legacy format."""
from __future__ import annotations

import json
import subprocess
import tempfile
from pathlib import Path

import numpy as np
import pytest

from llampy.cli import main
from llampy.llama.imatrix import IMatrix, compute_imatrix, read_imatrix, write_imatrix_legacy
from llampy.llama.model import Model
from tests import llamacpp
from tests.paths import ROOT

TINY = ROOT.parent / "shared" / "fixtures" / "tiny"
MODEL = TINY / "llama-F32.gguf"
TEXT = TINY / "seed004_first6000.txt"

# collect_imatrix (tools/imatrix) for MUL_MAT over blk.* weights with at least 16 rows, in Python over ctypes
_ORACLE = r'''
import ctypes as C, json, sys
import numpy as np
import llama_cpp as L
class T(C.Structure):
    pass
T._fields_ = [("type", C.c_int), ("buffer", C.c_void_p), ("ne", C.c_int64 * 4), ("nb", C.c_size_t * 4),
              ("op", C.c_int), ("op_params", C.c_int32 * 16), ("flags", C.c_int32), ("src", C.POINTER(T) * 10),
              ("view_src", C.c_void_p), ("view_offs", C.c_size_t), ("data", C.c_void_p), ("name", C.c_char * 64),
              ("extra", C.c_void_p), ("padding", C.c_char * 8)]
gb = C.CDLL(req_lib := sys.argv[1])
gb.ggml_op_name.restype = C.c_char_p; gb.ggml_op_name.argtypes = [C.c_int]
stats = {}
@L.ggml_backend_sched_eval_callback
def cb(tp, ask, ud):
    t = C.cast(tp, C.POINTER(T)).contents
    if gb.ggml_op_name(t.op) != b"MUL_MAT":
        return False
    w, x = t.src[0].contents, t.src[1].contents
    name = w.name.decode()
    if ask:
        return x.ne[1] >= 16 and x.type == 0 and name.startswith("blk.")
    ne0, rows = x.ne[0], x.ne[1] * x.ne[2] * x.ne[3]
    a = np.ctypeslib.as_array(C.cast(x.data, C.POINTER(C.c_float)), shape=(rows, ne0))
    acc = stats.setdefault(name, [np.zeros(ne0, np.float32), 0])
    for r in range(rows):
        acc[0] += a[r] * a[r]
    acc[1] += rows
    return True
L.llama_backend_init()
req = json.load(sys.stdin)
mp = L.llama_model_default_params(); mp.n_gpu_layers = 0
model = L.llama_model_load_from_file(req["model"].encode(), mp)
cp = L.llama_context_default_params(); cp.n_ctx = cp.n_batch = cp.n_ubatch = req["n_ctx"]
cp.n_threads = cp.n_threads_batch = 2; cp.cb_eval = cb; cp.cb_eval_user_data = None
ctx = L.llama_init_from_model(model, cp)
for chunk in req["chunks"]:
    L.llama_memory_clear(L.llama_get_memory(ctx), True)
    n = len(chunk)
    b = L.llama_batch_init(n, 0, 1)
    for i, tok in enumerate(chunk):
        b.token[i] = tok; b.pos[i] = i; b.n_seq_id[i] = 1; b.seq_id[i][0] = 0; b.logits[i] = 1
    b.n_tokens = n
    assert L.llama_decode(ctx, b) == 0
    L.llama_batch_free(b)
np.savez(req["out"], **{k: v[0] for k, v in stats.items()}, **{k + ".count": np.array(v[1]) for k, v in stats.items()})
print("ok")
'''


def _llamacpp_stats(chunks, n_ctx):
    py, lib = llamacpp.python(), llamacpp.libggml_base()
    if py is None or lib is None:
        llamacpp.missing("a Python with llama_cpp")
    with tempfile.TemporaryDirectory() as d:
        out = str(Path(d) / "stats.npz")
        req = {"model": str(MODEL), "chunks": chunks, "n_ctx": n_ctx, "out": out}
        r = subprocess.run([py, "-c", _ORACLE, lib], input=json.dumps(req), capture_output=True, text=True,
                           timeout=300)
        assert r.returncode == 0, r.stderr[-3000:]
        z = np.load(out)
        return {k: z[k] for k in z.files}


def test_sums_match_llamacpp_activations():
    m = Model(MODEL)
    text = TEXT.read_text()
    col, n_chunk, _ = compute_imatrix(m, text, n_ctx=128, n_chunks=2)
    assert n_chunk == 2
    toks = m.vocab.tokenize(text, add_special=bool(m.vocab.add_bos), parse_special=False)
    ref = _llamacpp_stats([toks[c * 128:(c + 1) * 128] for c in range(2)], 128)
    names = sorted(k for k in ref if not k.endswith(".count"))
    # llama.cpp runs attn_q/k/v and ffn_gate/up as separate products; llampy fuses gate/up, each counts for both
    assert names == sorted(col.stats)
    for k in names:
        v, c = col.stats[k]
        assert int(c[0]) == int(ref[k + ".count"]) == 256
        np.testing.assert_allclose(v, ref[k], rtol=2e-3, atol=1e-3, err_msg=k)


def test_cli_file_read_by_llama_quantize(tmp_path):
    """llampy imatrix -> llama-quantize --imatrix and llampy quantize --imatrix write the same bytes."""
    tool = llamacpp.llama_quantize()
    if tool is None:
        llamacpp.missing("llama-quantize")
    im = tmp_path / "im.gguf"
    assert main(["imatrix", str(MODEL), "-f", str(TEXT), "-c", "128", "--chunks", "2", "-o", str(im),
                 "--progress", "off"]) == 0
    back = read_imatrix(im)
    assert back.has_metadata and back.chunk_count == 2 and back.chunk_size == 128 and len(back.entries) == 14
    ref, ours = tmp_path / "ref.gguf", tmp_path / "ours.gguf"
    p = subprocess.run([tool, "--imatrix", str(im), str(MODEL), str(ref), "Q4_0", "2"], capture_output=True,
                       text=True)
    assert p.returncode == 0, p.stderr[-2000:]
    assert "loaded 14 importance matrix entries" in p.stdout + p.stderr
    assert main(["quantize", "--progress", "off", "--imatrix", str(im), str(MODEL), str(ours), "Q4_0", "2"]) == 0
    assert ours.read_bytes() == ref.read_bytes()


def test_legacy_format_roundtrip(tmp_path):
    im = IMatrix(datasets=["t.txt"], chunk_count=2, chunk_size=4)
    im.entries["blk.0.ffn_up.weight"] = (np.array([8, 4, 2, 6], np.float32), np.array([8]))
    p = tmp_path / "im.dat"
    write_imatrix_legacy(p, im)
    back = read_imatrix(p)
    assert back.is_legacy and back.chunk_count == 2 and back.datasets == ["t.txt"]
    s, c = back.entries["blk.0.ffn_up.weight"]
    assert c.tolist() == [2] and s.tolist() == pytest.approx([2, 1, 0.5, 1.5])   # (sum / count) * ncall
