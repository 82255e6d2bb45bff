"""A real server on 127.0.0.1 (a free port), uvicorn in a thread, on the default model; shared by the server tests.

4 slots of 512 tokens (ctx-size 2048). Helpers for raw HTTP and SSE live here too."""
from __future__ import annotations

import json
import os
import socket
import threading
import time
from pathlib import Path

import pytest

SHARED = Path(os.environ.get("LLAMPY_SHARED", Path(__file__).resolve().parents[2] / ".." / "shared"))
LLAMACPP = SHARED / "fixtures" / "llamacpp"
N_PARALLEL, N_CTX = 4, 2048


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_health(url: str, timeout: float = 120.0, proc=None) -> None:
    import httpx
    t0 = time.time()
    while time.time() - t0 < timeout:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"the server exited with {proc.returncode}")
        try:
            if httpx.get(url + "/health", timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    raise RuntimeError(f"{url} did not come up in {timeout} s")


def serve_in_thread(app):
    import uvicorn
    port = free_port()
    uv = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    t = threading.Thread(target=uv.run, daemon=True)
    t.start()
    url = f"http://127.0.0.1:{port}"
    wait_health(url)
    return url, uv, t


@pytest.fixture(scope="session")
def llama_server():
    from llampy.models import smollm2_path
    from llampy.server.app import Server
    server = Server(smollm2_path(), n_parallel=N_PARALLEL, n_ctx=N_CTX)
    yield server
    server.engine.stop()


@pytest.fixture(scope="session")
def server_url(llama_server):
    from llampy.server.app import create_app
    url, uv, t = serve_in_thread(create_app(llama_server))
    yield url
    uv.should_exit = True
    t.join(timeout=5)


def sse_datas(lines) -> list:
    """The payloads of the 'data:' lines of an SSE stream, as strings."""
    return [line[5:].strip() for line in lines if line.startswith("data:")]


def metric(url: str, name: str) -> float:
    import httpx
    for line in httpx.get(url + "/metrics").text.splitlines():
        if line.startswith(f"llampy_{name} "):
            return float(line.split()[1])
    raise KeyError(name)


def wait_metric(url: str, name: str, value: float, timeout: float = 20.0) -> float:
    t0 = time.time()
    while time.time() - t0 < timeout:
        v = metric(url, name)
        if v == value:
            return v
        time.sleep(0.05)
    return metric(url, name)


def load_ref() -> dict:
    return json.loads((LLAMACPP / "smollm2-135m-q4_1.json").read_text())
