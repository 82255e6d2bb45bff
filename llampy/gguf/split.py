"""Split GGUF files: llama.cpp's gguf-split layout, read as one file and written or merged as its tool does.

A model split in N parts is ``PREFIX-00001-of-0000N.gguf`` ... ``PREFIX-0000N-of-0000N.gguf``. The first part holds
every metadata key of the model plus ``split.no`` (u16, 0-based), ``split.count`` (u16) and
``split.tensors.count`` (i32, the tensors of all parts together); the others hold only those three keys. Tensors
are laid out as in any GGUF file; each lives in exactly one part. A merged file keeps the split keys, with
``split.count`` 0, moved last (ggml's ``gguf_set_val`` removes a key and appends it again).

    r = open_gguf("m-00001-of-00003.gguf")     # a GGUFReader for a single file, a SplitReader for a split one
    gguf_split("m.gguf", "out/m", max_tensors=128)   # or max_size=2_000_000_000
    gguf_merge("out/m-00001-of-00002.gguf", "m2.gguf")
"""
from __future__ import annotations

import os

from .constants import GGUF_DEFAULT_ALIGNMENT, GGUFValueType as VT
from .reader import GGUFError, GGUFReader
from .writer import GGUFWriter

KEY_SPLIT_NO = "split.no"
KEY_SPLIT_COUNT = "split.count"
KEY_SPLIT_TENSORS_COUNT = "split.tensors.count"


def split_path(prefix: str, split_no: int, split_count: int) -> str:
    """llama_split_path: the file name of part ``split_no`` (0-based)."""
    return f"{os.fspath(prefix)}-{split_no + 1:05d}-of-{split_count:05d}.gguf"


def split_prefix(path: str, split_no: int, split_count: int) -> str | None:
    """llama_split_prefix: the prefix of a part's file name, or None when the name does not end as part
    ``split_no`` of ``split_count`` would."""
    path = os.fspath(path)
    post = f"-{split_no + 1:05d}-of-{split_count:05d}.gguf"
    if len(path) <= len(post) or not path.endswith(post):
        return None
    return path[:-len(post)]


class SplitReader:
    """The parts of a split model read as one GGUF file: the first part's metadata, every part's tensors (each
    TensorInfo's ``offset`` is in its own part's file). Same access as GGUFReader: ``metadata``, ``value_types``,
    ``tensors``, ``get``, ``tensor_array``, ``close``."""

    def __init__(self, readers: list[GGUFReader]):
        self.readers = readers
        first = readers[0]
        self.path, self.paths = first.path, [r.path for r in readers]
        self.version, self.alignment = first.version, first.alignment
        self.metadata, self.value_types = first.metadata, first.value_types
        self.file_size = sum(r.file_size for r in readers)
        self.data_offset = first.data_offset      # the first part's
        self.tensors = {}
        self._owner = {}
        for r in readers:
            for name, info in r.tensors.items():
                if name in self.tensors:
                    raise GGUFError(f"tensor {name!r} is in more than one split", None, r.path)
                self.tensors[name] = info
                self._owner[name] = r

    def get(self, key: str, default=None):
        return self.metadata.get(key, default)

    def tensor_array(self, name: str):
        return self._owner[name].tensor_array(name)

    def close(self) -> None:
        for r in self.readers:
            r.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __repr__(self) -> str:
        return f"SplitReader({self.path!r}, {len(self.readers)} parts, {len(self.tensors)} tensors)"


def _split_key(reader: GGUFReader, key: str, vt: VT, required: bool = True):
    if key not in reader.metadata:
        if required:
            raise GGUFError(f"split part has no {key!r} key", None, reader.path)
        return None
    if reader.value_types[key] != (vt,):
        raise GGUFError(f"{key!r} must be {vt.name}, not {'/'.join(VT(t).name for t in reader.value_types[key])}",
                        None, reader.path)
    return int(reader.metadata[key])


def open_gguf(path):
    """A GGUFReader, or a SplitReader over every part when ``path`` is a part of a split model (``split.count``
    above 1). Any part may be named; the others are found by llama.cpp's naming rule."""
    first = GGUFReader(path)
    try:
        n_split = _split_key(first, KEY_SPLIT_COUNT, VT.UINT16, required=False)
        if not n_split or n_split <= 1:
            return first
        idx = _split_key(first, KEY_SPLIT_NO, VT.UINT16)
        prefix = split_prefix(first.path, idx, n_split)
        if prefix is None:
            raise GGUFError(f"part {idx + 1} of a {n_split}-part split model must be named "
                            f"PREFIX{split_path('', idx, n_split)}", None, first.path)
        if idx != 0:      # llama.cpp insists on the first part; we open it for the caller
            first.close()
            first = GGUFReader(split_path(prefix, 0, n_split))
            if _split_key(first, KEY_SPLIT_NO, VT.UINT16) != 0:
                raise GGUFError("the first part's split.no is not 0", None, first.path)
        readers = [first]
        try:
            for i in range(1, n_split):
                p = split_path(prefix, i, n_split)
                if not os.path.exists(p):
                    raise GGUFError(f"split part {i + 1} of {n_split} is missing: {p}")
                r = GGUFReader(p)
                readers.append(r)
                got = _split_key(r, KEY_SPLIT_NO, VT.UINT16)
                if got != i:
                    raise GGUFError(f"split.no is {got}, expected {i}", None, p)
            out = SplitReader(readers)
            want = _split_key(first, KEY_SPLIT_TENSORS_COUNT, VT.INT32)
            if want != len(out.tensors):
                raise GGUFError(f"split model holds {len(out.tensors)} tensors, split.tensors.count says {want}",
                                None, first.path)
            return out
        except BaseException:
            for r in readers[1:]:
                r.close()
            raise
    except BaseException:
        first.close()
        raise


# ---------------------------------------------------------------------------------------------- writing
def _padded_nbytes(info) -> int:
    return info.nbytes + (-info.nbytes) % GGUF_DEFAULT_ALIGNMENT


def plan_split(reader, max_tensors: int = 128, max_size: int | None = None,
               no_tensor_first_split: bool = False) -> list[list[str]]:
    """Tensor names per part, as gguf-split's split_strategy assigns them: at most ``max_tensors`` per part, or
    (``max_size``) parts whose padded tensor bytes stay within ``max_size``; an empty first part with
    ``no_tensor_first_split``."""
    if max_size is None and max_tensors < 1:
        raise ValueError("--split-max-tensors must be at least 1")
    names = list(reader.tensors)
    parts: list[list[str]] = [[]]
    if no_tensor_first_split:
        parts.append([])
    cur = 0
    for i, name in enumerate(names):
        nb = _padded_nbytes(reader.tensors[name])
        if max_size is not None:
            cut = cur + nb > max_size
        else:
            cut = 0 < i and i % max_tensors == 0
        if cut:
            if not parts[-1]:
                raise ValueError("one of the splits would hold no tensors: the size or tensor limit is too small")
            parts.append([])
            cur = nb
        else:
            cur += nb
        parts[-1].append(name)
    return parts


def _set(w: GGUFWriter, key: str, value, vt: VT) -> None:
    """ggml's gguf_set_val: an existing key is removed and the key appended."""
    w.kv = [kv for kv in w.kv if kv[0] != key]
    w.add(key, value, vt)


def _part_writer(path, reader, names, i_split: int, n_split: int) -> GGUFWriter:
    w = GGUFWriter(path)
    if i_split == 0:
        for k, v in reader.metadata.items():
            w.add(k, v, reader.value_types[k])
    # gguf-split's order: the count is a placeholder set again once the parts are known, which moves it last
    _set(w, KEY_SPLIT_NO, i_split, VT.UINT16)
    _set(w, KEY_SPLIT_COUNT, 0, VT.UINT16)
    _set(w, KEY_SPLIT_TENSORS_COUNT, len(reader.tensors), VT.INT32)
    _set(w, KEY_SPLIT_COUNT, n_split, VT.UINT16)
    for name in names:
        t = reader.tensors[name]
        w.add_tensor_raw(t.name, t.type, t.ne, t.data)
    return w


def split_info(reader, parts: list[list[str]]) -> list[tuple[int, int]]:
    """(n_tensors, total bytes) per part: header plus tensor bytes, as gguf-split's print_info counts them."""
    out = []
    for i, names in enumerate(parts):
        w = _part_writer(os.devnull, reader, names, i, len(parts))
        out.append((len(names), len(w.header_bytes()) + sum(reader.tensors[n].nbytes for n in names)))
    return out


def gguf_split(src, out_prefix, max_tensors: int = 128, max_size: int | None = None,
               no_tensor_first_split: bool = False, dry_run: bool = False, log=None) -> list[str]:
    """Splits the GGUF file ``src`` into ``out_prefix-0000i-of-0000N.gguf``; returns the paths (none written on a
    dry run). The parts are byte for byte what llama.cpp's ``llama-gguf-split --split`` writes."""
    log = log or (lambda s: None)
    with GGUFReader(src) as reader:
        parts = plan_split(reader, max_tensors, max_size, no_tensor_first_split)
        n = len(parts)
        log(f"n_split: {n}")
        for i, (nt, size) in enumerate(split_info(reader, parts)):
            log(f"split {i + 1:05d}: n_tensors = {nt}, total_size = {size // 1000 // 1000}M")
        paths = [split_path(out_prefix, i, n) for i in range(n)]
        if dry_run:
            return []
        for i, (names, p) in enumerate(zip(parts, paths)):
            log(f"Writing file {p} ... ")
            _part_writer(p, reader, names, i, n).write()
        log(f"gguf_split: {n} gguf split written with a total of {len(reader.tensors)} tensors.")
        return paths


def gguf_merge(first_part, out, dry_run: bool = False, log=None) -> None:
    """Merges the parts of a split model (named by its first part) into one GGUF file, as llama.cpp's
    ``llama-gguf-split --merge`` does: the first part's keys with ``split.count`` set to 0, every tensor in part
    order. Refuses to overwrite ``out``."""
    log = log or (lambda s: None)
    if os.path.exists(out):
        raise FileExistsError(f"output file {out} already exists")
    first = GGUFReader(first_part)
    try:
        n_split = _split_key(first, KEY_SPLIT_COUNT, VT.UINT16, required=False)
        if n_split is None:
            raise GGUFError(f"input file has no {KEY_SPLIT_COUNT} key", None, first.path)
        if n_split < 1:
            raise GGUFError(f"input file has no valid split count ({n_split})", None, first.path)
        prefix = split_prefix(first.path, 0, n_split)
        if prefix is None:
            raise GGUFError(f"unexpected input file name for part 1 of {n_split}", None, first.path)
        readers = [first] + [GGUFReader(split_path(prefix, i, n_split)) for i in range(1, n_split)]
    except BaseException:
        first.close()
        raise
    try:
        w = GGUFWriter(out)
        for k, v in first.metadata.items():
            w.add(k, v, first.value_types[k])
        _set(w, KEY_SPLIT_COUNT, 0, VT.UINT16)
        n_tensors = 0
        for r in readers:
            log(f"gguf_merge: reading {r.path}")
            for t in r.tensors.values():
                w.add_tensor_raw(t.name, t.type, t.ne, t.data)
            n_tensors += len(r.tensors)
        if not dry_run:
            w.write()
        log(f"gguf_merge: {out} merged from {n_split} split with {n_tensors} tensors.")
    finally:
        for r in readers:
            r.close()


def parse_size(s: str) -> int:
    """gguf-split's --split-max-size: N followed by M (10^6 bytes) or G (10^9)."""
    if not s or s[-1] not in "MG":
        raise ValueError(f"supported units are M (megabytes) or G (gigabytes), but got: {s[-1:] or s!r}")
    try:
        n = int(s[:-1])
    except ValueError:
        raise ValueError(f"bad size {s!r}") from None
    if n <= 0:
        raise ValueError("size must be a positive value")
    return n * (1000 ** 2 if s[-1] == "M" else 1000 ** 3)


__all__ = ["open_gguf", "SplitReader", "gguf_split", "gguf_merge", "plan_split", "split_path", "split_prefix",
           "parse_size"]
