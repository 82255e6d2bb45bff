"""cohere2 (Command R7B): command-r's parallel block with sliding-window layers (see command_r.py)."""
from __future__ import annotations

from .command_r import build_graph, load_hparams, load_tensors  # noqa: F401
