"""The `llampy inspect` report: metadata (long values summarised), the tensor table, totals per type, file size.

``inspect_report(path)`` gives a JSON-ready dict; ``format_report(report)`` the text a person reads.
"""
from __future__ import annotations

import json
import math

import numpy as np

from .constants import GGUFValueType as VT
from .split import open_gguf

ARRAY_SHOWN = 8      # arrays up to this long are shown whole
ARRAY_HEAD = 3       # longer ones: their first few items, then "..."
STRING_SHOWN = 120   # longer strings (chat templates) are cut, with their length


def _item(v) -> str:
    s = json.dumps(v, ensure_ascii=False)
    return s if len(s) <= 40 else s[:37] + '..."'


def summarize_value(value, sig: tuple):
    """A value as the report shows it: short arrays whole (as lists), long ones as
    '[49152 strings: "<|endoftext|>", "<|im_start|>", ... ]', long strings cut."""
    if isinstance(value, str):
        if len(value) <= STRING_SHOWN:
            return value
        return value[:STRING_SHOWN] + f"... ({len(value)} chars)"
    if sig == (VT.FLOAT32,):
        return _float(float(str(np.float32(value))))  # 1e-05, not the double 9.999999747378752e-06
    if isinstance(value, float):
        return _float(value)
    if isinstance(value, np.ndarray):
        n = len(value)
        value = [float(str(x)) for x in value[:ARRAY_SHOWN + 1]] if value.dtype == np.float32 else \
            value[:ARRAY_SHOWN + 1].tolist()
        if n > ARRAY_SHOWN:
            return _summary(value, sig, n)
    if isinstance(value, list):
        if len(value) <= ARRAY_SHOWN and not any(isinstance(v, list) for v in value):
            return [_float(v) if isinstance(v, float) else v for v in value]
        return _summary(value, sig, len(value))
    return value


def _float(x: float):
    """Finite floats stay numbers; NaN and infinities become strings, so that --json stays strict JSON."""
    return x if math.isfinite(x) else repr(x)


def _summary(value: list, sig: tuple, n: int) -> str:
    kind = sig[1].name.lower() if len(sig) > 1 else "values"
    kind = {"string": "strings", "array": "arrays", "bool": "bools"}.get(kind, f"{kind} values")
    head = ", ".join(_item(v if not isinstance(v, list) else f"[{len(v)} items]") for v in value[:ARRAY_HEAD])
    return f"[{n} {kind}: {head}, ... ]"


def inspect_report(path) -> dict:
    """The report of a GGUF file, or of every part of a split model (any part named) read as one."""
    with open_gguf(path) as r:
        tensors = [{"name": t.name, "type": t.type.name, "shape": list(t.ne), "bytes": t.nbytes,
                    "offset": t.offset} for t in r.tensors.values()]
        totals: dict = {}
        for t in tensors:
            e = totals.setdefault(t["type"], {"count": 0, "bytes": 0})
            e["count"] += 1
            e["bytes"] += t["bytes"]
        n_params = sum(int(np.prod(t["shape"], dtype=object)) for t in tensors)
        return {
            "path": str(path), "version": r.version, "alignment": r.alignment, "file_size": r.file_size,
            "data_offset": r.data_offset, "n_params": n_params,
            "metadata": {k: summarize_value(v, r.value_types[k]) for k, v in r.metadata.items()},
            "value_types": {k: "/".join(_type_name(x) for x in sig) for k, sig in r.value_types.items()},
            "tensors": tensors,
            "totals": dict(sorted(totals.items(), key=lambda kv: -kv[1]["bytes"])),
            "tensor_bytes": sum(t["bytes"] for t in tensors),
            "parts": [{"path": p.path, "file_size": p.file_size, "n_tensors": len(p.tensors)}
                      for p in getattr(r, "readers", [])],
        }


def _type_name(x) -> str:
    return "MIXED" if isinstance(x, list) else x.name


def _mib(n: int) -> str:
    return f"{n / 2**20:.2f} MiB"


def format_report(rep: dict) -> str:
    lines = [f"{rep['path']}: GGUF v{rep['version']}, {rep['file_size']} bytes ({_mib(rep['file_size'])}), "
             f"{len(rep['metadata'])} metadata keys, {len(rep['tensors'])} tensors, "
             f"{rep['n_params'] / 1e6:.2f}M parameters, alignment {rep['alignment']}",
             "", "metadata:"]
    width = max((len(k) for k in rep["metadata"]), default=0)
    for k, v in rep["metadata"].items():
        summary = isinstance(v, str) and rep["value_types"][k].startswith("ARRAY")
        shown = v if summary else json.dumps(v, ensure_ascii=False)
        lines.append(f"  {k:<{width}}  {rep['value_types'][k]:<14} {shown}")
    lines += ["", "tensors:", f"  {'name':<40} {'type':<8} {'shape':<24} {'bytes':>12}"]
    for t in rep["tensors"]:
        lines.append(f"  {t['name']:<40} {t['type']:<8} {str(t['shape']):<24} {t['bytes']:>12}")
    lines += ["", "totals per type:"]
    for ty, e in rep["totals"].items():
        lines.append(f"  {ty:<8} {e['count']:>5} tensors {e['bytes']:>14} bytes ({_mib(e['bytes'])})")
    lines.append(f"  {'all':<8} {len(rep['tensors']):>5} tensors {rep['tensor_bytes']:>14} bytes "
                 f"({_mib(rep['tensor_bytes'])})")
    lines += ["", f"file size: {rep['file_size']} bytes ({_mib(rep['file_size'])}), "
                  f"header {rep['data_offset']} bytes"]
    for i, part in enumerate(rep.get("parts", [])):
        lines.append(f"  part {i + 1}/{len(rep['parts'])}: {part['path']}, {part['file_size']} bytes, "
                     f"{part['n_tensors']} tensors")
    return "\n".join(lines)
