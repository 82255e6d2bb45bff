"""Fixtures for the GGUF tests: where ../shared lives, the tiny fixtures, the real models opened once."""
from __future__ import annotations

import hashlib
import os
from pathlib import Path

import pytest

# CI clones main with shared/ beside it: /work/main/../shared (or $LLAMPY_SHARED)
SHARED = Path(os.environ.get("LLAMPY_SHARED", Path(__file__).resolve().parents[2] / ".." / "shared"))
TINY = SHARED / "fixtures" / "tiny"
TINY_FILES = sorted(TINY.glob("*.gguf"))


def sha256(path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            h.update(block)
    return h.hexdigest()


@pytest.fixture(scope="session")
def tiny_files():
    if not TINY_FILES:
        pytest.fail(f"no tiny GGUF fixtures under {TINY} (set LLAMPY_SHARED)")
    return TINY_FILES


@pytest.fixture(scope="session")
def smollm2_file():
    from llampy.models import smollm2_path
    return smollm2_path()


@pytest.fixture(scope="session")
def gemma3_file():
    from llampy.models import gemma3_path
    return gemma3_path()
