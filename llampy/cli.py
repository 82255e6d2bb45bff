"""The `llampy` command: run, chat, serve, bench, perplexity, tokenize, embed, inspect, list, show, ps.

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
    path = resolve_model(args.model)
    rep = inspect_report(path)
    state = _recurrent_state_bytes(path)
    if state:
        rep["recurrent_state_bytes_per_seq"] = state
    if args.json:
        print(json.dumps(rep, ensure_ascii=False))
    else:
        print(format_report(rep))
        if state:
            print(f"recurrent state per sequence: {state} bytes ({state / 2**20:.2f} MiB, F32)")
    return 0


def _recurrent_state_bytes(path) -> int:
    """The recurrent state one sequence holds in a model with recurrent layers (0 for others, and where the file's
    hyper-parameters do not load: the report above still shows what the file holds)."""
    from .gguf import GGUFReader
    from .llama import arch as arch_mod
    from .llama.hparams import load_hparams
    from .llama.memory import state_bytes_per_seq
    try:
        with GGUFReader(path) as r:         # metadata arrays are views of the mapping: read them inside
            md = r.metadata
            hp = load_hparams(md, arch_mod.arch_module(str(md.get("general.architecture", ""))))
    except Exception:       # noqa: BLE001 -- inspect reports any file; an unloadable one has no state to add
        return 0
    return state_bytes_per_seq(hp) if getattr(hp, "recurrent_layers", None) else 0


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The whole command line; with ``command`` "quantize" or "imatrix", only those two (the other commands' modules,
    imported to declare their options, are ~10 ms of a quantize run that llama-quantize finishes in 0.1 s)."""
    ap = argparse.ArgumentParser(prog="llampy", description="the llama.cpp system, in Python")
    sub = ap.add_subparsers(dest="command", required=True)
    if command in _QUANT_COMMANDS:
        from .cli_quant import add_quant_parsers
        add_quant_parsers(sub)
        return ap
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
    from .cli_embed import add_embed_parser
    add_embed_parser(sub)
    from .cli_models import add_models_parsers
    add_models_parsers(sub)
    try:
        from .server.cli import add_serve_parser
        add_serve_parser(sub)
    except ImportError:
        pass
    from .cluster.cli import add_cluster_parser     # imports no Ray: the command says when it is missing
    add_cluster_parser(sub)
    return ap


_QUANT_COMMANDS = ("quantize", "imatrix")

# numeric options that must be at least 1 (or 0): argparse's error (usage, one line, status 2) rather than what
# a negative thread count or batch size would do deeper down
_AT_LEAST = {"threads": 1, "parallel": 1, "batch_size": 1, "ubatch_size": 1, "reps": 1, "chunks": 1, "jobs": 1,
             "n_prompt": 0, "n_gen": 0, "n_probs": 0, "top_k": 0, "ctx_size": 0}


def check_args(ap: argparse.ArgumentParser, args) -> None:
    for name, lo in _AT_LEAST.items():
        v = getattr(args, name, None)
        if isinstance(v, int) and v < lo:
            ap.error(f"--{name.replace('_', '-')} must be at least {lo}, not {v}")
    port = getattr(args, "port", None)
    if isinstance(port, int) and not 0 <= port <= 65535:
        ap.error(f"--port must be in 0..65535, not {port}")


def main(argv=None) -> int:
    program = argv is None              # the process's own command line: the process ends after the command
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv and argv[0] == "quantize":
        from .tuning import start_up_gc
        with start_up_gc(program):      # the collector paused while NumPy and Numba load (tuning.start_up_gc)
            rc = _main(argv, program)
        if program:
            _end_process(rc)
        return rc
    return _main(argv)


def _end_process(rc: int) -> None:
    """The quantize command's own process ends as llama-quantize's does, once its output is flushed: without the
    interpreter's shutdown (its module teardown and atexit handlers: 15-30 ms after a quantize run of ~0.6 s, where
    the command has closed its files and joined its threads)."""
    try:
        sys.stdout.flush()
        sys.stderr.flush()
    except (OSError, ValueError):
        pass
    os._exit(rc)


def _main(argv: list, program: bool = False) -> int:
    if argv and argv[0] == "quantize" and "numpy" not in sys.modules:
        # the command's own process, before NumPy loads OpenBLAS: quantize multiplies no matrices, and OpenBLAS
        # starts a spinning thread per core at load (~0.04 s of CPU in a run llama-quantize does in 0.3 s)
        os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
    ap = build_parser(argv[0] if argv else None)
    args = ap.parse_args(argv)
    args.own_process = program          # the command is the process's own (quantize: llama.quant's own_process)
    check_args(ap, args)
    if getattr(args, "no_engine", False):
        return _main_no_engine(args)
    from . import tuning
    from .gguf import GGUFError
    from .llama.arch import UnknownArchitecture
    from .llama.chat import ChatTemplateError
    from .llama.context import ContextError
    from .llama.hparams import MissingMetadata
    from .llama.model import ModelLoadError
    from .llama.vocab import VocabError
    from .models import ModelNotFound
    from .mtmd import ImageError, MediaError, ProjectorError
    n_threads = getattr(args, "threads", None)
    if n_threads:
        # before anything imports Numba (tuning.install does): its pool is sized from this when it starts, and
        # Numba refuses a different value once it has (it rereads the variable at every compile)
        from . import tuning as _tuning
        _tuning.size_numba_pool(n_threads)
    from .llama.devices import OffloadError
    import warnings
    # the command's own process: a warning is one line, as llama.cpp's log lines are
    warnings.showwarning = lambda message, category, *a, **k: print(f"llampy: warning: {message}", file=sys.stderr)
    # the command's process is llampy's own: tune it before any kernel runs
    return _run(args, (OffloadError, tuning.TuningError, GGUFError, UnknownArchitecture, ContextError,
                       MissingMetadata, ModelLoadError, ModelNotFound, VocabError, ChatTemplateError,
                       FileNotFoundError, IsADirectoryError, PermissionError, ProjectorError, ImageError, MediaError),
                before=tuning.install)


def _main_no_engine(args) -> int:
    """A command that runs no model (quantize): without the engine's imports and process tuning, which would cost
    it about a second of start-up."""
    from .gguf import GGUFError
    return _run(args, (GGUFError, FileNotFoundError, IsADirectoryError, PermissionError))


def _run(args, errors: tuple, before=None) -> int:
    """The command, with the errors a user can cause as one line instead of a traceback."""
    try:
        if before is not None:
            before()
        return args.func(args) or 0
    except errors as e:
        print(f"llampy: error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:
        return 0


if __name__ == "__main__":
    sys.exit(main())
