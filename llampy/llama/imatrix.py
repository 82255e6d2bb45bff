"""Importance matrices in llama.cpp's formats (tools/imatrix, common/imatrix-loader.cpp).

GGUF (the default): ``general.type = "imatrix"``, ``imatrix.datasets`` (strings), ``imatrix.chunk_count`` and
``imatrix.chunk_size`` (u32); per weight, tensors ``<name>.in_sum2`` (F32 [ne0, n_mat]: the sums of squared
activations per input column, per expert) and ``<name>.counts`` (F32 [1, n_mat]: tokens seen), names sorted.
Legacy ``.dat``: per entry the name, ncall and the values already divided by the count and multiplied by ncall;
then optionally the chunk count and one dataset name.

``quantize_weights`` turns either into what llama-quantize hands ggml: sums / counts per expert (1 where an expert
saw no token), for the legacy format sums / ncall.
"""
from __future__ import annotations

import struct
from dataclasses import dataclass, field

import numpy as np

from ..gguf.constants import GGUFValueType as VT
from ..gguf.reader import GGUFError, GGUFReader
from ..gguf.writer import GGUFWriter


@dataclass
class IMatrix:
    entries: dict = field(default_factory=dict)     # name -> (sums float32 [n_mat * ne0], counts int64 [n_mat])
    datasets: list = field(default_factory=list)
    chunk_count: int = 0
    chunk_size: int = 0
    is_legacy: bool = False
    has_metadata: bool = False


def read_imatrix(path) -> IMatrix:
    try:
        r = GGUFReader(path)
    except GGUFError:
        return _read_legacy(path)
    try:
        im = IMatrix()
        ds = r.get("imatrix.datasets")
        if isinstance(ds, list):
            im.datasets = [str(s) for s in ds]
        im.has_metadata = all(k in r.metadata for k in ("imatrix.datasets", "imatrix.chunk_count",
                                                         "imatrix.chunk_size"))
        im.chunk_count = int(r.get("imatrix.chunk_count", 0))
        im.chunk_size = int(r.get("imatrix.chunk_size", 0))
        pairs: dict = {}
        for name, t in r.tensors.items():
            for suffix, slot in ((".in_sum2", 0), (".counts", 1)):
                if name.endswith(suffix):
                    pairs.setdefault(name[:-len(suffix)], [None, None])[slot] = t
        if not pairs:
            raise GGUFError(f"{path}: no imatrix data")
        for name in sorted(pairs):
            s, c = pairs[name]
            if s is None or c is None:
                raise GGUFError(f"mismatched sums and counts for {name}")
            if int(s.type) != 0 or int(c.type) != 0:
                raise GGUFError(f"sums and counts for {name} must be F32")
            sums = np.array(s.data.view(np.float32))
            counts = np.rint(c.data.view(np.float32).astype(np.float64)).astype(np.int64)
            im.entries[name] = (sums, counts)
        return im
    finally:
        r.close()


def _read_legacy(path) -> IMatrix:
    with open(path, "rb") as f:
        buf = f.read()
    im = IMatrix(is_legacy=True)
    pos = 0

    def i32():
        nonlocal pos
        if pos + 4 > len(buf):
            raise GGUFError(f"{path}: truncated imatrix")
        v = struct.unpack_from("<i", buf, pos)[0]
        pos += 4
        return v
    n = i32()
    if n < 1:
        raise GGUFError(f"{path}: no data in imatrix file")
    for _ in range(n):
        ln = i32()
        name = buf[pos:pos + ln].decode("utf-8", "replace")
        pos += ln
        ncall, nval = i32(), i32()
        if nval < 1 or pos + 4 * nval > len(buf):
            raise GGUFError(f"{path}: bad entry {name!r}")
        sums = np.frombuffer(buf, "<f4", nval, pos).astype(np.float32)
        pos += 4 * nval
        im.entries[name] = (sums, np.array([ncall], np.int64))
    if pos + 4 <= len(buf):
        im.chunk_count = i32()
        if pos + 4 <= len(buf):
            ln = i32()
            if ln > 0:
                im.datasets.append(buf[pos:pos + ln].decode("utf-8", "replace"))
    return im


def write_imatrix(path, im: IMatrix) -> None:
    """The file llama-imatrix writes (gguf_write_to_file of its context): keys, then tensors in name order."""
    w = GGUFWriter(path)
    w.add("general.type", "imatrix", VT.STRING)
    w.add("imatrix.datasets", list(im.datasets), (VT.ARRAY, VT.STRING))
    w.add("imatrix.chunk_count", int(im.chunk_count), VT.UINT32)
    w.add("imatrix.chunk_size", int(im.chunk_size), VT.UINT32)
    for name in sorted(im.entries):
        sums, counts = im.entries[name]
        n_mat = len(counts)
        if len(sums) == 0 or n_mat == 0:
            continue
        w.add_tensor_raw(f"{name}.in_sum2", 0, (len(sums) // n_mat, n_mat), np.asarray(sums, np.float32))
        w.add_tensor_raw(f"{name}.counts", 0, (1, n_mat), np.asarray(counts, np.float32))
    w.write()


def quantize_weights(im: IMatrix, include=(), exclude=()) -> dict:
    """tools/quantize's load_imatrix + prepare_imatrix: name -> float32 weights for ggml's quantizers."""
    out = {}
    for name, (sums, counts) in im.entries.items():
        if im.is_legacy:
            ncall = int(counts[0]) if len(counts) else 0
            e = (sums / np.float32(ncall)).astype(np.float32) if ncall > 0 else sums.astype(np.float32)
        else:
            n = len(counts)
            s = sums.reshape(n, -1)
            c = counts.astype(np.float32)[:, None]
            with np.errstate(divide="ignore", invalid="ignore"):
                e = np.where(c > 0, s / np.where(c > 0, c, 1), np.float32(1)).astype(np.float32).reshape(-1)
        out[name] = e
    if exclude:
        out = {k: v for k, v in out.items() if not any(x in k for x in exclude)}
    if include:
        out = {k: v for k, v in out.items() if any(x in k for x in include)}
    return out
