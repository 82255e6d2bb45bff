"""Conversion of other formats to GGUF: Hugging Face checkpoints (hf.py, with vocab.py for their tokenizers and
files.py for safetensors) and PEFT LoRA adapters (peft.py)."""
from .files import ConvertError
from .hf import convert_hf
from .peft import convert_peft_lora

__all__ = ["convert_hf", "convert_peft_lora", "ConvertError"]
