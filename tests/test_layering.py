"""Imports point one way (STYLE.md): server, cli -> llama -> ggml, gguf; the ggml core imports no backend."""
from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

PKG = Path(__file__).resolve().parents[1] / "llampy"


def imports_of(path: Path) -> set[str]:
    tree = ast.parse(path.read_text())
    out = set()
    pkg_parts = path.relative_to(PKG.parent).with_suffix("").parts[:-1]
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = list(pkg_parts[:len(pkg_parts) - node.level + 1])
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            out.add(mod)
    return out


def files(sub: str):
    return sorted((PKG / sub).rglob("*.py"))


def test_ggml_never_imports_llama_gguf_server():
    for f in files("ggml"):
        bad = [m for m in imports_of(f) if m.startswith(("llampy.llama", "llampy.server", "llampy.cli", "llampy.gguf"))]
        assert not bad, f"{f} imports {bad}"


def test_ggml_core_imports_no_backend():
    core = [PKG / "ggml" / n for n in ("tensor.py", "ops.py", "graph.py", "types.py", "alloc.py", "sched.py",
                                       "fusion.py", "backend.py", "quants.py")]
    for f in core:
        if f.exists():
            bad = [m for m in imports_of(f) if m.startswith("llampy.ggml.backends")]
            assert not bad, f"{f} imports {bad}"


def test_gguf_is_file_format_only():
    for f in files("gguf"):
        bad = [m for m in imports_of(f) if m.startswith(("llampy.llama", "llampy.server", "llampy.cli"))]
        assert not bad, f"{f} imports {bad}"


def test_llama_never_imports_server_or_cli():
    for f in files("llama"):
        bad = [m for m in imports_of(f) if m.startswith(("llampy.server", "llampy.cli"))]
        assert not bad, f"{f} imports {bad}"


def test_model_files_know_no_backend():
    for f in files("llama/models"):
        bad = [m for m in imports_of(f) if "backend" in m or m == "numpy" or "kv_cache" in m or "sched" in m]
        assert not bad, f"{f} imports {bad}"


def _names_used(path: Path) -> set[str]:
    """Every identifier a file names: variables, attributes, imported names."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Name):
            out.add(node.id)
        elif isinstance(node, ast.Attribute):
            out.add(node.attr)
        elif isinstance(node, ast.alias):
            out.add(node.name.rsplit(".", 1)[-1])
    return out


def test_only_backends_touch_tensor_memory():
    """The buffer is the device boundary: the engine, the server, the CLI and the scheduler move tensor data with
    tensor_set/tensor_get/tensor_copy (llampy.ggml.backend), never through a NumPy view of a buffer's memory."""
    users = files("llama") + files("server") + sorted(PKG.glob("cli*.py")) + [PKG / "ggml" / "sched.py"]
    for f in users:
        bad = _names_used(f) & {"tensor_data", "as_ndarray"}
        assert not bad, f"{f} uses {sorted(bad)}: go through tensor_set/tensor_get/tensor_copy"


def _imported_modules(path: Path) -> set[str]:
    """Every module a file imports, at any depth (inside functions too), as absolute names; ``from . import x``
    gives both the package and ``package.x`` (x may be a module)."""
    out = set()
    pkg = list(path.relative_to(PKG.parent).with_suffix("").parts[:-1])
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = pkg[:len(pkg) - node.level + 1] if node.level else []
            mod = ".".join(base + ([node.module] if node.module else []))
            out.add(mod)
            out.update(f"{mod}.{a.name}" for a in node.names)
    return out


def test_reference_backend_shares_no_code_with_the_cpu_backend():
    """The oracle must not import what it checks: no import of llampy.ggml.backends.cpu, in any form."""
    cpu = "llampy.ggml.backends.cpu"
    oracle = sorted((PKG / "ggml" / "backends").glob("reference*.py"))
    assert PKG / "ggml" / "backends" / "reference.py" in oracle
    for f in oracle:
        bad = sorted(m for m in _imported_modules(f) if m == cpu or m.startswith(cpu + "."))
        assert not bad, f"{f} imports {bad}"


def test_importing_the_reference_backend_loads_no_cpu_code():
    code = ("import sys, llampy.ggml.backends.reference\n"
            "print(sorted(m for m in sys.modules if m.startswith('llampy.ggml.backends.cpu')))")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=PKG.parent, check=True)
    assert res.stdout.strip() == "[]", res.stdout
