"""GGUF: the file format only (reader with strict validation, writer)."""
from .constants import GGUFValueType
from .reader import GGUFError, GGUFReader, TensorInfo

__all__ = ["GGUFReader", "GGUFError", "TensorInfo", "GGUFValueType"]
