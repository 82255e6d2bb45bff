"""GGUF writer: metadata with explicit or inferred value types, tensors with alignment.

``GGUFWriter.from_reader(reader)`` carries every key with its original value type and order and every tensor's
bytes, so reading a file and writing it back gives the same bytes.
"""
from __future__ import annotations

import os
import struct

import numpy as np

from ..ggml.types import GGMLType, TYPE_TRAITS, type_from_dtype
from .constants import GGUF_DEFAULT_ALIGNMENT, GGUF_MAGIC, SCALAR_DTYPES, GGUFValueType as VT


def _infer(value) -> tuple:
    if isinstance(value, bool):
        return (VT.BOOL,)
    if isinstance(value, int):
        return (VT.INT32,) if -2**31 <= value < 2**31 else (VT.INT64,)
    if isinstance(value, float):
        return (VT.FLOAT32,)
    if isinstance(value, str):
        return (VT.STRING,)
    if isinstance(value, np.ndarray):
        for vt, dt in SCALAR_DTYPES.items():
            if dt == value.dtype and vt != VT.BOOL:
                return (VT.ARRAY, vt)
        if value.dtype == np.bool_:
            return (VT.ARRAY, VT.BOOL)
        raise ValueError(f"no GGUF type for array dtype {value.dtype}")
    if isinstance(value, (list, tuple)):
        if not value:
            return (VT.ARRAY, VT.INT32)
        return (VT.ARRAY,) + _infer(value[0])
    raise ValueError(f"no GGUF type for {type(value).__name__}")


class GGUFWriter:
    def __init__(self, path, alignment: int = GGUF_DEFAULT_ALIGNMENT, version: int = 3):
        self.path = os.fspath(path)
        self.alignment = alignment
        self.version = version
        self.kv: list[tuple[str, object, tuple]] = []
        self.tensors: list[tuple[str, GGMLType, tuple, np.ndarray]] = []

    @classmethod
    def from_reader(cls, reader, path) -> "GGUFWriter":
        w = cls(path, reader.alignment, reader.version)
        for k, v in reader.metadata.items():
            w.add(k, v, reader.value_types[k])
        for t in reader.tensors.values():
            w.add_tensor_raw(t.name, t.type, t.ne, t.data)
        return w

    def add(self, key: str, value, vtype: tuple | None = None) -> None:
        if key == "general.alignment":
            self.alignment = int(value)
            vtype = vtype or (VT.UINT32,)
        self.kv.append((key, value, tuple(vtype) if vtype else _infer(value)))

    def add_tensor_raw(self, name: str, type: GGMLType, ne, data: np.ndarray) -> None:
        type = GGMLType(type)
        ne = tuple(int(n) for n in ne)
        n = int(np.prod(ne))
        tt = TYPE_TRAITS[type]
        nbytes = n // tt.blck_size * tt.type_size
        raw = np.ascontiguousarray(data).reshape(-1).view(np.uint8)
        if raw.nbytes != nbytes:
            raise ValueError(f"tensor {name!r}: {raw.nbytes} bytes for {type.name} {list(ne)} (expected {nbytes})")
        self.tensors.append((name, type, ne, raw))

    def add_tensor(self, name: str, array: np.ndarray, type: GGMLType | None = None) -> None:
        """A plain NumPy array (shape in NumPy order: the GGUF ne is reversed), typed from its dtype."""
        array = np.ascontiguousarray(array)
        self.add_tensor_raw(name, type if type is not None else type_from_dtype(array.dtype),
                            tuple(reversed(array.shape)), array)

    # ------------------------------------------------------------------ encoding
    @staticmethod
    def _str(s: str) -> bytes:
        b = s.encode("utf-8")
        return struct.pack("<Q", len(b)) + b

    def _value(self, value, sig: tuple) -> bytes:
        vt = sig[0]
        if vt == VT.STRING:
            return self._str(value)
        if vt != VT.ARRAY:
            dt = SCALAR_DTYPES[vt]
            return np.array(value, dtype=dt if vt != VT.BOOL else np.uint8).tobytes()
        et = sig[1]
        head = struct.pack("<IQ", int(et), len(value))
        if et == VT.STRING:
            return head + b"".join(self._str(s) for s in value)
        if et == VT.ARRAY:
            return head + b"".join(self._value(v, sig[1:]) for v in value)
        dt = SCALAR_DTYPES[et]
        return head + np.asarray(value).astype(dt if et != VT.BOOL else np.uint8).tobytes()

    def write(self) -> None:
        a = self.alignment
        out = [GGUF_MAGIC, struct.pack("<IQQ", self.version, len(self.tensors), len(self.kv))]
        for k, v, sig in self.kv:
            out.append(self._str(k) + struct.pack("<I", int(sig[0])) + self._value(v, sig))
        offs = 0
        layout = []
        for name, t, ne, raw in self.tensors:
            layout.append(offs)
            out.append(self._str(name) + struct.pack("<I", len(ne)) + struct.pack(f"<{len(ne)}Q", *ne)
                       + struct.pack("<IQ", int(t), offs))
            offs += (raw.nbytes + a - 1) // a * a
        head = b"".join(out)
        with open(self.path, "wb") as f:
            f.write(head)
            f.write(b"\0" * ((-len(head)) % a))
            for (name, t, ne, raw), off in zip(self.tensors, layout):
                f.write(raw.tobytes())
                f.write(b"\0" * ((-raw.nbytes) % a))


def copy_gguf(reader, path) -> None:
    GGUFWriter.from_reader(reader, path).write()
