"""Where the shared fixtures live: ../shared beside the repository (as CI lays it out), or $LLAMPY_SHARED."""
from __future__ import annotations

import os
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SHARED = Path(os.environ.get("LLAMPY_SHARED", ROOT.parent / "shared"))
TINY = SHARED / "fixtures" / "tiny"
LLAMACPP = SHARED / "fixtures" / "llamacpp"
SEEDS = SHARED / "seeds"
