"""`llampy serve`: the OpenAI-compatible server (app.py) over one model with continuous batching (slots.py)."""
from __future__ import annotations

import sys
import time


def add_serve_parser(sub) -> None:
    p = sub.add_parser("serve", help="OpenAI-compatible server with continuous batching and a chat page")
    p.add_argument("model", nargs="?", default=None, help="GGUF path, or 'smollm2' (default) / 'gemma3'")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default: loopback only)")
    p.add_argument("--port", type=int, default=8080)
    from ..cli_engine import add_cache_args, add_offload_args
    add_offload_args(p)
    add_cache_args(p)
    p.add_argument("--parallel", "-np", type=int, default=4, help="slots: requests decoded together (default 4)")
    p.add_argument("--ctx-size", "-c", type=int, default=4096,
                   help="KV cache cells in all, shared by the slots; each slot gets ctx-size / parallel")
    p.add_argument("-t", "--threads", type=int, default=None, help="CPU threads of the kernels (default: all)")
    p.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' (all but /health)")
    p.add_argument("--alias", default=None, help="the model name reported to clients")
    p.add_argument("--mmproj", default=None, metavar="FILE",
                   help="the model's projector GGUF: image_url parts and multimodal_data are then accepted")
    p.add_argument("--no-mmproj-offload", dest="mmproj_offload", action="store_false",
                   help="encode images on the CPU even when the model has GPU layers (default: on its first GPU)")
    p.add_argument("--lora", action="append", default=None, metavar="FILE",
                   help="a GGUF LoRA adapter at scale 1 (repeatable; GET/POST /lora-adapters, a request's 'lora')")
    p.add_argument("--lora-scaled", nargs=2, action="append", default=None, metavar=("FILE", "SCALE"),
                   help="a GGUF LoRA adapter at SCALE (repeatable)")
    p.add_argument("--lora-init-without-apply", action="store_true",
                   help="load the adapters with scale 0 (POST /lora-adapters or a request's 'lora' applies them)")
    p.add_argument("--allow-remote-images", action="store_true",
                   help="fetch http(s) image URLs (by default only base64 data URLs are taken)")
    p.add_argument("--cors-origins", default="localhost",
                   help="origins browsers may call from: 'localhost' (default: pages served from this machine), "
                        "'*' (any), or a comma-separated list")
    p.add_argument("--cors-methods", default="GET, POST, OPTIONS", help="methods a CORS preflight allows")
    p.add_argument("--cors-headers", default="*", help="request headers a CORS preflight allows")
    p.add_argument("--cors-credentials", action="store_true", help="allow credentials in CORS requests")
    p.add_argument("--slot-save-path", default=None,
                   help="folder for POST /slots/{id}?action=save|restore (slot KV caches as files)")
    p.add_argument("--prompt-cache", default=None,
                   help="file of the slots' cached prompts: restored at start, written at shutdown")
    p.add_argument("--ctx-checkpoints", "-ctxcp", type=int, default=32, metavar="N",
                   help="recurrent/hybrid models: states kept per slot, taken near each prompt's end, so that a "
                        "prompt sharing a prefix restarts from the last one inside it (default 32; 0: none)")
    p.add_argument("--shutdown-timeout", type=float, default=30.0,
                   help="seconds requests in flight may take to finish after SIGTERM/SIGINT before they are "
                        "ended (default 30)")
    p.add_argument("--log-format", choices=("json", "text", "none"), default="json",
                   help="the per-request log lines on stderr (default json)")
    add_spec_args(p)
    g = p.add_argument_group("several models (router)")
    g.add_argument("--models-dir", default=None, metavar="DIR",
                   help="serve every GGUF of DIR, named by file (no MODEL then): loaded on first use by a request's "
                        "'model', unloaded when idle for --keep-alive")
    g.add_argument("--models-max", type=int, default=4, metavar="N",
                   help="models loaded at once at most; the least recently used idle one makes room (default 4)")
    g.add_argument("--keep-alive", default="5m", metavar="DURATION",
                   help="how long an idle model stays loaded: seconds or 30s/5m/1h; negative: always (default 5m)")
    g.add_argument("--no-models-autoload", dest="models_autoload", action="store_false",
                   help="load models only through POST /models/load")
    p.set_defaults(func=cmd_serve)


def add_spec_args(p) -> None:
    """Speculative decoding, under llama.cpp's names (its current --spec-* ones and the older --draft-*)."""
    g = p.add_argument_group("speculative decoding")
    g.add_argument("--model-draft", "-md", "--spec-draft-model", dest="model_draft", default=None, metavar="FILE",
                   help="draft model (a GGUF with the target's vocabulary): it drafts tokens the model checks in one "
                        "batch; greedy output is the same as without it")
    g.add_argument("--spec-type", default=None, metavar="TYPES",
                   help="comma-separated: draft-simple (the draft model), ngram-simple (prompt lookup, no model), "
                        "none (default: draft-simple with --model-draft, else none)")
    g.add_argument("--draft-max", "--draft", "--draft-n", "--spec-draft-n-max", dest="draft_max", type=int, default=3,
                   metavar="N", help="tokens the draft model drafts per step at most (default 3)")
    g.add_argument("--draft-min", "--draft-n-min", "--spec-draft-n-min", dest="draft_min", type=int, default=0,
                   metavar="N", help="a shorter draft of the draft model is dropped (default 0)")
    g.add_argument("--draft-p-min", "--spec-draft-p-min", dest="draft_p_min", type=float, default=0.0, metavar="P",
                   help="the draft model stops where its top token's probability falls below P (default 0)")
    g.add_argument("--draft-whole", action="store_true",
                   help="check every draft whole, as llama.cpp does (default: each step checks the part of the "
                        "drafts expected to pay, from the measured step times and acceptance rates)")
    g.add_argument("--spec-ngram-simple-size-n", dest="ngram_n", type=int, default=12, metavar="N",
                   help="ngram-simple: tokens looked up in the history (default 12)")
    g.add_argument("--spec-ngram-simple-size-m", dest="ngram_m", type=int, default=48, metavar="M",
                   help="ngram-simple: tokens drafted after a match at most (default 48)")


def spec_params(args):
    """SpecParams of the speculative options (None: no drafting); SpeculativeError for bad values."""
    from ..llama.speculative import SpecParams, SpeculativeError
    if args.spec_type is None:
        types = ("draft-simple",) if args.model_draft else ("none",)
    else:
        types = tuple(t.strip() for t in args.spec_type.split(",") if t.strip()) or ("none",)
    if "draft-simple" in types and not args.model_draft:
        raise SpeculativeError("--spec-type draft-simple needs a draft model (--model-draft FILE)")
    sp = SpecParams(types=types, n_max=args.draft_max, n_min=args.draft_min, p_min=args.draft_p_min,
                    ngram_size_n=args.ngram_n, ngram_size_m=args.ngram_m, plan=not args.draft_whole)
    return sp if sp.enabled() else None


class LoadProgress:
    """llama.cpp's loading dots, as percentages on one line of stderr: every 10%, then a newline at 100%."""

    def __init__(self, name: str, stream=None):
        self.stream, self.shown = stream or sys.stderr, -1
        self.t0 = time.perf_counter()
        print(f"llampy: loading {name} ", end="", file=self.stream, flush=True)

    def __call__(self, frac: float) -> bool:
        step = int(frac * 10)
        if step > self.shown:
            self.shown = step
            end = f" ({time.perf_counter() - self.t0:.1f} s)\n" if step >= 10 else ""
            print(f"{step * 10}%" + ("" if step >= 10 else " "), end=end, file=self.stream, flush=True)
        return True


def cmd_serve(args) -> int:
    from ..models import resolve_model
    from .app import Server, create_app
    from .ops import make_uvicorn, setup_logging
    from ..cli_engine import cache_kw, offload_kw
    if args.parallel < 1 or args.ctx_size // max(args.parallel, 1) < 8:
        print(f"llampy serve: --parallel {args.parallel} and --ctx-size {args.ctx_size} leave no room per slot",
              file=sys.stderr)
        return 2
    if args.threads is not None and args.threads < 1:
        print(f"llampy serve: --threads must be at least 1, got {args.threads}", file=sys.stderr)
        return 2
    if args.ctx_checkpoints < 0:
        print(f"llampy serve: --ctx-checkpoints must be 0 or more, got {args.ctx_checkpoints}", file=sys.stderr)
        return 2
    if args.slot_save_path:
        import os
        os.makedirs(args.slot_save_path, exist_ok=True)
    from ..llama.speculative import SpeculativeError
    try:
        spec = spec_params(args)
    except SpeculativeError as e:
        print(f"llampy serve: {e}", file=sys.stderr)
        return 2
    if args.models_dir is not None and args.model is not None:
        print("llampy serve: give a MODEL or --models-dir, not both", file=sys.stderr)
        return 2
    if args.models_max < 1:
        print(f"llampy serve: --models-max must be at least 1, got {args.models_max}", file=sys.stderr)
        return 2
    if args.log_format != "none":
        setup_logging(args.log_format)
    if args.models_dir is not None:
        return _serve_router(args, spec)
    path = resolve_model(args.model)
    from ..llama.lora import LoraError, parse_lora_args
    try:
        lora = parse_lora_args(args.lora, args.lora_scaled)
    except ValueError:
        print("llampy serve: --lora-scaled takes a FILE and a number", file=sys.stderr)
        return 2
    if args.lora_init_without_apply:
        lora = [(p, 0.0) for p, _ in lora]
    from pathlib import Path
    for p, _ in lora:
        if not Path(p).is_file():
            print(f"llampy serve: LoRA adapter {p} not found", file=sys.stderr)
            return 2
    try:
        server = Server(path, args.parallel, args.ctx_size, args.api_key, args.alias, n_threads=args.threads,
                        slot_save_path=args.slot_save_path, prompt_cache=args.prompt_cache,
                        progress=LoadProgress(path.name), offload=offload_kw(args), mmproj=args.mmproj,
                        mmproj_offload=args.mmproj_offload,
                        allow_remote_images=args.allow_remote_images, spec=spec,
                        model_draft=resolve_model(args.model_draft)
                        if spec is not None and "draft-simple" in spec.types else None, lora=lora,
                        ctx_checkpoints=args.ctx_checkpoints, cache_types=cache_kw(args))
    except (SpeculativeError, LoraError) as e:   # a draft model of another vocabulary, a recurrent target; an adapter
        # of another architecture or shape
        print(f"llampy: error: {e}", file=sys.stderr)
        return 1
    if server.n_restored:
        print(f"llampy: restored {server.n_restored} cached prompt tokens from {args.prompt_cache}", file=sys.stderr)
    print(f"llampy: serving {server.model_id} on http://{args.host}:{args.port} "
          f"({args.parallel} slots of {args.ctx_size // args.parallel} tokens)", flush=True)
    cors = {"origins": args.cors_origins, "methods": args.cors_methods, "headers": args.cors_headers,
            "credentials": args.cors_credentials}
    # uvicorn re-raises the signal that stopped it once it has shut down; received here it has done its work
    import signal
    old = {sig: signal.signal(sig, lambda *_: None) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        make_uvicorn(create_app(server, cors=cors), server, args.host, args.port, args.shutdown_timeout).run()
    finally:
        for sig, h in old.items():
            signal.signal(sig, h)
        server.engine.stop()
        n = server.save_prompt_cache()
        if n:
            print(f"llampy: saved {n} cached prompt tokens to {args.prompt_cache}", file=sys.stderr)
    print("llampy: stopped", file=sys.stderr, flush=True)
    return 0


def _serve_router(args, spec) -> int:
    """llampy serve --models-dir: the router over the folder's models (router.py)."""
    import signal
    import threading
    import uvicorn
    from .app import Server, create_app
    from .oai import APIError
    from .ops import shutdown_engine
    from .router import Router, RouterApp, parse_keep_alive
    from ..cli_engine import cache_kw, offload_kw
    try:
        keep_alive = parse_keep_alive(args.keep_alive)
    except APIError as e:
        print(f"llampy serve: --keep-alive: {e.message}", file=sys.stderr)
        return 2
    cors = {"origins": args.cors_origins, "methods": args.cors_methods, "headers": args.cors_headers,
            "credentials": args.cors_credentials}
    draft = None
    if spec is not None and "draft-simple" in spec.types:
        from ..models import resolve_model
        draft = resolve_model(args.model_draft)

    def make_server(path, name):
        return Server(path, args.parallel, args.ctx_size, None, name, n_threads=args.threads,
                      slot_save_path=args.slot_save_path, progress=LoadProgress(path.name), offload=offload_kw(args),
                      spec=spec, model_draft=draft, ctx_checkpoints=args.ctx_checkpoints,
                      cache_types=cache_kw(args))

    router = Router(args.models_dir, make_server, lambda s: create_app(s, cors=cors), keep_alive=keep_alive,
                    models_max=args.models_max, autoload=args.models_autoload)
    names = ", ".join(sorted(router.entries)) or "none yet"
    print(f"llampy: serving the models of {args.models_dir} ({names}) on http://{args.host}:{args.port}",
          flush=True)

    class Graceful(uvicorn.Server):
        def handle_exit(self, sig, frame):
            first = not self.should_exit
            super().handle_exit(sig, frame)
            if first:
                for e in router.loaded():
                    threading.Thread(target=shutdown_engine, args=(e.server, args.shutdown_timeout),
                                     daemon=True).start()

    app = RouterApp(router, api_key=args.api_key, cors=cors)
    old = {sig: signal.signal(sig, lambda *_: None) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        Graceful(uvicorn.Config(app, host=args.host, port=args.port, log_level="warning",
                                timeout_graceful_shutdown=args.shutdown_timeout + 30)).run()
    finally:
        for sig, h in old.items():
            signal.signal(sig, h)
        router.close()
    print("llampy: stopped", file=sys.stderr, flush=True)
    return 0
