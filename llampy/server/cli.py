"""`llampy serve`: the OpenAI-compatible server (app.py) over one model with continuous batching (slots.py)."""
from __future__ import annotations

import sys


def add_serve_parser(sub) -> None:
    p = sub.add_parser("serve", help="OpenAI-compatible server with continuous batching and a chat page")
    p.add_argument("model", nargs="?", default=None, help="GGUF path, or 'smollm2' (default) / 'gemma3'")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default: loopback only)")
    p.add_argument("--port", type=int, default=8080)
    p.add_argument("--parallel", "-np", type=int, default=4, help="slots: requests decoded together (default 4)")
    p.add_argument("--ctx-size", "-c", type=int, default=4096,
                   help="KV cache cells in all, shared by the slots; each slot gets ctx-size / parallel")
    p.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' (all but /health)")
    p.add_argument("--alias", default=None, help="the model name reported to clients")
    p.set_defaults(func=cmd_serve)


def cmd_serve(args) -> int:
    import uvicorn

    from ..models import resolve_model
    from .app import Server, create_app
    if args.parallel < 1 or args.ctx_size // max(args.parallel, 1) < 8:
        print(f"llampy serve: --parallel {args.parallel} and --ctx-size {args.ctx_size} leave no room per slot",
              file=sys.stderr)
        return 2
    server = Server(resolve_model(args.model), args.parallel, args.ctx_size, args.api_key, args.alias)
    print(f"llampy: serving {server.model_id} on http://{args.host}:{args.port} "
          f"({args.parallel} slots of {args.ctx_size // args.parallel} tokens)", flush=True)
    try:
        uvicorn.run(create_app(server), host=args.host, port=args.port, log_level="warning")
    finally:
        server.engine.stop()
    return 0
