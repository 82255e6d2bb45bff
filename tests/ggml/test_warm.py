"""The cold-start helper (llampy/ggml/backends/cpu/warm.py, llampy/llama/warm.py): it fills the kernel cache, and
it goes with its parent."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest

from tests.paths import ROOT

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/PID/status (Linux)")

_COLD = """
import sys
import llampy.ggml.backends.cpu
from llampy.ggml.backends.cpu import warm
from llampy.ggml.types import GGMLType as T
print(int(warm.cold([T.F32, T.Q4_1, T.Q8_0])))
"""


def _env(cache, **kw):
    env = dict(os.environ, NUMBA_CACHE_DIR=str(cache))
    env.pop("LLAMPY_NO_WARM_HELPER", None)
    return dict(env, **kw)


def _cold(env) -> bool:
    r = subprocess.run([sys.executable, "-c", _COLD], env=env, cwd=ROOT, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    return r.stdout.strip() == "1"


@pytest.mark.slow
def test_helper_compiles_the_batch_kernels_into_the_cache(tmp_path, smollm2_path):
    env = _env(tmp_path / "cache")
    assert _cold(env)
    kw = {"n_ctx": 64, "n_batch": 64, "n_ubatch": 64, "n_seq_max": 1, "type_k": "F16", "type_v": "F16"}
    # its stdin stays open (it leaves when that closes: its parent has gone)
    p = subprocess.Popen([sys.executable, "-m", "llampy.llama.warm", str(smollm2_path), "5",
                          json.dumps(kw)], env=env, cwd=ROOT, stdin=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        assert p.wait(timeout=900) == 0, p.stderr.read().decode()
    finally:
        p.stdin.close()
        p.stderr.close()
    assert not _cold(env)       # SmolLM2's Q4_1 and Q8_0 kernels are there for the next process


def test_helper_leaves_with_its_parent(tmp_path, smollm2_path):
    # the parent starts a helper on a cold cache, then dies without running its exit handlers
    prog = (f"import os, sys, llampy.ggml.backends.cpu\nfrom llampy.ggml.backends.cpu import warm\n"
            f"p = warm.spawn([sys.executable, '-m', 'llampy.llama.warm', {str(smollm2_path)!r}, '5', "
            f"'{{\"n_ctx\": 64}}'])\nprint(p.pid, flush=True)\nos._exit(0)\n")
    r = subprocess.run([sys.executable, "-c", prog], env=_env(tmp_path / "cache"), cwd=ROOT, capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    pid = int(r.stdout.split()[0])
    deadline = time.time() + 30
    while time.time() < deadline:
        try:
            with open(f"/proc/{pid}/status") as f:
                if "\nState:\tZ" in f.read():
                    break
        except FileNotFoundError:
            break
        time.sleep(0.2)
    else:
        os.kill(pid, 9)
        pytest.fail("the helper outlived its parent by 30 s")


def test_no_helper_when_switched_off(tmp_path, smollm2_path):
    prog = (f"import llampy.ggml.backends.cpu\nfrom llampy.ggml.backends.cpu import warm\n"
            f"print(warm.spawn(['true']))\n")
    r = subprocess.run([sys.executable, "-c", prog], env=_env(tmp_path / "cache", LLAMPY_NO_WARM_HELPER="1"),
                       cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and r.stdout.strip() == "None", r.stderr
