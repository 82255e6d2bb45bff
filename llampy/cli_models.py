"""`llampy list`, `llampy show`, `llampy ps`: Ollama's commands over GGUF files and a running `llampy serve`.

list: the models of a folder (--models-dir, or $LLAMPY_MODELS_DIR) and the built-in names, one line each;
show: one model's architecture, size, context, quantization, capabilities (and its template with --template);
ps: the models a running server has loaded (GET /v1/models), with when each is unloaded.
"""
from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path


def add_models_parsers(sub) -> None:
    p = sub.add_parser("list", aliases=["ls"], help="the models of a folder (--models-dir) and the built-in ones")
    p.add_argument("--models-dir", default=os.environ.get("LLAMPY_MODELS_DIR"), metavar="DIR",
                   help="the folder `llampy serve --models-dir` serves (default: $LLAMPY_MODELS_DIR)")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_list)
    p = sub.add_parser("show", help="a model's architecture, parameters, context, quantization and capabilities")
    p.add_argument("model", help="a GGUF path, a name in --models-dir, or 'smollm2' / 'gemma3'")
    p.add_argument("--models-dir", default=os.environ.get("LLAMPY_MODELS_DIR"), metavar="DIR")
    p.add_argument("--template", action="store_true", help="print the chat template only")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_show)
    p = sub.add_parser("ps", help="the models a running `llampy serve` has loaded")
    p.add_argument("--url", default=os.environ.get("LLAMPY_URL", "http://127.0.0.1:8080"),
                   help="the server (default $LLAMPY_URL or http://127.0.0.1:8080)")
    p.add_argument("--api-key", default=None)
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_ps)


def _builtin() -> dict:
    """The built-in names whose files are installed."""
    from .models import ModelNotFound, resolve_model
    out = {}
    for name in ("smollm2", "gemma3"):
        try:
            out[name] = resolve_model(name)
        except (ModelNotFound, FileNotFoundError, ImportError):
            pass
    return out


def _find(model: str, models_dir) -> Path:
    from .models import resolve_model
    if models_dir:
        from .server.router import scan_models
        found = scan_models(models_dir)
        name = model[:-5] if model.endswith(".gguf") else model
        if name in found:
            return found[name]
    return resolve_model(model)


def _ftype(ft) -> str:
    from .llama.quant import FTYPES
    names = {i: n for n, i, _, _ in FTYPES}
    names.update({0: "F32", 1: "F16", 32: "BF16"})
    return names.get(ft, f"ftype {ft}") if ft is not None else "-"


def model_summary(path) -> dict:
    """What `show` prints, read from the file's header (no weights loaded)."""
    from .gguf.split import open_gguf
    with open_gguf(path) as r:
        md = r.metadata
        arch = md.get("general.architecture", "?")
        n_params = sum(_prod(t.ne) for t in r.tensors.values())
        size = sum(p.file_size for p in getattr(r, "readers", [])) or r.file_size
        tmpl = md.get("tokenizer.chat_template")
        tmpl = tmpl if isinstance(tmpl, str) else None
        caps = ["completion"]
        if arch in ("bert", "nomic-bert", "jina-bert-v2") or md.get(f"{arch}.pooling_type") not in (None, 0):
            caps = ["embedding"]
        if tmpl and "tools" in tmpl:
            caps.append("tools")
        if tmpl and ("<think>" in tmpl or "enable_thinking" in tmpl):
            caps.append("thinking")
        toks = md.get("tokenizer.ggml.tokens")
        return {"name": Path(path).name[:-5] if str(path).endswith(".gguf") else Path(path).name,
                "path": str(path), "architecture": arch, "parameters": n_params, "size": size,
                "context_length": md.get(f"{arch}.context_length"),
                "embedding_length": md.get(f"{arch}.embedding_length"), "block_count": md.get(f"{arch}.block_count"),
                "head_count": md.get(f"{arch}.attention.head_count"),
                "quantization": _ftype(md.get("general.file_type")),
                "vocab": {"type": md.get("tokenizer.ggml.model"), "size": len(toks) if toks is not None else None},
                "capabilities": caps, "chat_template": tmpl, "license": md.get("general.license"),
                "model_name": md.get("general.name")}


def _prod(ne) -> int:
    n = 1
    for x in ne:
        n *= int(x)
    return n


def _size(n: int) -> str:
    for unit, k in (("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if n >= k:
            return f"{n / k:.1f} {unit}"
    return f"{n} B"


def _params(n: int) -> str:
    return f"{n / 1e9:.1f}B" if n >= 1e9 else f"{n / 1e6:.0f}M" if n >= 1e6 else f"{n / 1e3:.0f}K"


def _ago(t: float) -> str:
    d = max(time.time() - t, 0)
    for unit, k in (("days", 86400), ("hours", 3600), ("minutes", 60)):
        if d >= k:
            return f"{int(d // k)} {unit} ago"
    return "just now"


def _table(rows: list) -> str:
    w = [max(len(str(r[i])) for r in rows) for i in range(len(rows[0]))]
    return "\n".join("   ".join(str(c).ljust(w[i]) for i, c in enumerate(r)).rstrip() for r in rows)


def cmd_list(args) -> int:
    models = {}
    if args.models_dir:
        if not os.path.isdir(args.models_dir):
            print(f"llampy list: --models-dir {args.models_dir}: no such folder", file=sys.stderr)
            return 1
        from .server.router import scan_models
        models.update(scan_models(args.models_dir))
    for name, path in _builtin().items():
        models.setdefault(name, path)
    items = []
    for name, path in sorted(models.items()):
        st = Path(path).stat()
        items.append({"name": name, "path": str(path), "size": st.st_size, "modified": st.st_mtime})
    if args.json:
        print(json.dumps(items))
        return 0
    rows = [("NAME", "SIZE", "MODIFIED", "PATH")]
    rows += [(m["name"], _size(m["size"]), _ago(m["modified"]), m["path"]) for m in items]
    print(_table(rows))
    return 0


def cmd_show(args) -> int:
    s = model_summary(_find(args.model, args.models_dir))
    if args.template:
        if s["chat_template"] is None:
            print(f"llampy show: {s['name']} has no chat template", file=sys.stderr)
            return 1
        print(s["chat_template"])
        return 0
    if args.json:
        print(json.dumps(s, ensure_ascii=False))
        return 0
    rows = [("architecture", s["architecture"]), ("parameters", _params(s["parameters"])),
            ("context length", s["context_length"]), ("embedding length", s["embedding_length"]),
            ("layers", s["block_count"]), ("heads", s["head_count"]), ("quantization", s["quantization"]),
            ("vocabulary", f"{s['vocab']['type']}, {s['vocab']['size']} tokens"), ("file size", _size(s["size"])),
            ("chat template", "yes" if s["chat_template"] else "no")]
    print("  Model")
    print("\n".join(f"    {k:<18}{v}" for k, v in rows if v is not None))
    print("\n  Capabilities")
    print("\n".join(f"    {c}" for c in s["capabilities"]))
    if s["license"]:
        print(f"\n  License\n    {s['license']}")
    return 0


def cmd_ps(args) -> int:
    import httpx
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    try:
        r = httpx.get(args.url.rstrip("/") + "/v1/models", headers=headers, timeout=10)
    except httpx.HTTPError as e:
        print(f"llampy ps: no server at {args.url}: {e}", file=sys.stderr)
        return 1
    if r.status_code != 200:
        print(f"llampy ps: {args.url} answered {r.status_code}: {r.text[:200]}", file=sys.stderr)
        return 1
    data = r.json().get("data", [])
    # a single-model server lists its one model without a status: it is loaded
    loaded = [m for m in data if m.get("status", {"value": "loaded"}).get("value") == "loaded"]
    if args.json:
        print(json.dumps(loaded))
        return 0
    rows = [("NAME", "SIZE", "SLOTS", "CONTEXT", "IN FLIGHT", "UNTIL")]
    for m in loaded:
        meta = m.get("meta", {})
        exp = m.get("expires_at", "-" if "status" not in m else None)
        until = "Forever" if exp is None and m.get("in_flight", 0) == 0 else \
            "serving" if exp is None else exp if isinstance(exp, str) else _until(exp)
        rows.append((m["id"], _size(m["size"]) if "size" in m else "-", meta.get("n_parallel", "-"),
                     meta.get("n_ctx", "-"), m.get("in_flight", "-"), until))
    print(_table(rows))
    return 0


def _until(t: float) -> str:
    d = t - time.time()
    if d < 60:
        return f"{max(int(d), 0)} seconds from now"
    return f"{int(d // 60)} minutes from now"
