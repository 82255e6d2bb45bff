"""GGUF constants: magic, versions, value types (as in ggml's gguf.h)."""
from __future__ import annotations

from enum import IntEnum

import numpy as np

GGUF_MAGIC = b"GGUF"
GGUF_VERSIONS = (2, 3)        # v1 used 32-bit counts and lengths; nothing current writes it
GGUF_DEFAULT_ALIGNMENT = 32
GGUF_KEY_ALIGNMENT = "general.alignment"
MAX_DIMS = 4                  # GGML_MAX_DIMS
MAX_NAME = 64                 # GGML_MAX_NAME: ggml rejects tensor names of this many bytes or more
MAX_ARRAY_NESTING = 8         # ggml itself reads no nested arrays at all; we read a few levels, then refuse


class GGUFValueType(IntEnum):
    UINT8 = 0
    INT8 = 1
    UINT16 = 2
    INT16 = 3
    UINT32 = 4
    INT32 = 5
    FLOAT32 = 6
    BOOL = 7
    STRING = 8
    ARRAY = 9
    UINT64 = 10
    INT64 = 11
    FLOAT64 = 12


# numpy dtype of each fixed-size value type (little-endian); BOOL is one byte holding 0 or 1
SCALAR_DTYPES: dict[GGUFValueType, np.dtype] = {
    GGUFValueType.UINT8: np.dtype("<u1"),
    GGUFValueType.INT8: np.dtype("<i1"),
    GGUFValueType.UINT16: np.dtype("<u2"),
    GGUFValueType.INT16: np.dtype("<i2"),
    GGUFValueType.UINT32: np.dtype("<u4"),
    GGUFValueType.INT32: np.dtype("<i4"),
    GGUFValueType.FLOAT32: np.dtype("<f4"),
    GGUFValueType.BOOL: np.dtype("<u1"),
    GGUFValueType.UINT64: np.dtype("<u8"),
    GGUFValueType.INT64: np.dtype("<i8"),
    GGUFValueType.FLOAT64: np.dtype("<f8"),
}

# struct format of each fixed-size value type
SCALAR_FORMATS: dict[GGUFValueType, str] = {
    GGUFValueType.UINT8: "<B", GGUFValueType.INT8: "<b", GGUFValueType.UINT16: "<H", GGUFValueType.INT16: "<h",
    GGUFValueType.UINT32: "<I", GGUFValueType.INT32: "<i", GGUFValueType.FLOAT32: "<f", GGUFValueType.BOOL: "<B",
    GGUFValueType.UINT64: "<Q", GGUFValueType.INT64: "<q", GGUFValueType.FLOAT64: "<d",
}
