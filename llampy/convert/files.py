"""A checkpoint's files: safetensors read by hand (memory-mapped, one tensor at a time), JSON, and the error every
converter raises."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np


class ConvertError(ValueError):
    pass


_ST_DTYPES = {"F32": np.float32, "F16": np.float16, "BF16": np.uint16, "F64": np.float64}


def load_json(p: Path):
    """A JSON file's content, or None when there is no such file."""
    return json.loads(p.read_text(encoding="utf-8")) if p.is_file() else None


class SafeTensors:
    """A safetensors file: a u64 header length, a JSON header of {name: {dtype, shape, data_offsets}}, then the
    raw little-endian bytes. Memory-mapped; ``load`` reads one tensor (BF16 widened to float32)."""

    def __init__(self, path):
        self.path = Path(path)
        self.raw = np.memmap(self.path, dtype=np.uint8, mode="r")
        n = int(self.raw[:8].view("<u8")[0]) if self.raw.size >= 8 else -1
        if not 0 <= n <= self.raw.size - 8:
            raise ConvertError(f"{self.path}: not a safetensors file (header length {n})")
        self.header = {k: v for k, v in json.loads(bytes(self.raw[8:8 + n]).decode("utf-8")).items()
                       if k != "__metadata__"}
        self.base = 8 + n
        for name, h in self.header.items():
            if h["dtype"] not in _ST_DTYPES:
                raise ConvertError(f"{self.path}: tensor {name!r} has dtype {h['dtype']}, not a float type")

    def names(self) -> list[str]:
        return sorted(self.header)          # safe_open's key order

    def shape(self, name: str) -> tuple:
        return tuple(self.header[name]["shape"])

    def load(self, name: str) -> np.ndarray:
        h = self.header[name]
        a, b = h["data_offsets"]
        arr = self.raw[self.base + a:self.base + b].view(np.dtype(_ST_DTYPES[h["dtype"]]).newbyteorder("<"))
        arr = arr.reshape(h["shape"])
        if h["dtype"] == "BF16":
            arr = (arr.astype(np.uint32) << 16).view(np.float32)
        return arr


def read_safetensors(path) -> dict[str, np.ndarray]:
    """Every tensor of a safetensors file, by name (BF16 as float32)."""
    st = SafeTensors(path)
    return {n: st.load(n) for n in st.names()}
