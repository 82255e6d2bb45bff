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


def write_imatrix_legacy(path, im: IMatrix) -> None:
    """llama-imatrix --output-format dat: values stored as (sum / count) * ncall, ncall = ceil(max count /
    chunk_size); entries with no data left out; then the chunk count and the (last) dataset name."""
    chunk_size = max(1, int(im.chunk_size))
    names = [n for n in sorted(im.entries) if len(im.entries[n][1]) and (im.entries[n][1] != 0).any()]
    out = [struct.pack("<i", len(names))]
    for name in names:
        sums, counts = im.entries[name]
        b = name.encode()
        ncall = int((int(counts.max()) + chunk_size - 1) // chunk_size)
        nval, nmat = len(sums), len(counts)
        c = np.repeat(counts.astype(np.float32), nval // nmat)
        v = np.where(c == 0, np.float32(1), sums.astype(np.float32))
        c = np.where(c == 0, np.float32(1), c)
        tmp = ((v / c) * np.float32(ncall)).astype("<f4")
        out += [struct.pack("<i", len(b)), b, struct.pack("<ii", ncall, nval), tmp.tobytes()]
    ds = (im.datasets[-1] if im.datasets else "").encode()
    out += [struct.pack("<ii", int(im.chunk_count), len(ds)), ds]
    with open(path, "wb") as f:
        f.write(b"".join(out))


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


# ------------------------------------------------------------------------------------------------ collecting

class IMatrixCollector:
    """tools/imatrix's collect_imatrix as a scheduler eval callback: per weight, the sums of the squared inputs of
    its matrix products (float, accumulated row by row as llama.cpp does) and the number of rows seen (per expert
    for MUL_MAT_ID). A fused gate/up product (MUL_MAT_GLU) counts for both weights, as the two products would."""

    def __init__(self, process_output: bool = False):
        self.process_output = process_output
        self.stats: dict = {}               # name -> [values float32 [n_mat * ne0], counts int64 [n_mat]]

    def _wanted(self, w) -> bool:
        name = w.name or ""
        return name.startswith("blk.") or (self.process_output and name == "output.weight")

    def __call__(self, t, ask: bool) -> bool:
        from ..ggml.tensor import Op
        if ask:
            if t.op is Op.MUL_MAT_ID:
                return self._wanted(t.src[0])
            if t.op is Op.MUL_MAT:
                return t.src[1].ne[1] >= 16 and t.src[1].type == 0 and self._wanted(t.src[0])
            if t.op is Op.MUL_MAT_GLU:
                return t.src[2].ne[1] >= 16 and t.src[2].type == 0 and self._wanted(t.src[0])
            return False
        from ..ggml.backend import tensor_get
        if t.op is Op.MUL_MAT_ID:
            self._add_id(t.src[0], tensor_get(t.src[1]), tensor_get(t.src[2]))
        elif t.op is Op.MUL_MAT:
            self._add(t.src[0], tensor_get(t.src[1]))
        else:
            x = tensor_get(t.src[2])
            self._add(t.src[0], x)
            self._add(t.src[1], x)
        return True

    def _entry(self, name, size, n_mat):
        e = self.stats.get(name)
        if e is None:
            e = self.stats[name] = [np.zeros(size, np.float32), np.zeros(n_mat, np.int64)]
        elif len(e[0]) != size:
            raise ValueError(f"inconsistent size for {name} ({len(e[0])} vs {size})")
        return e

    def _add(self, w, x: np.ndarray) -> None:
        # x: NumPy order [ne3, ne2, ne1, ne0]; weight w has n_mat = ne2 * ne3 matrices
        x = np.asarray(x, np.float32)
        x4 = x.reshape((1,) * (4 - x.ndim) + x.shape)
        ne0 = x4.shape[-1]
        wne = tuple(w.ne) + (1,) * (4 - len(w.ne))
        n_mat = wne[2] * wne[3]
        e = self._entry(w.name, ne0 * n_mat, 1)
        if len(e[1]) > 1 and (e[1] == e[1][0]).all():
            e[1] = e[1][:1]
        acc = e[0].reshape(n_mat, ne0)
        for i3 in range(x4.shape[0]):
            for i2 in range(x4.shape[1]):
                a = acc[(i3 % wne[3]) * wne[2] + (i2 % wne[2])]
                rows = x4[i3, i2]
                sq = rows * rows
                for r in range(sq.shape[0]):          # row by row: llama.cpp's float order
                    a += sq[r]
        if not np.isfinite(e[0]).all():
            raise ValueError(f"non-finite values detected in {w.name}")
        e[1] += x4.shape[0] * x4.shape[1] * x4.shape[2] // n_mat

    def _add_id(self, w, x: np.ndarray, ids: np.ndarray) -> None:
        # x: [n_tokens, n_used or 1, ne0]; ids: [n_tokens, n_used]; w: [n_expert, ne1, ne0]
        x = np.asarray(x, np.float32).reshape(-1, x.shape[-2], x.shape[-1])
        ids = np.asarray(ids).reshape(x.shape[0], -1)
        ne0, n_as = x.shape[-1], w.ne[2]
        e = self._entry(w.name, ne0 * n_as, n_as)
        if len(e[1]) == 1 and n_as > 1:
            e[1] = np.full(n_as, e[1][0], np.int64)
        acc = e[0].reshape(n_as, ne0)
        for idx in range(ids.shape[1]):
            for row in range(x.shape[0]):
                ex = int(ids[row, idx])
                v = x[row, idx % x.shape[1]]
                acc[ex] += v * v
                e[1][ex] += 1

    def to_imatrix(self, datasets, chunk_count: int, chunk_size: int) -> IMatrix:
        return IMatrix({k: (v[0].copy(), v[1].copy()) for k, v in self.stats.items()}, list(datasets),
                       chunk_count, chunk_size, False, True)


def compute_imatrix(model, text: str, n_ctx: int = 512, n_chunks: int | None = None, process_output: bool = False,
                    on_chunk=None) -> tuple[IMatrixCollector, int, float]:
    """llama-imatrix's compute_imatrix: chunks of n_ctx tokens (BOS first where the vocabulary adds it), all rows
    computed and every logit kept (so the last layer sees every token); also the running perplexity over each
    chunk's second half. Returns (collector, chunks done, final PPL)."""
    import math
    from .batch import Batch
    from .context import Context, ContextError
    from .perplexity import _nll_rows
    vocab = model.vocab
    add_bos = bool(vocab.add_bos and vocab.bos is not None)
    tokens = np.array(vocab.tokenize(text, add_special=add_bos, parse_special=False), np.int32)
    if len(tokens) < 2 * n_ctx:
        raise ContextError(f"you need at least {2 * n_ctx} tokens for a context of {n_ctx} tokens; the text "
                           f"has {len(tokens)}")
    n_chunk = len(tokens) // n_ctx
    if n_chunks:
        n_chunk = min(n_chunk, n_chunks)
    ctx = Context(model, n_ctx=n_ctx, n_batch=n_ctx, n_ubatch=min(n_ctx, 512))
    col = IMatrixCollector(process_output)
    ctx.sched.cb_eval = col
    first = n_ctx // 2
    nll, count, ppl = 0.0, 0, float("nan")
    try:
        for c in range(n_chunk):
            chunk = tokens[c * n_ctx:(c + 1) * n_ctx]
            inp = chunk.copy()
            if add_bos:
                inp[0] = vocab.bos
            ctx.kv_clear()
            ctx.decode(Batch.from_tokens(inp, pos0=0, logits_all=True))
            logits = ctx.get_logits()
            nll += float(_nll_rows(logits[first:n_ctx - 1], chunk[first + 1:n_ctx]).sum())
            count += n_ctx - 1 - first
            ppl = math.exp(nll / count)
            if on_chunk:
                on_chunk(c, n_chunk, ppl)
    finally:
        ctx.sched.cb_eval = None
    return col, n_chunk, ppl
