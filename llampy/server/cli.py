"""`llampy serve`."""
from __future__ import annotations


def add_serve_parser(sub) -> None:
    p = sub.add_parser("serve", help="OpenAI-compatible server with continuous batching and a chat page")
    p.add_argument("model", nargs="?", default=None, help="GGUF path, or 'smollm2' (default) / 'gemma3'")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8080)
    p.add_argument("--parallel", "-np", type=int, default=4, help="slots: requests decoded together")
    p.add_argument("--ctx-size", "-c", type=int, default=4096, help="total KV cache, shared by the slots")
    p.add_argument("--api-key", default=None)
    p.add_argument("--alias", default=None, help="the model name clients use")
    p.set_defaults(func=cmd_serve)


def cmd_serve(args) -> int:
    import uvicorn

    from ..models import resolve_model
    from .app import Server, create_app
    server = Server(resolve_model(args.model), args.parallel, args.ctx_size, args.api_key, args.alias)
    print(f"llampy: serving {server.model_id} on http://{args.host}:{args.port} "
          f"({args.parallel} slots, ctx {args.ctx_size})", flush=True)
    uvicorn.run(create_app(server), host=args.host, port=args.port, log_level="warning")
    return 0
