#!/usr/bin/env python3
"""Load on `llampy serve`: aggregate generated tokens/s and latency (time to first token p50/p95) with 1, 4 and 8
concurrent streaming clients on the default model.

    python benchmarks/serve_load.py [--tokens 32] [--requests 8] [--streams 1 4 8]

The server runs as a subprocess on 127.0.0.1 with --parallel = the largest stream count. If llama-cpp-python's
server (`python -m llama_cpp.server`) is importable in benchmarks/.llamacpp-venv, it runs under the same load.
"""
from __future__ import annotations

import argparse
import concurrent.futures as cf
import json
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx

HERE = Path(__file__).resolve().parent


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_up(url: str, proc, timeout: float = 120) -> None:
    t0 = time.time()
    while time.time() - t0 < timeout:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}")
        try:
            if httpx.get(url + "/health", timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            time.sleep(0.2)
    raise RuntimeError("server did not come up")


def one_stream(url: str, i: int, n_tokens: int, model: str) -> tuple[float, float, int]:
    """Returns (time to first token, total time, tokens)."""
    t0 = time.perf_counter()
    ttft, n = None, 0
    body = {"model": model, "prompt": f"Write a short story about the number {i}.", "max_tokens": n_tokens,
            "temperature": 0.8, "seed": i, "stream": True, "ignore_eos": True}
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=600) as r:
        for line in r.iter_lines():
            if not line.startswith("data:") or line.strip() == "data: [DONE]":
                continue
            ch = json.loads(line[5:])
            if ch.get("choices") and ch["choices"][0].get("text") is not None:
                if ttft is None:
                    ttft = time.perf_counter() - t0
                n += 1
    return ttft or 0.0, time.perf_counter() - t0, n


def run_load(url: str, streams: int, requests: int, n_tokens: int, model: str) -> dict:
    t0 = time.perf_counter()
    with cf.ThreadPoolExecutor(streams) as ex:
        res = list(ex.map(lambda i: one_stream(url, i, n_tokens, model), range(requests)))
    wall = time.perf_counter() - t0
    ttfts = sorted(r[0] for r in res)
    toks = sum(r[2] for r in res)
    q = lambda p: ttfts[min(len(ttfts) - 1, int(p * len(ttfts)))]
    return {"streams": streams, "requests": requests, "tokens": toks, "wall_s": wall, "tok_s": toks / wall,
            "ttft_p50_s": statistics.median(ttfts), "ttft_p95_s": q(0.95)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--requests", type=int, default=8, help="requests per load level")
    ap.add_argument("--streams", type=int, nargs="+", default=[1, 4, 8])
    args = ap.parse_args(argv)
    import threading

    import uvicorn

    sys.path.insert(0, str(HERE.parent))
    from llampy.models import smollm2_path
    from llampy.server.app import Server, create_app
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    server = Server(smollm2_path(), max(args.streams), 512 * max(args.streams))
    uv = uvicorn.Server(uvicorn.Config(create_app(server), host="127.0.0.1", port=port, log_level="warning"))
    th = threading.Thread(target=uv.run, daemon=True)
    th.start()
    rows = []
    try:
        for _ in range(600):
            try:
                if httpx.get(url + "/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.1)
        run_load(url, 1, 1, 4, "default")       # warm-up: kernels compiled, graphs built
        for s in args.streams:
            rows.append(("llampy", run_load(url, s, max(args.requests, s), args.tokens, "default")))
    finally:
        uv.should_exit = True
        th.join(timeout=10)
        server.engine.stop()
    lc_py = HERE / ".llamacpp-venv" / "bin" / "python"
    if lc_py.exists() and subprocess.run([lc_py, "-c", "import llama_cpp.server"], capture_output=True).returncode == 0:
        from llampy.models import smollm2_path
        port = free_port()
        url = f"http://127.0.0.1:{port}"
        proc = subprocess.Popen([lc_py, "-m", "llama_cpp.server", "--model", str(smollm2_path()), "--port", str(port),
                                 "--n_threads", "2"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            wait_up(url, proc)
            for s in args.streams:
                rows.append(("llama-cpp-python", run_load(url, s, max(args.requests, s), args.tokens, "default")))
        except RuntimeError as e:
            print(f"(llama-cpp-python's server could not run here: {e}; its extras are not installed)\n")
        finally:
            proc.terminate()
    else:
        print("(llama-cpp-python's server is not installed in benchmarks/.llamacpp-venv: llampy only)\n")
    print("| server | streams | requests | generated tok/s | TTFT p50 | TTFT p95 |")
    print("| --- | --- | --- | --- | --- | --- |")
    base = {}
    for name, r in rows:
        base.setdefault(name, r["tok_s"])
        print(f"| {name} | {r['streams']} | {r['requests']} | {r['tok_s']:.1f} (x{r['tok_s'] / base[name]:.2f}) "
              f"| {r['ttft_p50_s']:.2f} s | {r['ttft_p95_s']:.2f} s |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
