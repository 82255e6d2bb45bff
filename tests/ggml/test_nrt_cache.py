"""Numba's runtime module comes from llampy's cache after the first process (llampy/ggml/backends/cpu/nrt_cache.py)."""
from __future__ import annotations

import os
import subprocess
import sys

from tests.paths import ROOT

# a jitted function that allocates (so it runs through the NRT) and returns a value to compare
_PROG = """
import sys
import llampy.tuning; llampy.tuning.install()
import numba, numpy as np
from numba.core.runtime import nrtdynmod
if sys.argv[1] == "cached":     # the module must not be compiled again: loading it is the only way through
    def refuse(ctx):
        raise AssertionError("NRT module compiled again")
    nrtdynmod.create_nrt_module = refuse
@numba.njit
def f(n):
    a = np.arange(n) * 2
    return a.sum()
print(f(10))
"""


def test_nrt_module_cached_then_loaded(tmp_path):
    env = dict(os.environ, NUMBA_CACHE_DIR=str(tmp_path))
    first = subprocess.run([sys.executable, "-c", _PROG, "first"], env=env, cwd=ROOT, capture_output=True, text=True)
    assert first.returncode == 0, first.stderr
    assert [p.name for p in tmp_path.glob("numba_nrt-*.nbo")]
    again = subprocess.run([sys.executable, "-c", _PROG, "cached"], env=env, cwd=ROOT, capture_output=True, text=True)
    assert again.returncode == 0, again.stderr
    assert first.stdout == again.stdout == "90\n"
