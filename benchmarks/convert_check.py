"""llampy convert against llama.cpp's own converter (convert_hf_to_gguf.py) on the tiny checkpoints the convert tests
write (tests/convert/test_convert_hf.py, every architecture there): both files' metadata, tensor names, types,
shapes and bytes, and the greedy tokens libllama generates from each.

    python benchmarks/convert_check.py [--arch llama,qwen2,...] [--tokens 24] [--keep DIR]

What it needs, and where it finds it:
- llama.cpp's converter: ``$LLAMACPP_SRC`` (a llama.cpp source tree: convert_hf_to_gguf.py, conversion/, gguf-py/,
  as scripts/llamacpp.sh takes it), else the copy vendored by llama-cpp-python's sdist, unpacked once under
  ``~/.cache/llampy/llamacpp-src-<version>`` (``pip download`` of the version scripts/llamacpp.sh builds).
- a Python that runs it: ``$LLAMPY_CONVERT_PYTHON``, else this one; it must import torch, transformers, sentencepiece
  and safetensors (the converter's requirements). llampy does not depend on them: make a separate venv, e.g.
  ``python -m venv /tmp/cv && /tmp/cv/bin/pip install torch transformers sentencepiece safetensors protobuf``
  (torch's CPU wheel is enough).
- libllama (the Python that imports llama_cpp, as the tests find it: ``bash scripts/llamacpp.sh``).
Without one of these it prints what is missing and exits with status 0 (a skip, not a failure).

The one thing changed in the converter's run: the tiny tokenizers are trained on a few sentences, so the hash that
convert_hf_to_gguf.py uses to name a BPE pre-tokenizer is none it knows and it refuses them. The check makes its
``get_vocab_base_pre`` answer "gpt-2" (the plain byte-level regex these tokenizers use, and what llampy writes for
an unknown byte-level pre-tokenizer). Differences that are allowed and listed, not counted: ``general.*`` keys that
describe the file rather than the model (name, size label, ...). Everything else must be equal; the exit status is 1
when something differs.
"""
from __future__ import annotations

import argparse
import glob
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

SDIST_VERSION = "0.3.36"        # scripts/llamacpp.sh's VER

_DRIVE = r'''
import sys
conv = sys.argv[1]
sys.path.insert(0, conv)
sys.argv = [conv + "/convert_hf_to_gguf.py"] + sys.argv[2:]
import convert_hf_to_gguf as C
from conversion import base
base.TextModel.get_vocab_base_pre = lambda self, tokenizer: "gpt-2"
C.main()
'''

_GREEDY = r'''
import json, sys
import numpy as np
import llama_cpp as L
L.llama_backend_init()
req = json.load(sys.stdin)
mp = L.llama_model_default_params(); mp.n_gpu_layers = 0
model = L.llama_model_load_from_file(req["model"].encode(), mp)
if not model:
    json.dump({"error": "model load failed"}, sys.stdout); sys.exit(0)
cp = L.llama_context_default_params(); cp.n_ctx = 128; cp.n_batch = 128; cp.n_threads = cp.n_threads_batch = 2
ctx = L.llama_init_from_model(model, cp)
nv = L.llama_vocab_n_tokens(L.llama_model_get_vocab(model))
toks = list(req["tokens"]); out = []
b = L.llama_batch_init(128, 0, 1)
pos = 0; feed = toks
for _ in range(req["n"]):
    for i, t in enumerate(feed):
        b.token[i] = t; b.pos[i] = pos + i; b.n_seq_id[i] = 1; b.seq_id[i][0] = 0; b.logits[i] = int(i == len(feed) - 1)
    b.n_tokens = len(feed)
    if L.llama_decode(ctx, b) != 0:
        json.dump({"error": "decode failed"}, sys.stdout); sys.exit(0)
    pos += len(feed)
    logits = np.ctypeslib.as_array(L.llama_get_logits_ith(ctx, len(feed) - 1), shape=(nv,))
    t = int(np.argmax(logits)); out.append(t); feed = [t]
json.dump({"tokens": out}, sys.stdout)
'''

# config.json's model_type and tokenizer_config.json's tokenizer_class, which Hugging Face checkpoints carry and the
# tests' tiny ones leave out: convert_hf_to_gguf.py reads the configuration through transformers' AutoConfig (its
# defaults filled in), which needs the first, and Phi3Model takes the GPT-2 vocabulary path on the second
MODEL_TYPE = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "gemma2": "gemma2", "gemma3": "gemma3_text",
              "phi3": "phi3", "qwen3moe": "qwen3_moe", "granite": "granite", "starcoder2": "starcoder2",
              "smollm3": "smollm3", "olmo2": "olmo2", "mixtral": "mixtral", "phi2": "phi", "command-r": "cohere",
              "cohere2": "cohere2"}

# llama.cpp's Gemma 2 converter reads a SentencePiece tokenizer.model only: its checkpoint gets one (as "-spm" does)
SPM_ONLY = ("gemma2",)

# general.* keys that describe the file, not the model: the converter derives them from the directory's name and the
# parameter count; llampy writes the architecture, the file type and the quantization version only
FILE_KEYS = ("general.name", "general.basename", "general.size_label", "general.finetune", "general.version",
             "general.type")


def _sentencepiece(hf: Path, cfg: dict, T) -> list[int]:
    """The checkpoint's tokenizer.json replaced by a SentencePiece tokenizer.model (the tests' write_spm_model, plus
    the trainer spec the sentencepiece library needs to accept byte pieces: BPE, byte_fallback), the embeddings
    and output rows resized to its vocabulary as tests/convert's SentencePiece test does; returns a prompt (BOS,
    then pieces)."""
    import numpy as np
    from llampy.convert.files import read_safetensors
    (hf / "tokenizer.json").unlink()
    n = T.write_spm_model(hf / "tokenizer.model", T.TEXT.split())
    spec = bytes([0x18, 0x02, 0x98, 0x02, 0x01])      # TrainerSpec: model_type (3) BPE, byte_fallback (35) true
    with open(hf / "tokenizer.model", "ab") as f:
        f.write(bytes([0x12, len(spec)]) + spec)
    (hf / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>",
                                                         "add_bos_token": True, "add_eos_token": False}))
    cfg.update(vocab_size=n, bos_token_id=1, eos_token_id=2)
    rng = np.random.default_rng(5)
    for shard in sorted(hf.glob("*.safetensors")):
        ts = read_safetensors(shard)
        for name in ("model.embed_tokens.weight", "lm_head.weight"):
            if name in ts:
                ts[name] = rng.normal(0, 0.5, (n, T.N_EMBD)).astype(np.float32)
        T.write_safetensors(shard, ts)
    return [1] + list(range(259, 266))


def _converter_dir() -> Path | None:
    src = os.environ.get("LLAMACPP_SRC")
    if src:
        return Path(src) if (Path(src) / "convert_hf_to_gguf.py").exists() else None
    cache = Path(os.environ.get("LLAMPY_CACHE") or Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
                 / "llampy") / f"llamacpp-src-{SDIST_VERSION}"
    d = cache / f"llama_cpp_python-{SDIST_VERSION}" / "vendor" / "llama.cpp"
    if (d / "convert_hf_to_gguf.py").exists():
        return d
    cache.mkdir(parents=True, exist_ok=True)
    print(f"fetching llama-cpp-python {SDIST_VERSION}'s sdist (llama.cpp's converter) into {cache}", flush=True)
    r = subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--no-binary", ":all:", "-d",
                        str(cache), f"llama-cpp-python=={SDIST_VERSION}"], capture_output=True, text=True)
    tars = glob.glob(str(cache / f"llama_cpp_python-{SDIST_VERSION}.tar.gz"))
    if r.returncode or not tars:
        print(r.stderr.strip()[-500:])
        return None
    top = f"llama_cpp_python-{SDIST_VERSION}/vendor/llama.cpp/"
    subprocess.run(["tar", "-xzf", tars[0], "-C", str(cache), top + "convert_hf_to_gguf.py", top + "conversion",
                    top + "gguf-py"], check=True)
    return d if (d / "convert_hf_to_gguf.py").exists() else None


def _converter_python() -> str | None:
    py = os.environ.get("LLAMPY_CONVERT_PYTHON") or sys.executable
    ok = subprocess.run([py, "-c", "import torch, transformers, sentencepiece, safetensors"], capture_output=True)
    return py if ok.returncode == 0 else None


def _plain(v):
    """A metadata value as JSON-comparable data (arrays as lists, floats rounded to float32's precision)."""
    import numpy as np
    if isinstance(v, np.ndarray):
        v = v.tolist()
    if isinstance(v, (list, tuple)):
        return [_plain(x) for x in v]
    if isinstance(v, (float, np.floating)):
        return float(np.float32(v))
    if isinstance(v, np.integer):
        return int(v)
    if isinstance(v, (bytes, bytearray)):
        return bytes(v).decode("utf-8", "replace")
    return v


def _read(path: Path) -> tuple[dict, dict]:
    import numpy as np
    from llampy.gguf import GGUFReader
    with GGUFReader(path) as r:
        md = {k: _plain(v) for k, v in r.metadata.items()}
        tensors = {n: (ti.type.name, tuple(ti.ne), np.asarray(r.tensor_array(n)).tobytes())
                   for n, ti in r.tensors.items()}
    return md, tensors


def compare(ours: Path, theirs: Path) -> tuple[list[str], list[str]]:
    """(differences, allowed differences) between the two files."""
    import numpy as np
    md1, t1 = _read(ours)
    md2, t2 = _read(theirs)
    diffs, allowed = [], []
    for k in sorted(set(md1) | set(md2)):
        a, b = md1.get(k, "<absent>"), md2.get(k, "<absent>")
        if a == b:
            continue
        line = f"{k}: llampy {str(a)[:80]!s} / llama.cpp {str(b)[:80]!s}"
        (allowed if k in FILE_KEYS else diffs).append(line)
    for n in sorted(set(t1) | set(t2)):
        if n not in t1 or n not in t2:
            diffs.append(f"tensor {n}: only in {'llampy' if n in t1 else 'llama.cpp'}'s file")
            continue
        (ty1, ne1, b1), (ty2, ne2, b2) = t1[n], t2[n]
        if (ty1, ne1) != (ty2, ne2):
            diffs.append(f"tensor {n}: llampy {ty1} {ne1} / llama.cpp {ty2} {ne2}")
        elif b1 != b2:
            if ty1 == "F32":
                d = np.abs(np.frombuffer(b1, np.float32) - np.frombuffer(b2, np.float32)).max()
                diffs.append(f"tensor {n}: F32 values differ by up to {d:.3g}")
            else:
                diffs.append(f"tensor {n}: {ty1} bytes differ")
    if list(t1) != list(t2) and set(t1) == set(t2):
        allowed.append("tensor order differs")
    return diffs, allowed


def greedy(py: str, model: Path, tokens: list[int], n: int) -> list[int] | str:
    r = subprocess.run([py, "-c", _GREEDY], input=json.dumps({"model": str(model), "tokens": tokens, "n": n}),
                       capture_output=True, text=True, timeout=300)
    if r.returncode:
        return "libllama failed: " + r.stderr.strip()[-300:]
    res = json.loads(r.stdout.strip().splitlines()[-1])
    return res.get("tokens") or res["error"]


def main() -> int:
    from tests.convert import test_convert_hf as T
    archs = [c[0] for c in T.CASES] + ["llama-spm"]
    ap = argparse.ArgumentParser()
    ap.add_argument("--arch", default=",".join(archs), help="comma-separated, from: " + ", ".join(archs))
    ap.add_argument("--tokens", type=int, default=24, help="greedy tokens generated from each file")
    ap.add_argument("--keep", default=None, help="keep checkpoints and files in this directory")
    a = ap.parse_args()
    from tests import llamacpp
    lpy = llamacpp.python()
    conv = _converter_dir()
    cpy = _converter_python()
    missing = [what for what, ok in (("llama.cpp's converter (LLAMACPP_SRC, or pip download of the sdist)", conv),
                                      ("a Python with torch, transformers, sentencepiece and safetensors "
                                       "(LLAMPY_CONVERT_PYTHON)", cpy),
                                      ("libllama (bash scripts/llamacpp.sh)", lpy)) if not ok]
    if missing:
        print("skipped, missing: " + "; ".join(missing))
        return 0
    from llampy.cli import main as llampy_main
    cases = {c[0]: c for c in T.CASES}
    root = Path(a.keep) if a.keep else Path(tempfile.mkdtemp(prefix="llampy-convert-check-"))
    print(f"converter: {conv}\n")
    print("| architecture | checkpoint | metadata + tensors | allowed differences | greedy tokens (libllama) |")
    print("| --- | --- | --- | --- | --- |")
    bad, done = 0, []
    for case in a.arch.split(","):
        arch = case.removesuffix("-spm")
        spm = case.endswith("-spm") or arch in SPM_ONLY
        _, tied, dtype, _ = cases[arch]
        d = root / f"case{len(done)}"       # no architecture in the path: transformers matches model types there
        done.append(arch)
        t, cfg, tok = T.make_checkpoint(d / "hf", arch, tied, dtype)
        cfg["model_type"] = MODEL_TYPE[arch]
        if spm:
            ids = _sentencepiece(d / "hf", cfg, T)
        else:
            ids = tok.encode(T.TEXT).ids[:8]
            tc = json.loads((d / "hf" / "tokenizer_config.json").read_text())
            (d / "hf" / "tokenizer_config.json").write_text(json.dumps({**tc, "tokenizer_class": "GPT2Tokenizer"}))
        (d / "hf" / "config.json").write_text(json.dumps(cfg))
        ours, theirs = d / "llampy.gguf", d / "llamacpp.gguf"
        with open(os.devnull, "w") as null:
            old = sys.stderr
            sys.stderr = null
            try:
                rc = llampy_main(["convert", str(d / "hf"), str(ours), "--outtype", "f32"])
            finally:
                sys.stderr = old
        r = subprocess.run([cpy, "-c", _DRIVE, str(conv), str(d / "hf"), "--outfile", str(theirs), "--outtype",
                            "f32"], capture_output=True, text=True)
        what = f"{dtype}{', tied' if tied else ''}{', tokenizer.model' if spm else ''}"
        if rc or r.returncode:
            bad += 1
            err = r.stderr.strip().splitlines()[-1:] if r.returncode else ["llampy convert failed"]
            print(f"| {case} | {what} | conversion failed: {err[0] if err else ''} | | |", flush=True)
            continue
        diffs, allowed = compare(ours, theirs)
        g1, g2 = greedy(lpy, ours, ids, a.tokens), greedy(lpy, theirs, ids, a.tokens)
        same_tokens = isinstance(g1, list) and g1 == g2
        bad += bool(diffs) or not same_tokens
        keys = ", ".join(x.split(":")[0] for x in allowed) or "none"
        print(f"| {case} | {what} | {'same' if not diffs else '<br>'.join(diffs[:6])} | {keys} | "
              f"{'same (' + str(len(g1)) + ')' if same_tokens else f'llampy {g1} / llama.cpp {g2}'} |", flush=True)
    if not a.keep:
        import shutil
        shutil.rmtree(root, ignore_errors=True)
    print(f"\n{'all same' if not bad else f'{bad} architecture(s) differ'}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
