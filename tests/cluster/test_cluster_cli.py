"""`llampy cluster serve`'s refusals, which need no cluster: without Ray it says to install llampy[ray] and exits 2;
an unreachable head, a bad option or a bad config file exit 2 within seconds, before Ray is imported."""
from __future__ import annotations

import json
import subprocess
import sys
import time

import pytest

from tests.paths import TINY

MODEL = str(TINY / "llama-F32.gguf")


def cli(*args, block_ray=False, timeout=60):
    pre = "import sys; sys.modules['ray'] = None; " if block_ray else ""    # as if the extra were not installed
    code = pre + "from llampy.cli import main; sys.exit(main(sys.argv[1:]))"
    return subprocess.run([sys.executable, "-c", "import sys; " + code, *args], capture_output=True, text=True,
                          timeout=timeout)


def test_without_ray_it_says_install_the_extra():
    p = cli("cluster", "serve", MODEL, "--replicas", "2", block_ray=True)
    assert p.returncode == 2
    assert "install llampy[ray]" in p.stderr and "Traceback" not in p.stderr


def run_in_process(capsys, *args) -> tuple[int, str]:
    """The command's own function (not main(), which tunes the process): what it does before touching Ray."""
    from llampy.cli import build_parser
    a = build_parser().parse_args(list(args))
    rc = a.func(a)
    return rc, capsys.readouterr().err


def test_unreachable_address_exits_2_quickly(capsys):
    t0 = time.monotonic()
    rc, err = run_in_process(capsys, "cluster", "serve", MODEL, "--address", "127.0.0.1:9")
    assert time.monotonic() - t0 < 15
    assert rc == 2 and "cannot reach the Ray head at 127.0.0.1:9" in err, err


@pytest.mark.parametrize("cfg, msg", [({"replicas": 2, "shards": 3}, "unknown option(s) shards"),
                                      ({"router": "random"}, "router must be one of prefix, pow2"),
                                      ({"replicas": 2, "parallel": 4, "ctx_size": 16}, "leave no room per slot")])
def test_bad_config_exits_2(tmp_path, capsys, cfg, msg):
    f = tmp_path / "cluster.json"
    f.write_text(json.dumps(cfg))
    rc, err = run_in_process(capsys, "cluster", "serve", MODEL, "--config", str(f), "--address", "127.0.0.1:9")
    assert rc == 2 and msg in err, err


def test_core_never_imports_ray():
    code = ("import sys, llampy, llampy.server.app, llampy.cluster, llampy.ggml.backends.remote; "
            "from llampy.cli import build_parser; build_parser(); print('ray' in sys.modules)")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert p.stdout.strip() == "False", p.stderr


def test_autoscaling_settings_without_min_max_replicas_are_refused():
    from llampy.cluster.launch import ClusterError, deploy
    with pytest.raises(ClusterError, match="autoscaling settings need min_replicas and max_replicas"):
        deploy(MODEL, replicas=2, autoscaling={"upscale_delay_s": 1}, address="127.0.0.1:9")
