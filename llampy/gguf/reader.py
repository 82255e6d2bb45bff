"""GGUF reader: mmap, strict validation, zero-copy views.

Layout (little-endian): magic "GGUF", u32 version, u64 n_tensors, u64 n_kv, then n_kv key/values
(string key, u32 value type, value), then n_tensors tensor infos (string name, u32 n_dims, u64 ne[n_dims],
u32 ggml type, u64 offset), padding to ``alignment``, and the data section, where each tensor's offset points.
A string is a u64 byte length and UTF-8 bytes; an array is a u32 element type, a u64 count and the elements.

Every problem with a file — truncation, bad magic or version, absurd counts or lengths, offsets outside the file,
overlapping or misaligned tensors, unknown types, overflowing shapes, invalid UTF-8 — raises ``GGUFError`` naming
the problem and the byte offset. Nothing is allocated in proportion to a number read from the file before that
number has been checked against the bytes that remain, so a hostile header cannot make us allocate or loop more
than the file's own size allows.
"""
from __future__ import annotations

import mmap
import os
import stat
import struct
from dataclasses import dataclass

import numpy as np

from ..ggml.types import TYPE_TRAITS, GGMLType
from .constants import (GGUF_DEFAULT_ALIGNMENT, GGUF_KEY_ALIGNMENT, GGUF_MAGIC, GGUF_VERSIONS, MAX_ARRAY_NESTING,
                        MAX_DIMS, MAX_NAME, SCALAR_DTYPES, SCALAR_FORMATS, GGUFValueType)

VT = GGUFValueType
_INT64_MAX = (1 << 63) - 1
_U32 = struct.Struct("<I")
_U64 = struct.Struct("<Q")
_SCALARS = {vt: struct.Struct(fmt) for vt, fmt in SCALAR_FORMATS.items()}
# smallest encodings, for checking counts against the bytes that remain before trusting them
_MIN_KV_BYTES = 8 + 1 + 4 + 1           # key length, a 1-byte key (empty keys are refused), type, a 1-byte value
_MIN_TENSOR_INFO_BYTES = 8 + 1 + 4 + 8 + 4 + 8
_MIN_ARRAY_BYTES = 4 + 8                # element type, count


class GGUFError(ValueError):
    """A GGUF file is malformed or unreadable.

    ``problem`` says what is wrong, ``offset`` where (a byte offset into the file, or None), ``path`` which file
    (set by the reader). ``str(e)`` is ``"<path>: <problem> (at byte <offset>)"``.
    """

    def __init__(self, problem: str, offset: int | None = None, path: str | None = None):
        self.problem, self.offset, self.path = problem, offset, path
        msg = f"{problem} (at byte {offset})" if offset is not None else problem
        super().__init__(f"{path}: {msg}" if path else msg)


@dataclass(eq=False)
class TensorInfo:
    name: str
    type: GGMLType
    ne: tuple            # ggml order: ne[0] is the fastest-varying dimension; len(ne) == n_dims
    offset: int          # absolute byte offset of the data in the file
    nbytes: int
    data: np.ndarray     # uint8 [nbytes], a read-only view of the mapping

    @property
    def n_elements(self) -> int:
        n = 1
        for x in self.ne:
            n *= x
        return n


@dataclass(frozen=True)
class UndecodedStrings:
    """The value of an array of strings read with ``decode_string_arrays=False``: its element count; its bytes are
    ``GGUFReader.value_bytes``."""
    count: int

    def __len__(self) -> int:
        return self.count


class GGUFReader:
    """Opens, maps and validates a GGUF file. Metadata values are Python scalars and strings, NumPy views for
    arrays of numbers and bools, lists of str for arrays of strings, and lists for arrays of arrays.

    ``decode_string_arrays=False`` (a tool that copies the metadata, as ``llampy quantize``): arrays of strings are
    walked, every length checked against the file, but not decoded (nor checked as UTF-8); their values are
    ``UndecodedStrings``. SmolLM2's vocabulary and merges: 50 -> 15 ms."""

    def __init__(self, path, decode_string_arrays: bool = True):
        self.path = os.fspath(path)
        self._decode_strings = decode_string_arrays
        self._file = self._mm = self._buf = None
        self.metadata: dict[str, object] = {}
        self.value_types: dict[str, tuple] = {}
        self._spans: dict[str, tuple[int, int]] = {}     # key -> where its value's bytes lie in the file
        self.tensors: dict[str, TensorInfo] = {}
        try:
            self._open()
            self._parse()
        except GGUFError as e:
            self.close()
            raise GGUFError(e.problem, e.offset, self.path) from None
        except (ValueError, OverflowError, IndexError, TypeError, struct.error) as e:
            # defensive: a check we missed must still surface as a GGUFError, never another type
            self.close()
            raise GGUFError(f"malformed file: {e}", getattr(self, "_pos", None), self.path) from None

    def _open(self) -> None:
        try:
            st = os.stat(self.path)
            if not stat.S_ISREG(st.st_mode):     # a FIFO or device would block or never end
                raise GGUFError("not a regular file")
            self._file = open(self.path, "rb")
            self.file_size = os.fstat(self._file.fileno()).st_size
            if self.file_size < 24:
                raise GGUFError(f"file too small to be GGUF ({self.file_size} bytes; the header alone takes 24)", 0)
            self._mm = mmap.mmap(self._file.fileno(), 0, access=mmap.ACCESS_READ)
        except GGUFError:
            raise
        except (OSError, ValueError) as e:   # ValueError: a NUL in the path
            raise GGUFError(f"cannot open: {getattr(e, 'strerror', None) or e}") from None
        self._buf = np.frombuffer(self._mm, dtype=np.uint8)

    # ------------------------------------------------------------------ primitives (advance self._pos)
    def _need(self, n: int, what: str) -> None:
        if n > self.file_size - self._pos:
            raise GGUFError(f"file truncated: {what} needs {n} bytes, {self.file_size - self._pos} remain",
                            self._pos)

    def _u32(self, what: str) -> int:
        self._need(4, what)
        (v,) = _U32.unpack_from(self._mm, self._pos)
        self._pos += 4
        return v

    def _u64(self, what: str) -> int:
        self._need(8, what)
        (v,) = _U64.unpack_from(self._mm, self._pos)
        self._pos += 8
        return v

    def _string(self, what: str) -> str:
        at = self._pos
        n = self._u64(f"{what} length")
        if n > self.file_size - self._pos:
            raise GGUFError(f"{what}: string length {n} runs past the end of the file", at)
        raw = self._mm[self._pos:self._pos + n]
        self._pos += n
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError as e:
            raise GGUFError(f"{what}: invalid UTF-8", at + 8 + e.start) from None

    def _value_type(self, what: str) -> VT:
        at = self._pos
        t = self._u32(what)
        try:
            return VT(t)
        except ValueError:
            raise GGUFError(f"{what}: unknown value type {t}", at) from None

    def _scalar(self, vt: VT, what: str):
        s = _SCALARS[vt]
        self._need(s.size, what)
        (v,) = s.unpack_from(self._mm, self._pos)
        if vt == VT.BOOL:
            if v > 1:
                raise GGUFError(f"{what}: invalid bool value {v}", self._pos)
            v = bool(v)
        self._pos += s.size
        return v

    def _value(self, vt: VT, what: str, depth: int = 0):
        """Reads one value of type vt; returns (value, type signature)."""
        if vt == VT.STRING:
            return self._string(what), (vt,)
        if vt != VT.ARRAY:
            return self._scalar(vt, what), (vt,)
        if depth >= MAX_ARRAY_NESTING:
            raise GGUFError(f"{what}: arrays nested deeper than {MAX_ARRAY_NESTING} levels", self._pos)
        et = self._value_type(f"{what} element type")
        at = self._pos
        n = self._u64(f"{what} array length")
        remain = self.file_size - self._pos
        if et in SCALAR_DTYPES:
            return self._numeric_array(et, n, at, remain, what), (vt, et)
        if et == VT.STRING:
            if n > remain // 8:
                raise GGUFError(f"{what}: array of {n} strings runs past the end of the file", at)
            if not self._decode_strings:
                return self._skip_strings(n, what), (vt, et)
            return self._string_array(n, what), (vt, et)
        if n > remain // _MIN_ARRAY_BYTES:
            raise GGUFError(f"{what}: array of {n} arrays runs past the end of the file", at)
        out, sigs = [], []
        for i in range(n):
            v, s = self._value(et, f"{what}[{i}]", depth + 1)
            out.append(v)
            sigs.append(s)
        # arrays of arrays: one signature when all elements agree (the usual case), else one per element
        if not sigs:
            return out, (vt, et)
        if all(s == sigs[0] for s in sigs):
            return out, (vt,) + sigs[0]
        return out, (vt, et, sigs)

    def _numeric_array(self, et: VT, n: int, at: int, remain: int, what: str) -> np.ndarray:
        dt = SCALAR_DTYPES[et]
        if n > remain // dt.itemsize:
            raise GGUFError(f"{what}: array of {n} {et.name} runs past the end of the file", at)
        arr = self._buf[self._pos:self._pos + n * dt.itemsize].view(dt)
        if et == VT.BOOL:
            bad = np.flatnonzero(arr > 1)
            if bad.size:
                raise GGUFError(f"{what}: invalid bool value {arr[bad[0]]}", self._pos + int(bad[0]))
            arr = arr.view(np.bool_)
        self._pos += n * dt.itemsize
        return arr

    def _string_array(self, n: int, what: str) -> list:
        # The hot loop of opening a model (262k strings for Gemma 3): one unpack and one decode per string,
        # locals only. n was checked against the bytes remaining, and the loop stops at the first overrun.
        mm, pos, end = self._mm, self._pos, self.file_size
        unpack = _U64.unpack_from
        out = []
        append = out.append
        try:
            for i in range(n):
                (ln,) = unpack(mm, pos)  # raises struct.error when fewer than 8 bytes remain
                pos += 8
                if ln > end - pos:
                    raise GGUFError(f"{what}: string {i} length {ln} runs past the end of the file", pos - 8)
                append(mm[pos:pos + ln].decode("utf-8"))
                pos += ln
        except UnicodeDecodeError as e:
            raise GGUFError(f"{what}: string {len(out)} is invalid UTF-8", pos + e.start) from None
        except struct.error:
            raise GGUFError(f"{what}: string {len(out)} length runs past the end of the file", pos) from None
        self._pos = pos
        return out

    def _skip_strings(self, n: int, what: str) -> UndecodedStrings:
        """_string_array's walk without the decoding."""
        mm, pos, end = self._mm, self._pos, self.file_size
        unpack = _U64.unpack_from
        i = 0
        try:
            for i in range(n):
                (ln,) = unpack(mm, pos)
                pos += 8
                if ln > end - pos:
                    raise GGUFError(f"{what}: string {i} length {ln} runs past the end of the file", pos - 8)
                pos += ln
        except struct.error:
            raise GGUFError(f"{what}: string {i} length runs past the end of the file", pos) from None
        self._pos = pos
        return UndecodedStrings(n)

    # ------------------------------------------------------------------ structure
    def _parse(self) -> None:
        self._pos = 0
        magic = bytes(self._mm[0:4])
        if magic != GGUF_MAGIC:
            raise GGUFError(f"bad magic {magic!r}: not a GGUF file", 0)
        self._pos = 4
        self.version = self._u32("version")
        if self.version not in GGUF_VERSIONS:
            swapped = int.from_bytes(self.version.to_bytes(4, "little"), "big")
            hint = (" (GGUF v1 is obsolete; convert the model again)" if self.version == 1 else
                    " (a big-endian file?)" if swapped in GGUF_VERSIONS else "")
            raise GGUFError(f"unsupported GGUF version {self.version}{hint}; supported: 2, 3", 4)
        n_tensors = self._u64("tensor count")
        n_kv = self._u64("metadata count")
        remain = self.file_size - self._pos
        if n_kv > remain // _MIN_KV_BYTES:
            raise GGUFError(f"metadata count {n_kv} is larger than the file could hold", 16)
        if n_tensors > (remain - n_kv * _MIN_KV_BYTES) // _MIN_TENSOR_INFO_BYTES:
            raise GGUFError(f"tensor count {n_tensors} is larger than the file could hold", 8)
        alignment_at = None
        for i in range(n_kv):
            at = self._pos
            key = self._string(f"metadata key {i}")
            if not key:
                raise GGUFError(f"metadata key {i} is empty", at)
            if key in self.metadata:
                raise GGUFError(f"duplicate metadata key {key!r}", at)
            vt = self._value_type(f"type of {key!r}")
            if key == GGUF_KEY_ALIGNMENT:
                alignment_at = self._pos
            start = self._pos
            value, sig = self._value(vt, f"value of {key!r}")
            self.metadata[key] = value
            self.value_types[key] = sig
            self._spans[key] = (start, self._pos)
        self.alignment = GGUF_DEFAULT_ALIGNMENT
        if alignment_at is not None:
            a, sig = self.metadata[GGUF_KEY_ALIGNMENT], self.value_types[GGUF_KEY_ALIGNMENT]
            if sig != (VT.UINT32,):
                raise GGUFError(f"{GGUF_KEY_ALIGNMENT} must be UINT32, not {'/'.join(t.name for t in sig)}",
                                alignment_at - 4)
            if a == 0 or a & (a - 1):
                raise GGUFError(f"{GGUF_KEY_ALIGNMENT} {a} is not a power of two", alignment_at)
            self.alignment = a
        infos = [self._tensor_info(i) for i in range(n_tensors)]
        self.data_offset = self._pos + (-self._pos) % self.alignment
        if n_tensors and self.data_offset > self.file_size:
            raise GGUFError("file truncated before the tensor data section", self._pos)
        self._place_tensors(infos)

    def _tensor_info(self, i: int) -> tuple:
        at = self._pos
        name = self._string(f"tensor {i} name")
        if len(name.encode("utf-8")) >= MAX_NAME:
            raise GGUFError(f"tensor {i} name is too long ({len(name.encode('utf-8'))} bytes; ggml allows "
                            f"{MAX_NAME - 1})", at)
        if name in self.tensors:
            raise GGUFError(f"duplicate tensor name {name!r}", at)
        self.tensors[name] = None  # placeholder keeps file order and catches duplicates; filled by _place_tensors
        dims_at = self._pos
        n_dims = self._u32(f"tensor {name!r} n_dims")
        if not 1 <= n_dims <= MAX_DIMS:
            raise GGUFError(f"tensor {name!r}: n_dims {n_dims} is outside 1..{MAX_DIMS}", dims_at)
        ne = tuple(self._u64(f"tensor {name!r} ne[{d}]") for d in range(n_dims))
        n = 1
        for x in ne:
            n *= x
            if x > _INT64_MAX or n > _INT64_MAX:
                raise GGUFError(f"tensor {name!r}: shape {list(ne)} element count overflows int64", dims_at + 4)
        type_at = self._pos
        t = self._u32(f"tensor {name!r} type")
        try:
            gt = GGMLType(t)
        except ValueError:
            raise GGUFError(f"tensor {name!r}: unknown tensor type {t}", type_at) from None
        tt = TYPE_TRAITS[gt]
        if ne[0] % tt.blck_size:
            raise GGUFError(f"tensor {name!r}: ne[0] = {ne[0]} is not a whole number of {gt.name} blocks "
                            f"of {tt.blck_size}", dims_at + 4)
        off_at = self._pos
        off = self._u64(f"tensor {name!r} offset")
        return name, gt, ne, off, n // tt.blck_size * tt.type_size, off_at

    def _place_tensors(self, infos: list) -> None:
        data_size = self.file_size - self.data_offset
        for name, gt, ne, off, nbytes, off_at in infos:
            if off % self.alignment:
                raise GGUFError(f"tensor {name!r}: data offset {off} is not a multiple of the alignment "
                                f"{self.alignment}", off_at)
            if off > data_size or nbytes > data_size - off:
                raise GGUFError(f"tensor {name!r}: data [{off}, {off + nbytes}) lies outside the data section "
                                f"({data_size} bytes from byte {self.data_offset})", off_at)
            a = self.data_offset + off
            self.tensors[name] = TensorInfo(name, gt, ne, a, nbytes, self._buf[a:a + nbytes])
        by_off = sorted(self.tensors.values(), key=lambda t: t.offset)
        for prev, cur in zip(by_off, by_off[1:]):
            if cur.offset < prev.offset + prev.nbytes:
                raise GGUFError(f"tensors {prev.name!r} and {cur.name!r} overlap", cur.offset)

    # ------------------------------------------------------------------ access
    def value_bytes(self, key: str) -> bytes:
        """The bytes of ``key``'s value as the file holds them (after its type tag): what a writer writes for it,
        so that a copy of the metadata (``GGUFWriter.add_encoded``) need not encode the values again."""
        a, b = self._spans[key]
        return bytes(self._mm[a:b])

    def fileno(self) -> int:
        """The open file's descriptor (``writer.FileRange`` copies tensor bytes from it)."""
        return self._file.fileno()

    def get(self, key: str, default=None):
        return self.metadata.get(key, default)

    def tensor_array(self, name: str) -> np.ndarray:
        """A typed zero-copy view: plain types (F32, F16, F64, I8..I64) shaped tuple(reversed(ne)); BF16 as uint16
        bits; quantized types as uint8 [n_rows, row_bytes], n_rows the product of ne[1:]."""
        info = self.tensors[name]
        tt = TYPE_TRAITS[info.type]
        if not tt.is_quantized:
            return info.data.view(tt.dtype).reshape(tuple(reversed(info.ne)))
        n_rows = 1
        for x in info.ne[1:]:
            n_rows *= x
        return info.data.reshape(n_rows, info.ne[0] // tt.blck_size * tt.type_size)

    def close(self) -> None:
        """Drops our views and closes the mapping. Arrays handed out earlier keep the pages mapped until they go."""
        for t in self.tensors.values():
            if t is not None:
                t.data = None
        self._buf = None
        if self._mm is not None:
            try:
                self._mm.close()
            except BufferError:
                pass  # views are still alive elsewhere: the mapping closes when they go
            self._mm = None
        if self._file is not None:
            self._file.close()
            self._file = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __repr__(self) -> str:
        return (f"GGUFReader({self.path!r}, v{getattr(self, 'version', '?')}, {len(self.metadata)} keys, "
                f"{len(self.tensors)} tensors)")
