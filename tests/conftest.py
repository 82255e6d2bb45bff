"""Shared test fixtures: where ../shared lives (CI clones main with shared/ beside it) and the real models."""
from __future__ import annotations

from pathlib import Path

import pytest

from tests.paths import SHARED


@pytest.fixture(scope="session")
def shared_dir() -> Path:
    if not SHARED.exists():
        pytest.fail(f"../shared is missing at {SHARED} (set LLAMPY_SHARED)")
    return SHARED


@pytest.fixture(scope="session")
def smollm2_path():
    from llampy.models import smollm2_path
    return smollm2_path()


@pytest.fixture(scope="session")
def gemma3_path():
    from llampy.models import gemma3_path
    return gemma3_path()
