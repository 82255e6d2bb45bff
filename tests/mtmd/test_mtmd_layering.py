"""llampy.mtmd sits beside llama: it imports llama and ggml, never the server or the CLI, and touches tensor memory
only through the buffer interface (tensor_set/tensor_get), as the engine does."""
from __future__ import annotations

from tests.test_layering import files, imports_of


def test_mtmd_never_imports_server_or_cli():
    for f in files("mtmd"):
        bad = [m for m in imports_of(f) if m.startswith(("llampy.server", "llampy.cli"))]
        assert not bad, f"{f} imports {bad}"


def test_mtmd_reads_tensors_through_buffers():
    for f in files("mtmd"):
        assert "tensor_data" not in f.read_text(), f"{f} reads a backend's memory directly"
