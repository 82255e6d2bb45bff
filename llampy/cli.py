"""The `llampy` command: run, chat, serve, bench, perplexity, tokenize, inspect.

Errors a user can cause (a missing or malformed file, an unknown architecture, a prompt longer than the context)
print one line, ``llampy: error: ...``, and exit with status 1 — never a traceback.
"""
from __future__ import annotations

import argparse
import json
import sys

import numpy as np


def _summ(v, limit: int = 8):
    if isinstance(v, np.ndarray):
        v = v.tolist()
    if isinstance(v, list):
        if len(v) <= limit:
            return v
        head = ", ".join(json.dumps(x, ensure_ascii=False)[:40] for x in v[:3])
        kind = "strings" if v and isinstance(v[0], str) else "values"
        return f"[{len(v)} {kind}: {head}, ...]"
    if isinstance(v, str) and len(v) > 200:
        return v[:200] + f"... ({len(v)} chars)"
    return v


def inspect_report(path) -> dict:
    from .gguf import GGUFReader
    r = GGUFReader(path)
    try:
        tensors = [{"name": t.name, "type": t.type.name, "shape": list(t.ne), "bytes": t.nbytes}
                   for t in r.tensors.values()]
        totals: dict = {}
        for t in tensors:
            e = totals.setdefault(t["type"], {"count": 0, "bytes": 0})
            e["count"] += 1
            e["bytes"] += t["bytes"]
        md = {k: _summ(v) for k, v in r.metadata.items()}
        return {"path": str(path), "version": r.version, "alignment": r.alignment, "file_size": r.file_size,
                "metadata": md, "tensors": tensors, "totals": totals,
                "n_params": int(sum(int(np.prod(t["shape"])) for t in tensors))}
    finally:
        r.close()


def cmd_inspect(args) -> int:
    from .models import resolve_model
    rep = inspect_report(resolve_model(args.model))
    if args.json:
        print(json.dumps(rep, ensure_ascii=False, indent=1, default=str))
        return 0
    print(f"{rep['path']}: GGUF v{rep['version']}, {rep['file_size'] / 2**20:.1f} MiB, "
          f"{len(rep['tensors'])} tensors, {rep['n_params'] / 1e6:.1f}M parameters")
    print("\nmetadata:")
    for k, v in rep["metadata"].items():
        print(f"  {k:<44} {v}")
    print("\ntensors:")
    for t in rep["tensors"]:
        print(f"  {t['name']:<40} {t['type']:<8} {str(t['shape']):<22} {t['bytes']:>12}")
    print("\ntotals per type:")
    for ty, e in sorted(rep["totals"].items(), key=lambda kv: -kv[1]["bytes"]):
        print(f"  {ty:<8} {e['count']:>5} tensors {e['bytes'] / 2**20:>10.2f} MiB")
    return 0


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="llampy", description="the llama.cpp system, in Python")
    sub = ap.add_subparsers(dest="command", required=True)
    p = sub.add_parser("inspect", help="metadata, tensors and totals of a GGUF file")
    p.add_argument("model", nargs="?", default=None, help="GGUF path, or 'smollm2' (default) / 'gemma3'")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_inspect)
    from .cli_engine import add_engine_parsers
    add_engine_parsers(sub)
    try:
        from .server.cli import add_serve_parser
        add_serve_parser(sub)
    except ImportError:
        pass
    return ap


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    from .gguf import GGUFError
    from .llama.arch import UnknownArchitecture
    from .llama.context import ContextError
    from .llama.hparams import MissingMetadata
    from .llama.model import ModelLoadError
    from .models import ModelNotFound
    try:
        return args.func(args) or 0
    except (GGUFError, UnknownArchitecture, ContextError, MissingMetadata, ModelLoadError, ModelNotFound,
            FileNotFoundError, IsADirectoryError, PermissionError) as e:
        print(f"llampy: error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:
        return 0


if __name__ == "__main__":
    sys.exit(main())
