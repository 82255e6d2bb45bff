"""Hostile model files for the loader, and the harness that loads them.

``mutate`` turns one of the tiny fixture GGUFs into a hostile one: a metadata value replaced by an extreme or a
wrongly typed one, a key deleted, the tokenizer switched to another model (an SPM vocabulary without byte tokens),
a tensor dropped, renamed, reshaped or retyped, bytes of the header overwritten, the file cut short. ``run_files``
loads each file in worker processes as a user would (the model, its vocabulary on a text with special tokens and
bytes to fall back on, its chat template, a prompt decoded and one token generated) and sorts the outcomes:

- ``ok``: it loaded and ran;
- ``llampy:<Error>``: it was refused with one of llampy's errors (GGUFError, MissingMetadata, ModelLoadError, ...);
- ``foreign:<Error>``: any other exception (a bug: a ValueError from deep inside, a MemoryError...);
- ``hang``: no answer within the timeout; ``crash``: the worker died.

Used by tests/llama/test_fuzz_loader.py (a few dozen files) and scripts/fuzz_gguf.py (thousands).
"""
from __future__ import annotations

import json
import os
import random
import select
import subprocess
import sys
import time
import traceback
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
SAMPLE = ("<|im_start|>user\nHello world! Ünïcödé, 日本語, emoji 🦙, tabs\tand\nnewlines  and   spaces; "
          "code: def f(x): return x ** 2 # 12345 <|im_end|>\n<|im_start|>assistant\n")
MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]

INTS = [0, 1, -1, 2, 3, 7, 63, 64, 65, 127, 255, 4096, 65535, 65536, 2**31 - 1, 2**31, 2**32 - 1, 2**63 - 1,
        -2**31, -2**63, 33554462]
FLOATS = [0.0, -0.0, -1.0, 1e-45, 1e-30, 0.5, 1e30, 3.4e38, float("nan"), float("inf"), float("-inf")]
STRINGS = ["", "x", "yarn", "linear", "none", "llama", "gpt2", "bert", "t5", "rwkv", "plamo2", "gemma4", "whitespace",
           "hybriddna", "no_vocab", "qwen2", "smollm", "default", "\x00", "é" * 3, "{{ 1 }}", "a" * 70000]
TOKENIZER_MODELS = ["llama", "gpt2", "bert", "t5", "rwkv", "plamo2", "gemma4", "whitespace", "hybriddna", "none",
                    "no_vocab", "test", "nonsense"]
ARCHS = ["llama", "mistral", "granite", "qwen2", "qwen3", "qwen3moe", "gemma2", "gemma3", "phi3", "starcoder2",
         "bert", "nomic-bert", "phi2", "olmo2", "cohere2", "mamba", "mamba2", "jamba", "falcon", ""]
TEMPLATES = ["{% for %}", "{{ messages[0]['content'] }}", "{{ raise_exception('no') }}", "{{ x.y.z }}",
             "{{ ''.__class__.__mro__ }}", "{{ ((9**4096)**4096)**4096 }}", "{% for m in messages %}{{ m }}{% endfor %}",
             "{{ 'x' * 1000000000 }}"]


def fixture_paths() -> list[Path]:
    """The tiny GGUFs to mutate: the shared fixtures (nine architectures) and, when generated, tiny_more's."""
    from tests.paths import TINY
    return sorted(TINY.glob("*.gguf")) + sorted((ROOT / "tests" / "fixtures" / "tiny_more").glob("*.gguf"))


# ---------------------------------------------------------------------------- mutations
def _int_sig(v: int):
    from llampy.gguf import GGUFValueType as VT
    if v < 0:
        return VT.INT32 if v >= -2**31 else VT.INT64
    return VT.UINT32 if v < 2**32 else VT.UINT64


def _hostile_value(rng: random.Random, value, sig):
    """A replacement for one metadata value: an extreme of its own type most of the time, else another type."""
    from llampy.gguf import GGUFValueType as VT
    vt = VT(sig[0])
    if rng.random() < 0.2:              # another type altogether
        kind = rng.choice(["int", "float", "str", "bool", "arr_int", "arr_str", "arr_float"])
    elif vt == VT.ARRAY:
        kind = "same_array"
    elif vt == VT.STRING:
        kind = "str"
    elif vt in (VT.FLOAT32, VT.FLOAT64):
        kind = "float"
    elif vt == VT.BOOL:
        kind = "bool"
    else:
        kind = "int"
    if kind == "int":
        v = rng.choice(INTS)
        return v, (_int_sig(v),)
    if kind == "float":
        return rng.choice(FLOATS), (rng.choice([VT.FLOAT32, VT.FLOAT64]),)
    if kind == "bool":
        return rng.random() < 0.5, (VT.BOOL,)
    if kind == "str":
        return rng.choice(STRINGS), (VT.STRING,)
    if kind == "arr_int":
        return [rng.choice(INTS[:14]) for _ in range(rng.randrange(0, 5))], (VT.ARRAY, VT.INT64)
    if kind == "arr_float":
        return [rng.choice(FLOATS) for _ in range(rng.randrange(0, 5))], (VT.ARRAY, VT.FLOAT32)
    if kind == "arr_str":
        return [rng.choice(STRINGS[:18]) for _ in range(rng.randrange(0, 5))], (VT.ARRAY, VT.STRING)
    # an array like the original, damaged
    items = list(value)
    et = VT(sig[1]) if len(sig) > 1 else VT.INT32
    op = rng.choice(["empty", "truncate", "grow", "poke", "shuffle", "negative"])
    if op == "empty":
        items = []
    elif op == "truncate" and items:
        items = items[:rng.randrange(len(items))]
    elif op == "grow":
        items = items + items[:rng.randrange(1, 4)] if items else [0]
    elif op == "poke" and items:
        for _ in range(rng.randrange(1, 4)):
            i = rng.randrange(len(items))
            if et == VT.STRING:
                items[i] = rng.choice(STRINGS[:18])
            elif et in (VT.FLOAT32, VT.FLOAT64):
                items[i] = rng.choice(FLOATS)
            elif et != VT.ARRAY:
                items[i] = rng.choice([0, 1, 2, 5, 7, 255])
    elif op == "shuffle":
        rng.shuffle(items)
    elif op == "negative" and et not in (VT.STRING, VT.ARRAY, VT.BOOL) and items:
        return [-abs(int(x)) - 1 if isinstance(x, (int, np.integer)) else -abs(float(x)) for x in items], \
            (VT.ARRAY, VT.INT32 if et not in (VT.FLOAT32, VT.FLOAT64) else et)
    if et in (VT.UINT8, VT.UINT16, VT.UINT32, VT.UINT64, VT.BOOL) and items:
        items = [max(0, int(x)) if et != VT.BOOL else bool(x) for x in items]
    return items, sig


def _pick_key(rng: random.Random, keys: list) -> str:
    arch_keys = [k for k in keys if not k.startswith(("general.", "tokenizer."))]
    tok_keys = [k for k in keys if k.startswith("tokenizer.")]
    pool = rng.choice([arch_keys, arch_keys, tok_keys, keys])
    return rng.choice(pool or keys)


def mutate(src: Path, rng: random.Random) -> tuple[bytes, str]:
    """A hostile variant of the GGUF at ``src``: its bytes and a description of what was done."""
    import io
    from llampy.ggml.types import TYPE_TRAITS, GGMLType
    from llampy.gguf import GGUFReader, GGUFValueType as VT, GGUFWriter
    with GGUFReader(src) as r:
        buf = io.BytesIO()
        w = GGUFWriter.from_reader(r, buf)
        arch = r.metadata.get("general.architecture", "")
        kv = [list(x) for x in w.kv]
        tensors = [list(t) for t in w.tensors]
        keys = [k for k, _, _ in kv]
        what = []
        n_edits = rng.choice([1, 1, 1, 2, 3])
        byte_level = None
        for _ in range(n_edits):
            family = rng.choices(["value", "delete", "tokenizer", "arch", "template", "tensor", "bytes", "cut"],
                                 [40, 10, 10, 4, 4, 14, 10, 4])[0]
            try:
                byte_level = _edit(rng, family, arch, kv, keys, tensors, what) or byte_level
            except (ValueError, TypeError, OverflowError, IndexError, AttributeError, KeyError):
                what.append(f"({family} edit skipped: an earlier edit left nothing it applies to)")
        w.kv = [tuple(x) for x in kv]
        w.tensors = []
        for name, t, ne, raw in tensors:
            if raw is None:
                w.add_tensor_zeros(name, t, ne)
            else:
                w.add_tensor_raw(name, t, ne, raw)
        try:
            data = bytearray(_written(w))
        except (ValueError, OverflowError, TypeError) as e:     # a value our writer cannot encode: write plain
            what.append(f"(unwritable: {e})")
            w.kv = [tuple(x) for x in w.kv if not str(e).startswith(f"metadata {x[0]!r}")]
            data = bytearray(_written(w))
    if byte_level == "bytes":
        head = len(w.header_bytes())
        for _ in range(rng.randrange(1, 9)):
            p = rng.randrange(min(head, len(data)))
            data[p] = rng.randrange(256) if rng.random() < 0.7 else rng.choice([0, 0xFF, 0x7F, 0x80])
        what.append("header bytes")
    elif byte_level == "cut":
        cut = rng.randrange(len(data))
        data = data[:cut]
        what.append(f"cut at {cut}")
    return bytes(data), "; ".join(what) or "unchanged"


def _edit(rng, family, arch, kv, keys, tensors, what):
    """One edit of the kv list and tensor list, in place; returns 'bytes' or 'cut' for the byte-level ones."""
    from llampy.ggml.types import TYPE_TRAITS, GGMLType
    from llampy.gguf import GGUFValueType as VT
    if family == "value":
        k = _pick_key(rng, keys)
        i = keys.index(k)
        kv[i][1], kv[i][2] = _hostile_value(rng, kv[i][1], kv[i][2])
        what.append(f"{k}={_short(kv[i][1])}")
    elif family == "delete":
        k = _pick_key(rng, keys)
        i = keys.index(k)
        del kv[i], keys[i]
        what.append(f"del {k}")
    elif family == "tokenizer":
        op = rng.choice(["model", "drop_bytes", "pre", "special_id", "types"])
        if op == "model":
            _set(kv, keys, "tokenizer.ggml.model", rng.choice(TOKENIZER_MODELS), (VT.STRING,))
            what.append(f"tokenizer model {_get(kv, keys, 'tokenizer.ggml.model')}")
        elif op == "drop_bytes" and "tokenizer.ggml.tokens" in keys:
            i = keys.index("tokenizer.ggml.tokens")
            toks = kv[i][1]
            kv[i][1] = [t if not (t.startswith("<0x") and t.endswith(">")) and len(t) > 1 else f"<dropped{j}>"
                        for j, t in enumerate(toks)]
            _set(kv, keys, "tokenizer.ggml.model", "llama", (VT.STRING,))
            what.append("spm without byte tokens")
        elif op == "pre":
            _set(kv, keys, "tokenizer.ggml.pre", rng.choice(STRINGS[:18] + ["llama3", "qwen2", "gpt-2",
                                                                           "deepseek-llm", "tekken"]),
                 (VT.STRING,))
            what.append(f"pre {_get(kv, keys, 'tokenizer.ggml.pre')}")
        elif op == "special_id":
            k = rng.choice(["bos", "eos", "unknown", "padding", "eot", "seperator"])
            v = rng.choice([0, 49151, 49152, 10**6, 2**32 - 1, -1])
            _set(kv, keys, f"tokenizer.ggml.{k}_token_id", v, (_int_sig(v),))
            what.append(f"{k} id {v}")
        elif op == "types" and "tokenizer.ggml.token_type" in keys:
            i = keys.index("tokenizer.ggml.token_type")
            arr = np.array(kv[i][1], dtype=np.int32).copy()
            idx = rng.sample(range(len(arr)), min(len(arr), 50))
            arr[idx] = [rng.choice([-5, 0, 1, 2, 3, 4, 5, 6, 7, 99]) for _ in idx]
            kv[i][1] = arr
            what.append("token types")
    elif family == "arch":
        new = rng.choice(ARCHS)
        _set(kv, keys, "general.architecture", new, (VT.STRING,))
        if rng.random() < 0.5:      # its keys renamed too: the file then looks like that architecture
            for row in kv:
                if row[0].startswith(arch + "."):
                    row[0] = new + row[0][len(arch):]
            keys[:] = [row[0] for row in kv]
        what.append(f"arch {new}")
    elif family == "template":
        _set(kv, keys, "tokenizer.chat_template", rng.choice(TEMPLATES), (VT.STRING,))
        what.append("template")
    elif family == "tensor" and tensors:
        i = rng.randrange(len(tensors))
        name, t, ne, raw = tensors[i]
        op = rng.choice(["drop", "rename", "shape", "type", "extra_layer", "nan"])
        if op == "drop":
            del tensors[i]
            what.append(f"drop {name}")
        elif op == "rename":
            tensors[i][0] = rng.choice(["blk.99.attn_q.weight", "blk.-1.attn_q.weight", "x", name + ".x",
                                        "blk.0." + name])
            if any(tt[0] == tensors[i][0] for j, tt in enumerate(tensors) if j != i):
                tensors[i][0] = name
            what.append(f"rename {name}")
        elif op == "shape":
            ne2 = list(ne)
            d = rng.randrange(len(ne2))
            ne2[d] = rng.choice([0, 1, ne2[d] * 2, ne2[d] + 32, max(1, ne2[d] // 2)])
            if rng.random() < 0.2:
                ne2 = ne2[::-1]
            if ne2[0] % TYPE_TRAITS[GGMLType(t)].blck_size == 0:
                tensors[i] = [name, t, tuple(ne2), None]
                what.append(f"shape {name} {ne2}")
        elif op == "type":
            t2 = rng.choice([GGMLType.F32, GGMLType.F16, GGMLType.BF16, GGMLType.Q8_0, GGMLType.Q4_0,
                             GGMLType.Q4_K, GGMLType.Q6_K, GGMLType.IQ4_NL, GGMLType.I32, GGMLType.TQ1_0])
            if ne[0] % TYPE_TRAITS[t2].blck_size == 0:
                tensors[i] = [name, t2, ne, None]
                what.append(f"type {name} {t2.name}")
        elif op == "extra_layer":
            n_layer = _get(kv, keys, f"{arch}.block_count")
            if isinstance(n_layer, (int, np.integer)) and 0 <= n_layer < 1000:
                new = f"blk.{int(n_layer)}.attn_norm.weight"
                if all(tt[0] != new for tt in tensors):
                    tensors.append([new, GGMLType.F32, (ne[0],), None])
                    what.append("extra layer tensor")
        elif op == "nan" and GGMLType(t) == GGMLType.F32:
            arr = np.frombuffer(bytes(raw), dtype=np.float32).copy()
            arr[rng.randrange(len(arr))] = rng.choice([np.nan, np.inf, -np.inf])
            tensors[i][3] = arr.view(np.uint8)
            what.append(f"nan in {name}")
    elif family in ("bytes", "cut"):
        return family
    return None


def write_variant(src: Path, out: Path, set: dict | None = None, delete=(), retype: dict | None = None) -> Path:
    """A copy of ``src`` with metadata keys set (value, or (value, GGUF type)), deleted, and tensors retyped (name:
    GGMLType, zero data): the one-change files of the loader's tests."""
    from llampy.gguf import GGUFReader, GGUFWriter
    from llampy.gguf.writer import infer_value_type
    with GGUFReader(src) as r:
        w = GGUFWriter.from_reader(r, out)
        kv = [list(x) for x in w.kv if x[0] not in delete]
        keys = [k for k, _, _ in kv]
        for k, v in (set or {}).items():
            v, sig = v if isinstance(v, tuple) else (v, infer_value_type(v))
            _set(kv, keys, k, v, sig if isinstance(sig, tuple) else (sig,))
        w.kv = [tuple(x) for x in kv]
        tensors, w.tensors = w.tensors, []
        for name, t, ne, raw in tensors:
            if retype and name in retype:
                w.add_tensor_zeros(name, retype[name], ne)
            else:
                w.add_tensor_raw(name, t, ne, raw)
        w.write()
    return out


def _written(w) -> bytes:
    import io
    buf = io.BytesIO()
    w.target = buf
    w.write()
    return buf.getvalue()


def _set(kv, keys, key, value, sig):
    if key in keys:
        i = keys.index(key)
        kv[i][1], kv[i][2] = value, sig
    else:
        kv.append([key, value, sig])
        keys.append(key)


def _get(kv, keys, key):
    return kv[keys.index(key)][1] if key in keys else None


def _short(v) -> str:
    s = repr(v) if not isinstance(v, (list, np.ndarray)) else f"[{len(v)} items]"
    return s[:40]


# ---------------------------------------------------------------------------- the worker
def check_model(path: str, renderer) -> str:
    """Load, tokenize, render, decode. Returns 'ok' or raises."""
    from llampy.llama.batch import Batch
    from llampy.llama.chat import ChatTemplateError, template_from_metadata
    from llampy.llama.context import Context, ContextError
    from llampy.llama.model import Model
    m = Model(path)
    try:
        v = m.vocab
        toks = v.tokenize(SAMPLE, add_special=True, parse_special=True)
        v.detokenize(toks)
        for t in toks[:32]:
            v.token_to_piece(t)
        try:
            renderer.render(template_from_metadata(m.metadata), MESSAGES)
        except ChatTemplateError:
            pass
        prompt = toks[:12] or [0]
        try:
            ctx = Context(m, n_ctx=64, n_batch=32, n_ubatch=32)
        except ContextError:            # an encoder: no language-model head, embeddings only
            ctx = Context(m, n_ctx=64, n_batch=32, n_ubatch=32, embeddings=True, pooling="mean")
            ctx.decode(Batch.from_tokens(prompt, logits_all=True))
            ctx.get_embeddings_seq(0)
            return "ok"
        ctx.decode(Batch.from_tokens(prompt))
        nxt = int(np.argmax(ctx.get_logits_ith(-1)))
        ctx.decode(Batch.from_tokens([nxt], len(prompt)))
        return "ok"
    finally:
        m.close()


def _classify(e: BaseException) -> str:
    mod = type(e).__module__ or ""
    return f"{'llampy' if mod.startswith('llampy') else 'foreign'}:{type(e).__name__}"


def _worker(memory: int) -> None:
    """Paths on stdin, one JSON result per line on stdout."""
    try:
        import resource
        resource.setrlimit(resource.RLIMIT_AS, (memory, memory))
    except (ImportError, ValueError, OSError):
        pass
    from llampy import tuning
    tuning.install()
    from llampy.server.render import TemplateRenderer
    renderer = TemplateRenderer(seconds=2.0, memory=512 << 20, n_workers=1)
    out = sys.stdout
    sys.stdout = sys.stderr             # nothing else may write on the results channel
    for line in sys.stdin:
        path = line.strip()
        if not path:
            continue
        t0 = time.perf_counter()
        try:
            res, detail = check_model(path, renderer), ""
        except BaseException as e:      # noqa: BLE001 - every outcome is a result here
            if isinstance(e, KeyboardInterrupt):
                raise
            res = _classify(e)
            detail = (f"{e}"[:300] if res.startswith("llampy") else
                      "".join(traceback.format_exception(type(e), e, e.__traceback__))[-3000:])
        out.write(json.dumps({"path": path, "result": res, "detail": detail,
                              "seconds": round(time.perf_counter() - t0, 3)}) + "\n")
        out.flush()


class _Proc:
    def __init__(self, memory: int):
        env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
        self.p = subprocess.Popen([sys.executable, "-m", "tests.fuzz_gguf", "--worker", str(memory)], cwd=ROOT,
                                  stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, env=env,
                                  text=True, bufsize=1)
        self.path = None
        self.t0 = 0.0

    def send(self, path: str) -> None:
        self.path, self.t0 = path, time.monotonic()
        self.p.stdin.write(path + "\n")
        self.p.stdin.flush()

    def kill(self) -> None:
        try:
            self.p.kill()
            self.p.wait(timeout=10)
        except (OSError, subprocess.TimeoutExpired):
            pass


def run_files(paths, n_workers: int = 2, timeout: float = 120.0, memory: int = 6 << 30,
              on_result=None) -> list[dict]:
    """Each file (an iterable of paths, pulled as workers free up) through a worker process; a worker that hangs
    past ``timeout`` (the first file a worker takes gets 4x, for its start-up and the kernels' first compile) or
    dies is recorded and replaced. ``on_result(result)`` is called as each file is done."""
    todo = iter(str(p) for p in paths)
    procs: list[_Proc] = []
    results = []
    first: dict[int, bool] = {}
    exhausted = False

    def record(res: dict) -> None:
        results.append(res)
        if on_result is not None:
            on_result(res)

    def next_path():
        nonlocal exhausted
        if exhausted:
            return None
        try:
            return next(todo)
        except StopIteration:
            exhausted = True
            return None

    try:
        while True:
            for p in procs:
                if p.path is None and (path := next_path()) is not None:
                    p.send(path)
            while len(procs) < n_workers and (path := next_path()) is not None:
                p = _Proc(memory)
                procs.append(p)
                first[id(p)] = True
                p.send(path)
            busy = [p for p in procs if p.path is not None]
            if not busy:
                break
            ready = select.select([p.p.stdout for p in busy], [], [], 1.0)[0]
            for p in busy:
                if p.p.stdout in ready:
                    line = p.p.stdout.readline()
                    if line:
                        record(json.loads(line))
                        p.path = None
                        first[id(p)] = False
                        continue
                    record({"path": p.path, "result": "crash", "detail": f"exit status {p.p.wait()}",
                            "seconds": round(time.monotonic() - p.t0, 3)})
                    procs.remove(p)
                    continue
                limit = timeout * (4 if first[id(p)] else 1)
                if time.monotonic() - p.t0 > limit:
                    record({"path": p.path, "result": "hang", "detail": f"no answer in {limit:.0f} s",
                            "seconds": round(time.monotonic() - p.t0, 3)})
                    p.kill()
                    procs.remove(p)
    finally:
        for p in procs:
            p.kill()
    return results


def iter_files(out_dir: Path, n: int, seed: int = 0, start: int = 0, descriptions: dict | None = None):
    """Hostile files ``start`` .. ``start + n - 1`` in out_dir, round-robin over the fixtures, made as they are
    asked for (file i is the same for a given seed whatever the run); their descriptions go to ``descriptions``."""
    out_dir.mkdir(parents=True, exist_ok=True)
    srcs = fixture_paths()
    for i in range(start, start + n):
        src = srcs[i % len(srcs)]
        data, what = mutate(src, random.Random(f"{seed}:{i}"))
        p = out_dir / f"{i:05d}-{src.stem}.gguf"
        p.write_bytes(data)
        if descriptions is not None:
            descriptions[str(p)] = f"{src.name}: {what}"
        yield p


def make_files(out_dir: Path, n: int, seed: int = 0) -> list[tuple[Path, str]]:
    """n hostile files in out_dir; [(path, description)]."""
    desc: dict = {}
    paths = list(iter_files(out_dir, n, seed, descriptions=desc))
    return [(p, desc[str(p)]) for p in paths]


if __name__ == "__main__":
    if len(sys.argv) >= 2 and sys.argv[1] == "--worker":
        _worker(int(sys.argv[2]) if len(sys.argv) > 2 else 6 << 30)
