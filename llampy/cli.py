"""The `llampy` command: run, chat, serve, bench, perplexity, tokenize, inspect.

Errors a user can cause (a missing or malformed file, an unknown architecture, a prompt longer than the context)
print one line, ``llampy: error: ...``, and exit with status 1 — never a traceback.
"""
from __future__ import annotations

import argparse
import json
import os
import sys


def cmd_inspect(args) -> int:
    from .gguf.inspect import format_report, inspect_report
    from .models import resolve_model
    rep = inspect_report(resolve_model(args.model))
    if args.json:
        print(json.dumps(rep, ensure_ascii=False))
    else:
        print(format_report(rep))
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
    from .cli_quant import add_quant_parsers
    add_quant_parsers(sub)
    from .cli_tools import add_tool_parsers
    add_tool_parsers(sub)
    try:
        from .server.cli import add_serve_parser
        add_serve_parser(sub)
    except ImportError:
        pass
    return ap


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    from . import tuning
    from .gguf import GGUFError
    from .llama.arch import UnknownArchitecture
    from .llama.context import ContextError
    from .llama.hparams import MissingMetadata
    from .llama.model import ModelLoadError
    from .models import ModelNotFound
    n_threads = getattr(args, "threads", None)
    if n_threads:
        # before anything imports Numba (tuning.install does): its pool is sized from this when it starts, and
        # Numba refuses a different value once it has (it rereads the variable at every compile)
        os.environ.setdefault("NUMBA_NUM_THREADS", str(n_threads))
    from .llama.devices import OffloadError
    import warnings
    # the command's own process: a warning is one line, as llama.cpp's log lines are
    warnings.showwarning = lambda message, category, *a, **k: print(f"llampy: warning: {message}", file=sys.stderr)
    try:
        tuning.install()      # the command's process is llampy's own: tune it before any kernel runs
        return args.func(args) or 0
    except OffloadError as e:
        print(f"llampy: error: {e}", file=sys.stderr)
        return 1
    except (tuning.TuningError, GGUFError, UnknownArchitecture, ContextError, MissingMetadata, ModelLoadError, ModelNotFound,
            FileNotFoundError, IsADirectoryError, PermissionError) as e:
        print(f"llampy: error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:
        return 0


if __name__ == "__main__":
    sys.exit(main())
