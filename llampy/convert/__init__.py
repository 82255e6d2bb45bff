"""Conversion of other formats to GGUF: Hugging Face checkpoints (hf.py)."""
from .hf import ConvertError, convert_hf

__all__ = ["convert_hf", "ConvertError"]
