"""libllvmlite's clean pages leave the resident set after a kernel loads (llampy/ggml/backends/cpu/llvm_pages.py).

Each check runs in a fresh interpreter: which of the library's mappings qualify depends on how the process and
the file system mapped it, and a fresh process shows the state every llampy command starts from."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.paths import ROOT

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/smaps (Linux)")

# compiles a kernel (the most of LLVM a process touches) and runs it, then reports, as JSON: the clean ranges,
# the resident KiB in them, that figure again after an explicit release(), and every libllvmlite mapping's
# smaps fields (for the failure message)
_PROG = """
import json, re
import llampy.tuning; llampy.tuning.install()
from llampy.ggml.backends.cpu import llvm_pages
import numba, numpy as np
@numba.njit
def f(a):
    s = 0.0
    for i in range(a.shape[0]):
        s += np.sqrt(a[i]) * 2.0
    return s
assert f(np.arange(4.0) ** 2) == 12.0

def maps():
    out, cur = [], None
    for line in open('/proc/self/smaps'):
        if re.match(r'[0-9a-f]+-[0-9a-f]+ ', line):
            parts = line.split()
            cur = None
            if 'libllvmlite' in line:
                a, b = (int(x, 16) for x in parts[0].split('-'))
                cur = {'range': [a, b], 'perms': parts[1]}
                out.append(cur)
        elif cur is not None and ':' in line and line.split()[-1] == 'kB':
            cur[line.split(':')[0]] = int(line.split()[1])
    return out

def resident(ranges):
    return sum(m['Rss'] for m in maps() if tuple(m['range']) in ranges)

ranges = llvm_pages.clean_readonly_ranges()
after_load = resident(ranges)
llvm_pages.release()
print(json.dumps({'ranges': ranges, 'after_load': after_load, 'after_release': resident(ranges),
                  'maps': maps()}))
"""


def _run(keep: bool) -> dict:
    env = dict(os.environ, LLAMPY_KEEP_LLVM_PAGES="1" if keep else "0")
    r = subprocess.run([sys.executable, "-c", _PROG], env=env, cwd=ROOT, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


def test_release_drops_the_clean_pages():
    kept = _run(keep=True)
    assert kept["ranges"], f"no clean read-only libllvmlite mapping: {kept['maps']}"
    assert kept["after_load"] > 0, kept["maps"]                 # the kernel load left library pages resident
    assert kept["after_release"] < kept["after_load"] / 4, kept["maps"]


def test_pages_released_after_every_compile():
    kept, released = _run(keep=True), _run(keep=False)
    # installed, the wrapper has already released them when the first call returns
    assert released["after_load"] < kept["after_load"] / 4, (kept["maps"], released["maps"])


def test_only_unwritten_read_only_mappings_qualify():
    r = _run(keep=True)
    chosen = [m for m in r["maps"] if m["range"] in r["ranges"]]
    assert chosen, r["maps"]
    for m in chosen:
        assert "w" not in m["perms"], m
        assert m.get("Anonymous", 0) == m.get("Private_Dirty", 0) == m.get("Swap", 0) == 0, m
    # the relocated data (written by the loader, then made read-only) stays: it is not the file's contents
    written = [m for m in r["maps"] if m.get("Anonymous", 0) > 0]
    assert all(m["range"] not in r["ranges"] for m in written)
