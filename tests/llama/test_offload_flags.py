"""Offload requests where there is no GPU (`make test` machines): never silently ignored. A request for layers
warns in one line and runs on the CPU, or stops with OffloadError when asked to be strict; bad -ngl/-ts/-ot values
are clear errors; 'auto' (the CLI's default) quietly means the CPU. The GPU side is tests/cuda (make test-cuda)."""
from __future__ import annotations

import os
import subprocess
import sys
import warnings

import pytest

from llampy.llama.devices import OffloadError, parse_n_gpu_layers, parse_override_tensor
from llampy.llama.model import Model
from tests.paths import TINY

QWEN2 = TINY / "qwen2-Q8_0.gguf"
pytestmark = pytest.mark.skipif(os.path.exists("/dev/nvidiactl") or os.environ.get("TRITON_INTERPRET") == "1",
                                reason="this machine has a GPU (or the Triton interpreter): tests/cuda covers it")


def test_layers_without_a_gpu_warn_once_and_run_on_the_cpu():
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        m = Model(QWEN2, n_gpu_layers=10)
    msgs = [str(x.message) for x in w if issubclass(x.category, RuntimeWarning)]
    assert len(msgs) == 1 and "cannot offload" in msgs[0] and "no NVIDIA GPU" in msgs[0]
    assert m.n_gpu_layers == 0 and m.devices == []
    assert all(b is m.cpu for b in m.layer_backend)


def test_strict_offload_stops():
    with pytest.raises(OffloadError, match="cannot offload"):
        Model(QWEN2, n_gpu_layers=-1, strict_offload=True)


def test_auto_and_zero_say_nothing():
    for ngl in (0, "auto"):
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            m = Model(QWEN2, n_gpu_layers=ngl)
            try:
                assert m.n_gpu_layers == 0
            finally:
                m.close()


def test_bad_values_are_clear_errors():
    assert parse_n_gpu_layers("all") == -1 and parse_n_gpu_layers("auto") == "auto" and parse_n_gpu_layers(7) == 7
    with pytest.raises(OffloadError, match="n_gpu_layers"):
        parse_n_gpu_layers("lots")
    with pytest.raises(OffloadError, match="REGEX=BUFTYPE"):
        parse_override_tensor("exps")
    with pytest.raises(OffloadError, match="unknown buffer type"):
        parse_override_tensor("exps=TPU0")
    with pytest.raises(OffloadError, match="bad pattern"):
        parse_override_tensor("([=CPU")
    assert [w for _, w in parse_override_tensor(["ffn_.*_exps=CPU", "attn=cuda1"])] == ["CPU", "CUDA1"]


def test_cli_says_it_in_one_line():
    r = subprocess.run([sys.executable, "-m", "llampy", "run", str(QWEN2), "-p", "Hi", "-n", "2", "--temp", "0",
                        "-ngl", "99"], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr
    lines = [ln for ln in r.stderr.splitlines() if "warning" in ln]
    assert lines == ["llampy: warning: n_gpu_layers=99 cannot offload: no NVIDIA GPU was found; every layer runs "
                     "on the CPU"]
    r = subprocess.run([sys.executable, "-m", "llampy", "run", str(QWEN2), "-p", "Hi", "-n", "2", "-ot", "x"],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 1 and r.stderr.strip().startswith("llampy: error: --override-tensor") \
        and "Traceback" not in r.stderr
