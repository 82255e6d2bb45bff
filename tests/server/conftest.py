"""A real server on 127.0.0.1 (a free port), in a thread, on the default model."""
from __future__ import annotations

import socket
import threading
import time

import pytest


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="session")
def server_url():
    import httpx
    import uvicorn

    from llampy.models import smollm2_path
    from llampy.server.app import Server, create_app
    port = free_port()
    server = Server(smollm2_path(), n_parallel=4, n_ctx=2048)
    config = uvicorn.Config(create_app(server), host="127.0.0.1", port=port, log_level="warning")
    uv = uvicorn.Server(config)
    t = threading.Thread(target=uv.run, daemon=True)
    t.start()
    url = f"http://127.0.0.1:{port}"
    for _ in range(200):
        try:
            if httpx.get(url + "/health", timeout=1).status_code == 200:
                break
        except httpx.HTTPError:
            time.sleep(0.05)
    yield url
    uv.should_exit = True
    t.join(timeout=5)
    server.engine.stop()
