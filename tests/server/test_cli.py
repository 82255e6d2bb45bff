"""`llampy serve` as a subprocess: the CLI's flags, the API key, loopback binding."""
from __future__ import annotations

import subprocess
import sys

import httpx
import pytest

from .conftest import free_port, wait_health


@pytest.mark.slow
def test_serve_with_api_key():
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    proc = subprocess.Popen([sys.executable, "-m", "llampy", "serve", "--port", str(port), "--parallel", "2",
                             "--ctx-size", "512", "--api-key", "sekrit", "--alias", "smol"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        wait_health(url, proc=proc)
        assert httpx.get(url + "/health").status_code == 200          # open, for load balancers
        r = httpx.get(url + "/v1/models")
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
        r = httpx.get(url + "/v1/models", headers={"Authorization": "Bearer wrong"})
        assert r.status_code == 401
        ok = {"Authorization": "Bearer sekrit"}
        models = httpx.get(url + "/v1/models", headers=ok).json()
        assert models["data"][0]["id"] == "smol" and models["data"][0]["meta"]["n_parallel"] == 2
        r = httpx.post(url + "/v1/completions", headers=ok, timeout=120,
                       json={"model": "smol", "prompt": "Hello", "max_tokens": 2, "temperature": 0})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2
        assert httpx.post(url + "/v1/completions", json={"prompt": "x"}).status_code == 401
        # 2 slots of 256 tokens: a 300-token prompt is too long for a slot
        r = httpx.post(url + "/v1/completions", headers=ok, json={"prompt": "word " * 300, "max_tokens": 2})
        assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"
    finally:
        proc.terminate()
        out = proc.communicate(timeout=20)[0]
    assert "serving smol on http://127.0.0.1:" in out


def test_serve_help():
    out = subprocess.run([sys.executable, "-m", "llampy", "serve", "--help"], capture_output=True, text=True)
    assert out.returncode == 0
    for flag in ("--host", "--port", "--parallel", "--ctx-size", "--api-key"):
        assert flag in out.stdout
