"""GGUF: the file format only (reader with strict validation, writer, the inspect report)."""
from .constants import GGUFValueType
from .reader import GGUFError, GGUFReader, TensorInfo
from .writer import GGUFWriter, copy_gguf

__all__ = ["GGUFReader", "GGUFError", "TensorInfo", "GGUFValueType", "GGUFWriter", "copy_gguf"]
