"""Ray tests run inside a network namespace that has only loopback: Ray makes outbound calls of its own (usage
reports, a cloud metadata probe), and its ports have no authentication.

A test marked ``ray`` is not run in the pytest process itself. The first such test of a module runs the module's
ray tests once in a child pytest under ``unshare -n`` (root; loopback brought up, RAY_USAGE_STATS_ENABLED=0), and
every ray test of the module then reports its own outcome from that run, its failure text included. Inside the
namespace (LLAMPY_RAY_NETNS=1) the tests run as written.
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

INNER = os.environ.get("LLAMPY_RAY_NETNS") == "1"
ROOT = Path(__file__).resolve().parents[2]
INNER_TIMEOUT = 600
_runs: dict[str, dict] = {}
# run in the new namespace: bring its loopback up (SIOCGIFFLAGS, SIOCSIFFLAGS | IFF_UP; no iproute2 needed), then
# become pytest
LO_UP_THEN_PYTEST = """
import fcntl, os, socket, struct, sys
s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
flags = struct.unpack("16sH14s", fcntl.ioctl(s, 0x8913, struct.pack("16sH14s", b"lo", 0, b"")))[1]
fcntl.ioctl(s, 0x8914, struct.pack("16sH14s", b"lo", flags | 1, b""))
os.execv(sys.executable, [sys.executable, "-m", "pytest", *sys.argv[1:]])
"""


def _inner_run(module: Path, tmp: Path) -> dict:
    """Run ``module``'s ray tests in the namespace; {test name: (outcome, text)}."""
    if shutil.which("unshare") is None:
        return {"*": ("failed", "the ray tests need unshare(1) (util-linux)")}
    xml = tmp / "ray-tests.xml"
    args = ["-q", "-p", "no:cacheprovider", "-p", "no:xdist", "-m", "ray", f"--junitxml={xml}",
            "-o", "junit_family=xunit1", str(module)]
    env = {**os.environ, "LLAMPY_RAY_NETNS": "1", "RAY_USAGE_STATS_ENABLED": "0", "RAY_DEDUP_LOGS": "0"}
    try:
        p = subprocess.run(["unshare", "-n", sys.executable, "-c", LO_UP_THEN_PYTEST, *args], cwd=ROOT, env=env,
                           capture_output=True, text=True, timeout=INNER_TIMEOUT)
    except subprocess.TimeoutExpired as e:
        return {"*": ("failed", f"the ray tests ran past {INNER_TIMEOUT} s:\n{(e.stdout or '')[-4000:]}")}
    if not xml.exists():
        return {"*": ("failed", f"unshare -n failed (root is needed), exit {p.returncode}:\n"
                                f"{p.stdout[-3000:]}\n{p.stderr[-3000:]}")}
    out = {}
    for case in ET.parse(xml).getroot().iter("testcase"):
        res = ("passed", "")
        for kind in ("failure", "error", "skipped"):
            el = case.find(kind)
            if el is not None:
                res = ("skipped" if kind == "skipped" else "failed",
                       (el.get("message") or "") + "\n" + (el.text or ""))
                break
        out[case.get("name")] = res
    out["#log"] = ("", p.stdout[-3000:] + p.stderr[-3000:])
    return out


@pytest.hookimpl(tryfirst=True)
def pytest_pyfunc_call(pyfuncitem):
    if INNER or pyfuncitem.get_closest_marker("ray") is None:
        return None
    module = Path(pyfuncitem.fspath)
    if str(module) not in _runs:
        tmp = pyfuncitem.config._tmp_path_factory.mktemp("ray")
        _runs[str(module)] = _inner_run(module, tmp)
    run = _runs[str(module)]
    outcome, text = run.get(pyfuncitem.name) or run.get("*") or (
        "failed", f"{pyfuncitem.name} did not run in the namespace:\n{run.get('#log', ('', ''))[1]}")
    if outcome == "skipped":
        pytest.skip(text.strip().splitlines()[0] if text.strip() else "skipped in the namespace")
    if outcome == "failed":
        pytest.fail(f"(in the loopback-only namespace)\n{text}", pytrace=False)
    return True
