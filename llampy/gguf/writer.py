"""GGUF writer: metadata with explicit or inferred value types, tensors laid out with alignment.

    w = GGUFWriter(path)                       # or an open binary file object
    w.add("general.architecture", "llama")     # type inferred: str -> STRING, int -> INT32/INT64, float -> FLOAT32
    w.add("llama.context_length", 2048, GGUFValueType.UINT32)
    w.add("tokenizer.ggml.scores", np.zeros(10, np.float32))   # ndarray -> ARRAY of its dtype
    w.add_tensor("token_embd.weight", np.ones((10, 64), np.float32))    # NumPy shape (10, 64) -> ne (64, 10)
    w.add_tensor_raw("blk.0.attn_q.weight", GGMLType.Q8_0, (64, 64), raw_bytes)
    w.write()

Tensors are written in the order added, each at the next multiple of the alignment — the only layout ggml's
reader accepts — so ``GGUFWriter.from_reader(reader, dst)`` (or ``copy_gguf``), which carries every key with its
original value type and order and every tensor's bytes, writes back any file ggml can read byte for byte.

A value type is a signature tuple as ``GGUFReader.value_types`` gives it: ``(UINT32,)``, ``(ARRAY, STRING)``,
``(ARRAY, ARRAY, INT32)`` for an array of INT32 arrays, or ``(ARRAY, ARRAY, [sig, sig, ...])`` for an array of
arrays whose elements differ in type (one full signature per element). A bare GGUFValueType means ``(vt,)``.
"""
from __future__ import annotations

import os
import struct
from typing import NamedTuple

import numpy as np

from ..ggml.types import TYPE_TRAITS, GGMLType, type_from_dtype
from .constants import (GGUF_DEFAULT_ALIGNMENT, GGUF_KEY_ALIGNMENT, GGUF_MAGIC, GGUF_VERSIONS, MAX_DIMS, MAX_NAME,
                        SCALAR_DTYPES, SCALAR_FORMATS, GGUFValueType as VT)

_U64 = struct.Struct("<Q")
_SCALARS = {vt: struct.Struct(fmt) for vt, fmt in SCALAR_FORMATS.items()}
_INT_RANGES = {vt: (int(np.iinfo(dt).min), int(np.iinfo(dt).max)) for vt, dt in SCALAR_DTYPES.items()
               if dt.kind in "iu" and vt != VT.BOOL}


def infer_value_type(value) -> tuple:
    """The signature a value gets when none is given (what gguf-py's writer would pick for Python values)."""
    if isinstance(value, (bool, np.bool_)):
        return (VT.BOOL,)
    if isinstance(value, np.generic):
        return (_dtype_vt(value.dtype),)
    if isinstance(value, int):
        if -2**31 <= value < 2**31:
            return (VT.INT32,)
        return (VT.INT64,) if -2**63 <= value < 2**63 else (VT.UINT64,)
    if isinstance(value, float):
        return (VT.FLOAT32,)
    if isinstance(value, str):
        return (VT.STRING,)
    if isinstance(value, np.ndarray):
        if value.ndim != 1:
            raise ValueError(f"metadata arrays are 1-D; got shape {value.shape}")
        return (VT.ARRAY, _dtype_vt(value.dtype))
    if isinstance(value, (list, tuple)):
        if not value:
            return (VT.ARRAY, VT.INT32)
        if all(isinstance(v, str) for v in value):
            return (VT.ARRAY, VT.STRING)
        if all(isinstance(v, (bool, np.bool_)) for v in value):
            return (VT.ARRAY, VT.BOOL)
        if all(isinstance(v, (int, np.integer)) and not isinstance(v, bool) for v in value):
            lo, hi = min(value), max(value)
            return (VT.ARRAY, VT.INT32 if -2**31 <= lo and hi < 2**31 else VT.INT64)
        if all(isinstance(v, (int, float, np.integer, np.floating)) and not isinstance(v, bool) for v in value):
            return (VT.ARRAY, VT.FLOAT32)
        if all(isinstance(v, (list, tuple, np.ndarray)) for v in value):
            sigs = [infer_value_type(v) for v in value]
            return (VT.ARRAY,) + sigs[0] if all(s == sigs[0] for s in sigs) else (VT.ARRAY, VT.ARRAY, sigs)
        raise ValueError(f"cannot infer one GGUF type for a list of {sorted({type(v).__name__ for v in value})}")
    raise ValueError(f"no GGUF value type for {type(value).__name__}")


def _dtype_vt(dtype) -> VT:
    dtype = np.dtype(dtype)
    if dtype == np.bool_:
        return VT.BOOL
    for vt, dt in SCALAR_DTYPES.items():
        if vt != VT.BOOL and dt == dtype.newbyteorder("<"):
            return vt
    raise ValueError(f"no GGUF value type for dtype {dtype}")


def _normalise_sig(vtype) -> tuple:
    if isinstance(vtype, (int, VT)):
        return (VT(vtype),)
    sig = tuple(vtype)
    if not sig:
        raise ValueError("empty value type")
    return sig


def _check_sig(sig: tuple, depth: int = 0) -> None:
    vt = VT(sig[0])
    if vt != VT.ARRAY:
        if len(sig) != 1:
            raise ValueError(f"value type {sig}: only an ARRAY has an element type")
        return
    if len(sig) < 2:
        raise ValueError("an ARRAY value type needs its element type, e.g. (ARRAY, INT32)")
    if VT(sig[1]) != VT.ARRAY:
        if len(sig) != 2:
            raise ValueError(f"value type {sig}: too many element types")
        return
    if len(sig) == 2:
        return  # an array of arrays with no more said: only an empty one, or elements typed by inference
    if isinstance(sig[2], list):
        for s in sig[2]:
            _check_sig(tuple(s), depth + 1)
    else:
        _check_sig(sig[1:], depth + 1)


class GGUFWriter:
    def __init__(self, path_or_fileobj, alignment: int = GGUF_DEFAULT_ALIGNMENT, version: int = 3):
        if alignment <= 0 or alignment & (alignment - 1):
            raise ValueError(f"alignment must be a power of two, got {alignment}")
        if version not in GGUF_VERSIONS:
            raise ValueError(f"GGUF version {version} is not writable (only {GGUF_VERSIONS})")
        self.target = path_or_fileobj
        self.alignment = alignment
        self.version = version
        self.kv: list[tuple[str, object, tuple]] = []                      # (key, value, signature), in order
        self.tensors: list[tuple[str, GGMLType, tuple, np.ndarray]] = []   # (name, type, ne, uint8 bytes)

    @classmethod
    def from_reader(cls, reader, path_or_fileobj) -> "GGUFWriter":
        """Everything the reader read: keys in order with their value types, tensors in order with their bytes."""
        w = cls(path_or_fileobj, reader.alignment, reader.version)
        for k, v in reader.metadata.items():
            w.add(k, v, reader.value_types[k])
        for t in reader.tensors.values():
            w.add_tensor_raw(t.name, t.type, t.ne, t.data)
        return w

    # ------------------------------------------------------------------ building
    def add(self, key: str, value, vtype=None) -> None:
        """One key/value; ``vtype`` a GGUFValueType or a signature tuple, inferred from the value when None."""
        if not isinstance(key, str) or not key:
            raise ValueError(f"metadata keys are non-empty strings, got {key!r}")
        if any(k == key for k, _, _ in self.kv):
            raise ValueError(f"duplicate metadata key {key!r}")
        sig = _normalise_sig(vtype) if vtype is not None else \
            ((VT.UINT32,) if key == GGUF_KEY_ALIGNMENT else infer_value_type(value))
        _check_sig(sig)
        self._encode(value, sig, key)  # fail now, with the key's name, rather than at write()
        if key == GGUF_KEY_ALIGNMENT:
            a = int(value)
            if sig != (VT.UINT32,) or a <= 0 or a & (a - 1):
                raise ValueError(f"{GGUF_KEY_ALIGNMENT} must be a power-of-two UINT32, got {value!r} as {sig}")
            self.alignment = a
        self.kv.append((key, value, sig))

    add_key_value = add

    def add_encoded(self, key: str, raw: bytes, vtype) -> None:
        """One key whose value is already encoded: ``raw`` the bytes after the type tag, as
        ``GGUFReader.value_bytes`` returns them, for a value of signature ``vtype``. Copying a model's metadata
        this way skips decoding and re-encoding its vocabulary (tens of thousands of strings). The bytes are
        trusted to match the signature; the key is checked as ``add`` checks it."""
        if not isinstance(key, str) or not key:
            raise ValueError(f"metadata keys are non-empty strings, got {key!r}")
        if any(k == key for k, _, _ in self.kv):
            raise ValueError(f"duplicate metadata key {key!r}")
        sig = _normalise_sig(vtype)
        _check_sig(sig)
        if key == GGUF_KEY_ALIGNMENT:           # add checks it and takes the writer's alignment from it
            if sig != (VT.UINT32,) or len(raw) != 4:
                raise ValueError(f"{GGUF_KEY_ALIGNMENT} must be a power-of-two UINT32, got {sig}")
            self.add(key, _SCALARS[VT.UINT32].unpack(raw)[0], sig)
            return
        self.kv.append((key, _Encoded(bytes(raw)), sig))

    def add_tensor_raw(self, name: str, type: GGMLType | int, ne, data) -> None:
        """A tensor from its raw bytes (bytes, memoryview or any contiguous ndarray) and its ggml shape ``ne``."""
        type = GGMLType(type)
        ne = tuple(int(n) for n in ne)
        if not name or len(name.encode("utf-8")) >= MAX_NAME:
            raise ValueError(f"tensor name {name!r} must be 1 to {MAX_NAME - 1} bytes")
        if any(t[0] == name for t in self.tensors):
            raise ValueError(f"duplicate tensor name {name!r}")
        if not 1 <= len(ne) <= MAX_DIMS or any(n < 0 for n in ne):
            raise ValueError(f"tensor {name!r}: bad shape {list(ne)}")
        tt = TYPE_TRAITS[type]
        if ne[0] % tt.blck_size:
            raise ValueError(f"tensor {name!r}: ne[0] = {ne[0]} is not a whole number of {type.name} blocks")
        n = 1
        for x in ne:
            n *= x
        nbytes = n // tt.blck_size * tt.type_size
        if data is _ZEROS:
            self.tensors.append((name, type, ne, _Zeros(nbytes)))
            return
        if isinstance(data, np.ndarray):
            raw = np.ascontiguousarray(data).reshape(-1).view(np.uint8)
        else:
            raw = np.frombuffer(data, dtype=np.uint8)
        if raw.nbytes != nbytes:
            raise ValueError(f"tensor {name!r}: {raw.nbytes} bytes given for {type.name} {list(ne)}, "
                             f"which takes {nbytes}")
        self.tensors.append((name, type, ne, raw))

    def add_tensor_lazy(self, name: str, type: GGMLType | int, ne, make) -> None:
        """A tensor whose bytes ``make()`` returns when ``write`` reaches it (bytes or a contiguous ndarray of the
        exact size, a ``FileRange``, or ``WRITTEN_ELSEWHERE``), so that a converter holds one tensor at a time rather
        than the whole file."""
        self.add_tensor_raw(name, type, ne, _ZEROS)
        name, type, ne, z = self.tensors[-1]
        self.tensors[-1] = (name, type, ne, _Lazy(z.nbytes, make))

    def add_tensor_zeros(self, name: str, type: GGMLType | int, ne) -> None:
        """A tensor of zero bytes, never held in memory: written as a hole in the file (the file system allocates
        nothing for it, and it reads as zeros). For files whose values do not matter (kernel warm-up, benchmarks)."""
        self.add_tensor_raw(name, type, ne, _ZEROS)

    def add_tensor(self, name: str, array: np.ndarray, type: GGMLType | int | None = None) -> None:
        """A NumPy array in NumPy order (ne is the reversed shape). The type comes from the dtype (float32 -> F32,
        float16 -> F16, int32 -> I32, ...) unless given. With a block type, ``array`` holds the raw blocks as
        ``GGUFReader.tensor_array`` returns them: uint8 [n_rows, row_bytes] (or more leading dims); with BF16,
        the uint16 bits."""
        array = np.ascontiguousarray(array)
        if type is None:
            type = type_from_dtype(array.dtype)
        type = GGMLType(type)
        tt = TYPE_TRAITS[type]
        if array.ndim == 0:
            array = array.reshape(1)
        if tt.is_quantized:
            if array.dtype != np.uint8 or array.shape[-1] % tt.type_size:
                raise ValueError(f"tensor {name!r}: {type.name} data must be uint8 rows of whole blocks")
            ne = (array.shape[-1] // tt.type_size * tt.blck_size,) + tuple(reversed(array.shape[:-1]))
        else:
            if array.dtype.itemsize != tt.type_size:
                raise ValueError(f"tensor {name!r}: dtype {array.dtype} does not hold {type.name} elements")
            ne = tuple(reversed(array.shape))
        self.add_tensor_raw(name, type, ne, array)

    # ------------------------------------------------------------------ encoding
    def _encode(self, value, sig: tuple, key: str) -> bytes:
        if isinstance(value, _Encoded):
            return value.raw
        try:
            return b"".join(_encode_value(value, sig))
        except (struct.error, OverflowError, TypeError, ValueError, AttributeError) as e:
            raise ValueError(f"metadata {key!r}: cannot write {_short(value)} as "
                             f"{_sig_name(sig)}: {e}") from None

    def header_bytes(self) -> bytes:
        """Everything before the data section, padding included."""
        a = self.alignment
        out = [GGUF_MAGIC, struct.pack("<IQQ", self.version, len(self.tensors), len(self.kv))]
        for k, v, sig in self.kv:
            out += [_string(k), struct.pack("<I", int(sig[0])), self._encode(v, sig, k)]
        off = 0
        for name, t, ne, raw in self.tensors:
            out += [_string(name), struct.pack(f"<I{len(ne)}QIQ", len(ne), *ne, int(t), off)]
            off += raw.nbytes + (-raw.nbytes) % a
        head = b"".join(out)
        return head + b"\0" * ((-len(head)) % a)

    def data_offsets(self) -> list[int]:
        """Where each tensor's bytes begin in the file ``write`` makes, in bytes from its start."""
        pos, out = len(self.header_bytes()), []
        for _, _, _, raw in self.tensors:
            out.append(pos)
            pos += raw.nbytes + (-raw.nbytes) % self.alignment
        return out

    def write(self, progress=None) -> None:
        """Writes the file; ``progress(i, n, name)`` is called before each tensor's bytes."""
        head = self.header_bytes()
        if hasattr(self.target, "write"):
            self._write_to(self.target, head, progress)
        else:
            with open(os.fspath(self.target), "wb") as f:
                self._write_to(f, head, progress)

    def _write_to(self, f, head: bytes, progress=None) -> None:
        splice = _Splice()
        try:
            self._write_tensors(f, head, progress, splice)
        finally:
            splice.close()

    def _write_tensors(self, f, head: bytes, progress, splice) -> None:
        f.write(head)
        hole = 0                      # zero bytes still owed: skipped over, then made a hole by truncate
        for i, (name, _, _, raw) in enumerate(self.tensors):
            if progress is not None:
                progress(i, len(self.tensors), name)
            pad = (-raw.nbytes) % self.alignment
            if isinstance(raw, _Lazy):
                data = raw.make()
                if data is WRITTEN_ELSEWHERE:
                    hole += raw.nbytes + pad
                    continue
                if not isinstance(data, FileRange):
                    data = (np.ascontiguousarray(data).reshape(-1).view(np.uint8) if isinstance(data, np.ndarray)
                            else np.frombuffer(data, dtype=np.uint8))
                if data.nbytes != raw.nbytes:
                    raise ValueError(f"tensor {name!r}: {data.nbytes} bytes made, {raw.nbytes} announced")
                raw = data
            elif isinstance(raw, _Zeros):
                hole += raw.nbytes + pad
                continue
            if hole:
                f.seek(hole, os.SEEK_CUR)
                hole = 0
            if isinstance(raw, FileRange):
                _copy_range(f, raw, splice)
            else:
                f.write(memoryview(raw))  # no copy of the (possibly mmap-backed) bytes
            f.write(b"\0" * pad)
        if hole:
            f.truncate(f.tell() + hole)


# what an ``add_tensor_lazy`` maker returns for bytes that another process writes into the file at the tensor's place
# (``data_offsets``, by pwrite on the same file): ``write`` leaves them, moving on as over a tensor of zeros
WRITTEN_ELSEWHERE = type("WrittenElsewhere", (), {"__repr__": lambda self: "WRITTEN_ELSEWHERE"})()


class FileRange(NamedTuple):
    """Tensor bytes that lie in another file (``fd`` open for reading, from byte ``offset``): what an
    ``add_tensor_lazy`` maker may return for a tensor it copies unchanged, such as ``llampy quantize``'s norms or
    a COPY. The kernel copies them (splice through a pipe, else copy_file_range): nothing is mapped or read into the
    process."""
    fd: int
    offset: int
    nbytes: int


# the pipe that carries FileRange bytes: 1 MiB (the most an unprivileged process may set, fs/pipe-max-size's default)
# rather than the 64 KiB of a pipe's default, which is also all that copy_file_range's own pipe holds on a file system
# that does not share blocks (ext4: do_splice_direct): 16 times fewer passes, each writing the output's page cache in
# larger folios. Copying the 1B file's 3 GB on ext4 (2 cores, a VM), each way in a fresh process: 1.29-1.49 s against
# 1.95-2.23 by copy_file_range; quantize COPY / F16 of that file 1.6-3.3 s against 2.3-4.4
_PIPE_BYTES = 1 << 20


class _Splice:
    """Copies between two files through a pipe of ``_PIPE_BYTES`` (splice: the source's page-cache pages enter the
    pipe by reference and are copied once, into the output's pages). Made when ``write`` first copies a range and
    closed after the file; ``ok`` turns false where splice fails between these files."""

    def __init__(self):
        self.ok = hasattr(os, "splice")
        self.fds = None

    def _pipe(self):
        if self.fds is None:
            r, w = os.pipe()
            cap = 1 << 16
            try:
                import fcntl
                for size in (_PIPE_BYTES, 1 << 18):
                    try:
                        cap = fcntl.fcntl(w, fcntl.F_SETPIPE_SZ, size)
                        break
                    except OSError:     # over fs/pipe-max-size: a smaller one, else the default
                        continue
            except (ImportError, AttributeError):
                pass
            self.fds = (r, w, cap)
        return self.fds

    def copy(self, src_fd: int, src_off: int, fd: int, pos: int, n: int) -> int:
        """Copies up to ``n`` bytes from ``src_fd`` at ``src_off`` to ``fd`` at ``pos``; the count copied (short where
        the source ends, or where splice fails: then ``ok`` is false)."""
        r, w, cap = self._pipe()
        done = 0
        while done < n:
            try:
                k = os.splice(src_fd, w, min(cap, n - done), offset_src=src_off + done)
            except OSError:
                self.ok = False
                return done
            if k <= 0:
                return done
            m = 0
            try:
                while m < k:
                    m += os.splice(r, fd, k - m, offset_dst=pos + done + m)
            except OSError:             # what the pipe holds goes out by write; the rest by the caller's means
                self.ok = False
                while m < k:
                    chunk = memoryview(os.read(r, k - m))
                    if not chunk:
                        break
                    while chunk:
                        wrote = os.pwrite(fd, chunk, pos + done + m)
                        chunk, m = chunk[wrote:], m + wrote
                return done + m
            done += k
        return done

    def close(self) -> None:
        if self.fds is not None:
            os.close(self.fds[0])
            os.close(self.fds[1])
            self.fds = None


def _copy_range(f, src: FileRange, splice: _Splice | None = None) -> None:
    """Appends ``src``'s bytes to the binary file object ``f``: in the kernel where ``f`` is a file (splice, else
    copy_file_range), else through a buffer."""
    off, left = src.offset, src.nbytes
    try:
        fd = f.fileno()
    except (AttributeError, OSError, ValueError):           # io.BytesIO and the like
        fd = None
    if fd is not None:
        f.flush()
        pos = f.tell()
        if splice is not None and splice.ok:
            n = splice.copy(src.fd, off, fd, pos, left)
            off, left = off + n, left - n
        if left and hasattr(os, "copy_file_range"):
            try:
                while left:
                    n = os.copy_file_range(src.fd, fd, left, off, pos + src.nbytes - left)
                    if n <= 0:
                        break
                    off, left = off + n, left - n
            except OSError:             # not supported between these files: the rest through a buffer
                pass
        f.seek(pos + src.nbytes - left)
    while left:
        chunk = os.pread(src.fd, min(left, 1 << 24), off)
        if not chunk:
            raise ValueError(f"{left} bytes missing at byte {off} of the source file")
        f.write(chunk)
        off, left = off + len(chunk), left - len(chunk)


class _Encoded:
    """A metadata value added by ``add_encoded``: its bytes."""
    __slots__ = ("raw",)

    def __init__(self, raw: bytes):
        self.raw = raw


class _Zeros:
    """The bytes of a tensor added by ``add_tensor_zeros``: only their count."""
    __slots__ = ("nbytes",)

    def __init__(self, nbytes: int):
        self.nbytes = nbytes


class _Lazy:
    """The bytes of a tensor added by ``add_tensor_lazy``: their count and the function that makes them."""
    __slots__ = ("nbytes", "make")

    def __init__(self, nbytes: int, make):
        self.nbytes, self.make = nbytes, make


_ZEROS = object()


def copy_gguf(reader, path_or_fileobj) -> None:
    """Writes back what ``reader`` read; byte-identical for every file ggml's own reader accepts."""
    GGUFWriter.from_reader(reader, path_or_fileobj).write()


def _string(s: str) -> bytes:
    b = s.encode("utf-8")
    return _U64.pack(len(b)) + b


def _encode_value(value, sig: tuple):
    """Yields the bytes of one value (without its leading type tag)."""
    vt = VT(sig[0])
    if vt == VT.STRING:
        if not isinstance(value, str):
            raise TypeError(f"a STRING must be str, not {type(value).__name__}")
        yield _string(value)
        return
    if vt != VT.ARRAY:
        yield _scalar_bytes(vt, value)
        return
    if isinstance(value, (str, bytes)) or not hasattr(value, "__len__"):
        raise TypeError(f"an ARRAY must be a list or 1-D ndarray, not {type(value).__name__}")
    n = len(value)
    if len(sig) == 2 and VT(sig[1]) == VT.ARRAY and n:
        sig = (VT.ARRAY, VT.ARRAY, [infer_value_type(v) for v in value])
    et = VT(sig[1])
    yield struct.pack("<IQ", int(et), n)
    if et == VT.STRING:
        if not all(isinstance(s, str) for s in value):
            raise TypeError("an array of STRING holds str only")
        yield b"".join([_U64.pack(len(b)) + b for b in (s.encode("utf-8") for s in value)])
    elif et == VT.ARRAY:
        sigs = sig[2] if isinstance(sig[2], list) else [sig[1:]] * n
        if len(sigs) != n:
            raise ValueError(f"{len(sigs)} element types for {n} elements")
        for v, s in zip(value, sigs):
            yield from _encode_value(v, tuple(s))
    else:
        yield _numeric_array_bytes(et, value)


def _scalar_bytes(vt: VT, value) -> bytes:
    if vt == VT.BOOL:
        if not isinstance(value, (bool, np.bool_)) and value not in (0, 1):
            raise ValueError(f"a BOOL is True/False, not {value!r}")
        return b"\1" if value else b"\0"
    if vt in (VT.FLOAT32, VT.FLOAT64):
        if isinstance(value, (str, bytes)):
            raise TypeError("a float is needed")
        return _SCALARS[vt].pack(float(value))
    if isinstance(value, (float, np.floating, str, bytes)):
        raise TypeError(f"an integer is needed for {vt.name}")
    return _SCALARS[vt].pack(int(value))


def _numeric_array_bytes(et: VT, value) -> bytes:
    dt = SCALAR_DTYPES[et]
    arr = np.asarray(value)
    if arr.ndim != 1 and arr.size:
        raise ValueError(f"metadata arrays are 1-D; got shape {arr.shape}")
    if et == VT.BOOL:
        if arr.size and arr.dtype != np.bool_ and not np.isin(arr, (0, 1)).all():
            raise ValueError("a BOOL array holds 0/1 only")
        return arr.astype(np.uint8).tobytes()
    if et in _INT_RANGES:
        if arr.size and arr.dtype.kind not in "iub":
            raise TypeError(f"an array of {et.name} needs integers, got dtype {arr.dtype}")
        lo, hi = _INT_RANGES[et]
        if arr.size and (int(arr.min()) < lo or int(arr.max()) > hi):
            raise OverflowError(f"values outside {et.name}'s range")
    return arr.astype(dt).tobytes()


def _short(v) -> str:
    r = repr(v)
    return r if len(r) < 60 else r[:57] + "..."


def _sig_name(sig) -> str:
    return "/".join(str(s) if isinstance(s, list) else VT(s).name for s in sig)
