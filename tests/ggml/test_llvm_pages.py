"""libllvmlite's clean pages leave the resident set after a kernel loads (llampy/ggml/backends/cpu/llvm_pages.py)."""
from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

from tests.paths import ROOT

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/smaps (Linux)")

# compiles a kernel (the most of LLVM a process touches), runs it, then reports the resident KiB of libllvmlite's
# clean read-only mappings and checks the result
_PROG = """
import re
import llampy.ggml.backends.cpu
from llampy.ggml.backends.cpu import llvm_pages
import numba, numpy as np
@numba.njit
def f(a):
    s = 0.0
    for i in range(a.shape[0]):
        s += np.sqrt(a[i]) * 2.0
    return s
assert f(np.arange(4.0) ** 2) == 12.0
ranges = llvm_pages.clean_readonly_ranges()
rss, cur = 0, False
for line in open('/proc/self/smaps'):
    if re.match(r'[0-9a-f]+-[0-9a-f]+ ', line):
        a, b = (int(x, 16) for x in line.split()[0].split('-'))
        cur = (a, b) in ranges
    elif cur and line.startswith('Rss:'):
        rss += int(line.split()[1])
print(len(ranges), rss)
"""


def _run(keep: bool):
    env = dict(os.environ, LLAMPY_KEEP_LLVM_PAGES="1" if keep else "0")
    r = subprocess.run([sys.executable, "-c", _PROG], env=env, cwd=ROOT, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    n, kib = map(int, r.stdout.split())
    return n, kib


def test_llvm_code_pages_released_after_a_compile():
    n, released = _run(keep=False)
    _, kept = _run(keep=True)
    assert n >= 1                       # the library's text at least
    assert kept > 8 * 1024              # compiling touched megabytes of LLVM's code
    assert released < kept / 4          # and they are gone from this process once the kernel is there


def test_only_unwritten_read_only_mappings_qualify():
    from llampy.ggml.backends.cpu import llvm_pages
    ranges = llvm_pages.clean_readonly_ranges()
    with open("/proc/self/maps") as f:
        perms = {tuple(int(x, 16) for x in line.split()[0].split("-")): line.split()[1] for line in f
                 if re.match(r"[0-9a-f]+-[0-9a-f]+ ", line)}
    assert ranges
    assert all("w" not in perms[r] for r in ranges)
