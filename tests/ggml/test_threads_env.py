"""The OpenMP spin count (llampy/__init__.py) is in the environment before any entry point can start Numba's
thread pool: libgomp reads it once, when the pool starts, and `llampy bench` sets Numba's thread count before it
loads the cpu backend (with the default spin, its pp512 ran ~20% slower; benchmarks/README.md, entry 52)."""
from __future__ import annotations

import os
import subprocess
import sys

CODE = "import os, llampy.cli_engine; print(os.environ.get('GOMP_SPINCOUNT'))"


def _run(env):
    return subprocess.run([sys.executable, "-c", CODE], env=env, capture_output=True, text=True, check=True).stdout.strip()


def test_spin_count_set_on_import_of_any_entry_point():
    env = {k: v for k, v in os.environ.items() if k != "GOMP_SPINCOUNT"}
    assert _run(env) == "10000"


def test_spin_count_set_by_the_user_wins():
    assert _run(dict(os.environ, GOMP_SPINCOUNT="5")) == "5"
