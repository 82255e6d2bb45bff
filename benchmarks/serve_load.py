#!/usr/bin/env python3
"""Load on `llampy serve`: aggregate generated tokens/s and latency (time to first token p50/p95) with 1, 4 and 8
concurrent streaming clients on the default model.

    python benchmarks/serve_load.py [--tokens 32] [--requests 8] [--streams 1 4 8] [--rounds 3]

The server runs as a subprocess on 127.0.0.1 with --parallel = the largest stream count. llama.cpp's llama-server
(`--llama-server PATH`, or llama-server in LLAMPY_LLAMACPP_TOOLS, which scripts/llamacpp_server.sh builds) runs
under the same load with the same slots and context. If llama-cpp-python's server (`python -m llama_cpp.server`)
is importable in benchmarks/.llamacpp-venv, it runs too.
Each server runs in its own process; the server's log goes to benchmarks/.serve_load.log. The load generator is one
thread of this process (asyncio, a raw HTTP/1.1 connection per request, parsing only the first token's event and
the usage), so that it takes little of the CPU that both servers share with it; each round prints its CPU per
generated token.

`--models A B ...` (GGUF paths, or smollm2 / gemma3): several models behind one server. Both servers run in router
mode over a folder of links to the files (`llampy serve --models-dir`, llama-server's `--models-dir`, each with
--models-max = the number of models and --parallel = the largest stream count over the models, rounded up); every
model is loaded by a warm-up request first, and request i asks for model i mod N.
"""
from __future__ import annotations

import argparse
import asyncio
import atexit
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
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
            # llama-cpp-python's server has no /health; both answer /v1/models once the model is loaded
            if httpx.get(url + "/v1/models", timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            time.sleep(0.2)
    raise RuntimeError("server did not come up")


def wait_prepared(url: str, timeout: float = 300) -> float:
    """Seconds until llampy's engine has built, and run once, the graphs it prepares while idle (decode steps,
    padded prompt pieces: its llampy_graphs_pending gauge at 0), as llama-server warms up before it answers: the
    rounds then time requests, not what the server does once after it starts. Returns at once where the gauge is
    absent."""
    t0 = time.time()
    while time.time() - t0 < timeout:
        rows = [line.split() for line in httpx.get(url + "/metrics", timeout=5).text.splitlines()
                if line.startswith("llampy_graphs_pending ")]
        if not rows or float(rows[0][1]) == 0:
            return time.time() - t0
        time.sleep(0.5)
    raise RuntimeError("llampy did not finish building its graphs")


def _request(url: str, path: str, body: dict) -> tuple[str, int, bytes]:
    """(host, port, the HTTP/1.1 request's bytes) of a JSON POST to ``url`` + ``path``."""
    hostport = url.split("://", 1)[1].rstrip("/")
    host, _, port = hostport.rpartition(":")
    data = json.dumps(body).encode()
    head = (f"POST {path} HTTP/1.1\r\nHost: {hostport}\r\nContent-Type: application/json\r\n"
            f"Accept: text/event-stream\r\nContent-Length: {len(data)}\r\nConnection: close\r\n\r\n")
    return host, int(port), head.encode() + data


class StreamFailed(Exception):
    pass


async def one_stream(url: str, i: int, n_tokens: int, model: str) -> tuple[float, float, int]:
    """Returns (time to first token, total time, tokens) of one streamed completion, over a connection of its own.

    The client reads the reply's bytes itself (HTTP/1.1, chunked or not) and parses only what it needs: the JSON of
    each SSE event until the first one with text (the time to first token), then only the event that holds the
    usage; the others are counted as they come and parsed only if the server sent no usage."""
    host, port, req = _request(url, "/v1/completions", {
        "model": model, "prompt": f"Write a short story about the number {i}.", "max_tokens": n_tokens,
        "temperature": 0.8, "seed": i, "stream": True, "ignore_eos": True, "stream_options": {"include_usage": True}})
    t0 = time.perf_counter()
    ttft, n, used = None, 0, None
    rest: list = []                     # events after the first token, parsed only if no usage comes
    reader, writer = await asyncio.open_connection(host, port)
    try:
        writer.write(req)
        head = await reader.readuntil(b"\r\n\r\n")
        status = head.split(b" ", 2)[1]
        if status != b"200":
            raise StreamFailed(f"HTTP {status.decode()}")
        chunked = b"transfer-encoding: chunked" in head.lower()
        buf, part, done = b"", b"", False
        while not done:
            data = await reader.read(65536)
            if not data:
                if chunked:
                    raise StreamFailed("the connection closed inside the reply")
                data, done = part + b"\n", True    # the last line, whatever ends it
                part = b""
            if chunked:                 # the chunks' payloads, as far as they have arrived
                buf += data
                body, pos = [], 0
                while True:
                    eol = buf.find(b"\r\n", pos)
                    if eol < 0:
                        break
                    size = int(buf[pos:eol].split(b";", 1)[0], 16)
                    if size == 0:
                        done = True
                        break
                    if len(buf) < eol + 2 + size + 2:
                        break
                    body.append(buf[eol + 2:eol + 2 + size])
                    pos = eol + 2 + size + 2
                buf = buf[pos:]
                data = b"".join(body)
                if done:
                    data += b"\n"
            lines = (part + data).split(b"\n")
            part = lines.pop()
            for line in lines:
                if not line.startswith(b"data:") or line.strip() == b"data: [DONE]":
                    continue
                if ttft is None:
                    ch = json.loads(line[5:])
                    if ch.get("choices") and ch["choices"][0].get("text"):
                        ttft = time.perf_counter() - t0
                        n += 1
                    elif ch.get("usage"):
                        used = ch["usage"]["completion_tokens"]
                elif b"completion_tokens" in line:
                    ch = json.loads(line[5:])
                    if ch.get("usage"):
                        used = ch["usage"]["completion_tokens"]
                    if ch.get("choices") and ch["choices"][0].get("text"):
                        n += 1
                else:
                    rest.append(line)
    finally:
        writer.close()
    t_end = time.perf_counter() - t0
    if used is None:                    # a chunk per token, unless the server reports usage (llampy holds back
        for line in rest:               # text that may start a stop string)
            ch = json.loads(line[5:])
            if ch.get("choices") and ch["choices"][0].get("text"):
                n += 1
    return ttft or 0.0, t_end, used if used is not None else n


async def _load(url: str, streams: int, requests: int, n_tokens: int, models: list) -> tuple[list, float]:
    gate = asyncio.Semaphore(streams)

    async def safe_stream(i):           # one_stream, or None when the server drops or refuses it (failed)
        async with gate:
            try:
                return await asyncio.wait_for(one_stream(url, i, n_tokens, models[i % len(models)]), 600)
            except (OSError, asyncio.IncompleteReadError, asyncio.LimitOverrunError, asyncio.TimeoutError,
                    ValueError, StreamFailed):
                return None
    t0 = time.perf_counter()
    res = await asyncio.gather(*(safe_stream(i) for i in range(requests)))
    return res, time.perf_counter() - t0


def run_load(url: str, streams: int, requests: int, n_tokens: int, models: list) -> dict:
    """``requests`` streamed completions, ``streams`` at a time; request i asks for models[i % len(models)].
    One thread of this process runs every stream (asyncio, a raw HTTP/1.1 connection each, see one_stream), so that
    the load generator takes little CPU from the server it measures on the same host: 32 threads of httpx clients
    that parsed every event's JSON took ~0.57 ms of CPU per generated token, ~7% of the CPU a token took at 32
    streams. ``client_ms_tok``: this process's CPU per generated token during the run."""
    c0 = time.process_time()
    res, wall = asyncio.run(_load(url, streams, requests, n_tokens, models))
    cpu = time.process_time() - c0
    failed = sum(r is None for r in res)
    res = [r for r in res if r is not None] or [(0.0, 0.0, 0)]
    ttfts = sorted(r[0] for r in res)
    lats = sorted(r[1] for r in res)
    toks = sum(r[2] for r in res)

    def p95(xs):
        return xs[min(len(xs) - 1, int(0.95 * len(xs)))]
    return {"streams": streams, "requests": requests, "tokens": toks, "wall_s": wall, "tok_s": toks / wall,
            "ttft_p50_s": statistics.median(ttfts), "ttft_p95_s": p95(ttfts),
            "lat_p50_s": statistics.median(lats), "lat_p95_s": p95(lats), "failed": failed,
            "client_ms_tok": 1e3 * cpu / max(toks, 1)}


def serve(cmd: list, port: int, log) -> subprocess.Popen:
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=HERE.parent)
    try:
        wait_up(f"http://127.0.0.1:{port}", proc, timeout=300)
    except RuntimeError:
        proc.terminate()
        raise
    return proc


def load_levels(name: str, url: str, args, rounds: int) -> list:
    """Each round runs every level once, so that a slow spell of a shared machine hits all levels alike; a level's
    row is its median round (by tokens/s), with the failures of all rounds."""
    for m in args.model_names:          # warm-up: every model loaded, kernels compiled or loaded, graphs built
        r = run_load(url, 1, 1, 4, [m])
        if r["failed"]:
            raise RuntimeError(f"{name}: the warm-up request for model {m!r} failed")
    runs: dict = {s: [] for s in args.streams}
    for k in range(rounds):
        for s in args.streams:
            r = run_load(url, s, max(args.requests, s), args.tokens, args.model_names)
            print(f"{name} (round {k + 1}/{rounds}): {s} streams, {r['tok_s']:.1f} generated tok/s, "
                  f"TTFT p50 {r['ttft_p50_s']:.2f} s, {r['failed']} failed, load generator "
                  f"{r['client_ms_tok']:.3f} ms CPU a token", flush=True)
            runs[s].append(r)
    rows = []
    for s in args.streams:
        rs = sorted(runs[s], key=lambda r: r["tok_s"])
        # the rounds after the first (whose slots start from other prompts) give the settled time to first token
        later = [r["ttft_p50_s"] for r in runs[s][1:]] or [runs[s][0]["ttft_p50_s"]]
        med = dict(rs[(len(rs) - 1) // 2], failed=sum(r["failed"] for r in rs), rounds=len(rs),
                   requests=sum(r["requests"] for r in rs), ttft_settled_s=statistics.median(later))
        rows.append((name, med))
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--requests", type=int, default=8, help="requests per load level (at least the streams)")
    ap.add_argument("--streams", type=int, nargs="+", default=[1, 4, 8])
    ap.add_argument("--rounds", type=int, default=3, help="rounds over all levels for llampy (median reported)")
    ap.add_argument("--llamacpp-rounds", type=int, default=1, help="rounds for llama-cpp-python's server")
    ap.add_argument("--no-llamacpp", action="store_true", help="skip llama-cpp-python's server")
    ap.add_argument("--llama-server", default=None, metavar="PATH",
                    help="llama.cpp's llama-server (default: LLAMPY_LLAMACPP_TOOLS/llama-server when it exists)")
    ap.add_argument("--llama-server-rounds", type=int, default=None, help="rounds for llama-server (default --rounds)")
    ap.add_argument("-t", "--threads", type=int, default=2, help="threads of each server's kernels (default 2)")
    ap.add_argument("--models", nargs="+", default=None, metavar="MODEL",
                    help="several models behind one server (router mode, --models-dir): GGUF paths, or smollm2 / "
                         "gemma3; request i asks for model i mod N")
    args = ap.parse_args(argv)
    sys.path.insert(0, str(HERE.parent))
    from llampy.models import resolve_model, smollm2_path
    models_dir = None
    if args.models:
        # a folder of links: each model named by its file name without .gguf, as both routers name them
        models_dir = Path(tempfile.mkdtemp(prefix="serve-load-models-"))
        atexit.register(shutil.rmtree, models_dir, ignore_errors=True)
        args.model_names = []
        for m in args.models:
            path = resolve_model(m).resolve()
            if path.stem in args.model_names:
                ap.error(f"--models: {path.name} is given twice")
            (models_dir / path.name).symlink_to(path)
            args.model_names.append(path.stem)
        n_par = -(-max(args.streams) // len(args.models))
        routed = ["--models-dir", str(models_dir), "--models-max", str(len(args.models))]
    else:
        args.model_names = ["default"]
        n_par = max(args.streams)
    rows = []
    # each server in its own process, as in production: the load generator must not share its GIL
    with open(HERE / ".serve_load.log", "w") as log:
        port = free_port()
        model_args = routed if models_dir else []
        proc = serve([sys.executable, "-m", "llampy", "serve", *model_args, "--port", str(port), "--parallel",
                      str(n_par), "--ctx-size", str(512 * n_par), "-t", str(args.threads)], port, log)
        try:
            print(f"llampy: graphs built while idle after start in {wait_prepared(f'http://127.0.0.1:{port}'):.1f} s",
                  flush=True)
            rows += load_levels("llampy", f"http://127.0.0.1:{port}", args, max(1, args.rounds))
        finally:
            proc.terminate()
            proc.wait(timeout=20)
        ls = args.llama_server or (os.path.join(os.environ["LLAMPY_LLAMACPP_TOOLS"], "llama-server")
                                   if os.environ.get("LLAMPY_LLAMACPP_TOOLS") else None)
        if ls and os.access(ls, os.X_OK):
            port = free_port()
            # the same slots, context and threads; its own defaults otherwise (continuous batching, unified KV
            # cache, prompt cache); --no-webui: the page is not part of the load
            model_args = routed if models_dir else ["-m", str(smollm2_path())]
            proc = serve([ls, *model_args, "--port", str(port), "-np", str(n_par), "-c", str(512 * n_par), "-t",
                          str(args.threads), "--no-webui"], port, log)
            try:
                rows += load_levels("llama-server", f"http://127.0.0.1:{port}", args,
                                   max(1, args.llama_server_rounds or args.rounds))
            finally:
                proc.terminate()
                proc.wait(timeout=20)
        else:
            print("(no llama-server: bash scripts/llamacpp_server.sh builds it into LLAMPY_LLAMACPP_TOOLS, or give "
                  "--llama-server PATH)\n")
        lc_py = HERE / ".llamacpp-venv" / "bin" / "python"
        if args.no_llamacpp or models_dir:      # llama-cpp-python's server serves one model
            pass
        elif lc_py.exists() and subprocess.run([lc_py, "-c", "import llama_cpp.server, uvicorn"],
                                               capture_output=True).returncode == 0:
            port = free_port()
            # llama-cpp-python's server: one llama.cpp context, requests served one at a time; it ignores
            # ignore_eos, so its requests may end early (its tokens are counted from its usage)
            try:
                proc = serve([str(lc_py), "-m", "llama_cpp.server", "--model", str(smollm2_path()), "--port",
                              str(port), "--n_threads", "2", "--n_ctx", "2048",
                              # queue concurrent requests instead of aborting the running one (its default)
                              "--interrupt_requests", "False"], port, log)
            except RuntimeError as e:
                print(f"(llama-cpp-python's server did not start: {e}; see benchmarks/.serve_load.log)\n")
            else:
                try:
                    rows += load_levels("llama-cpp-python", f"http://127.0.0.1:{port}", args,
                                       max(1, args.llamacpp_rounds))
                finally:
                    proc.terminate()
                    proc.wait(timeout=20)
        else:
            print("(llama-cpp-python's server is not installed in benchmarks/.llamacpp-venv, "
                  "pip install 'llama-cpp-python[server]' there: llampy only)\n")
    if models_dir:
        print(f"models {', '.join(args.model_names)} behind one server (router mode, --parallel {n_par} each), "
              f"request i to model i mod {len(args.model_names)}")
    print(f"{args.tokens} generated tokens per request; --parallel {n_par}; each row the median of its rounds\n")
    print("TTFT settled: the median of the TTFT p50 of the rounds after the first (the first round's slots start from "
          "other prompts)\n")
    print("| server | streams | rounds | requests (failed) | generated tok/s (vs 1 stream) | TTFT p50 | TTFT p95 "
          "| TTFT settled | latency p50 | latency p95 |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    base = {}
    for name, r in rows:
        base.setdefault(name, r["tok_s"])
        print(f"| {name} | {r['streams']} | {r['rounds']} | {r['requests']} ({r['failed']}) | {r['tok_s']:.1f} (x{r['tok_s'] / base[name]:.2f}) "
              f"| {r['ttft_p50_s']:.2f} s | {r['ttft_p95_s']:.2f} s | {r['ttft_settled_s']:.2f} s | {r['lat_p50_s']:.2f} s "
              f"| {r['lat_p95_s']:.2f} s |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
