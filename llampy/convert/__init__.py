"""Conversion of other formats to GGUF: Hugging Face checkpoints (hf.py)."""
from .hf import ConvertError, convert_hf, convert_peft_lora

__all__ = ["convert_hf", "convert_peft_lora", "ConvertError"]
