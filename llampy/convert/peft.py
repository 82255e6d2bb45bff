"""PEFT LoRA adapters to llama.cpp's GGUF LoRA (convert_lora_to_gguf.py)."""
from __future__ import annotations

import re
from pathlib import Path

import numpy as np

from ..gguf import GGUFWriter
from ..gguf.constants import GGUFValueType as VT
from .files import ConvertError, load_json as _load_json, read_safetensors
from .hf import ARCHITECTURES, OUTTYPES, PERMUTED, QUANT_VERSION, _encode, _permute, _tensor_type, gguf_name


def convert_peft_lora(src, dst, base=None, outtype: str = "f16", log=None) -> Path:
    """A PEFT adapter (adapter_config.json, adapter_model.safetensors) to llama.cpp's GGUF LoRA: for each adapted
    weight W, ``W.lora_a`` [n_in, r] and ``W.lora_b`` [r, n_out] (ggml order), ``adapter.lora.alpha`` from
    lora_alpha. ``base``: the base model's directory (its config.json), else adapter_config's
    base_model_name_or_path when that is a local directory."""
    log = log or (lambda s: None)
    d, dst = Path(src), Path(dst)
    if outtype not in OUTTYPES:
        raise ConvertError(f"--outtype must be one of {', '.join(OUTTYPES)}, not {outtype!r}")
    file_type, matrix_type = OUTTYPES[outtype]
    acfg = _load_json(d / "adapter_config.json")
    if acfg is None:
        raise ConvertError(f"{d}: no adapter_config.json (not a PEFT adapter)")
    if acfg.get("peft_type", "LORA") != "LORA" or acfg.get("use_dora"):
        raise ConvertError(f"{d}: only plain LoRA adapters are converted (peft_type {acfg.get('peft_type')!r}"
                           f"{', DoRA' if acfg.get('use_dora') else ''})")
    base = Path(base) if base else Path(str(acfg.get("base_model_name_or_path") or ""))
    cfg = _load_json(base / "config.json") if str(base) else None
    if cfg is None:
        raise ConvertError(f"{d}: the base model's config.json was not found (give --base DIR)")
    arch = ARCHITECTURES.get((cfg.get("architectures") or [None])[0])
    if arch is None:
        raise ConvertError(f"base architecture {(cfg.get('architectures') or [None])[0]!r} is not converted by "
                           f"llampy (supported: {', '.join(ARCHITECTURES)})")
    r = int(acfg.get("r", 0))
    alpha = float(acfg.get("lora_alpha", r))
    if acfg.get("use_rslora"):
        # rank-stabilised LoRA scales by alpha / sqrt(r); llama.cpp scales by alpha / r, so alpha is written as
        # alpha * sqrt(r) to keep the adapter's meaning
        alpha *= float(np.sqrt(r))
    n_head = int(cfg["num_attention_heads"])
    n_head_kv = int(cfg.get("num_key_value_heads") or n_head)
    st = d / "adapter_model.safetensors"
    if not st.is_file():
        raise ConvertError(f"{d}: no adapter_model.safetensors")
    pairs: dict[str, dict[str, np.ndarray]] = {}
    for name, data in read_safetensors(st).items():
        m = re.fullmatch(r"(?:base_model\.model\.)?(.+)\.lora_([AB])(?:\.default)?\.weight", name)
        if m is None:
            raise ConvertError(f"{d}: tensor {name!r} is not a lora_A/lora_B weight (embeddings, DoRA magnitudes "
                               f"and extra modules are not converted)")
        pairs.setdefault(m.group(1) + ".weight", {})[m.group(2)] = data
    w = GGUFWriter(dst)
    w.add("general.architecture", arch)
    w.add("general.type", "adapter")
    w.add("adapter.type", "lora")
    w.add("general.name", d.resolve().name)
    w.add("general.quantization_version", QUANT_VERSION, VT.UINT32)
    w.add("adapter.lora.alpha", alpha, VT.FLOAT32)
    w.add("general.file_type", file_type, VT.UINT32)
    for hf in sorted(pairs):
        ab = pairs[hf]
        if set(ab) != {"A", "B"}:
            raise ConvertError(f"{d}: {hf} has lora_{'A' if 'A' not in ab else 'B'} missing")
        gn = gguf_name(hf, arch)
        if gn is None or gn.startswith(("token_embd", "output.")):
            raise ConvertError(f"{d}: cannot convert a LoRA of {hf!r}")
        a, b = np.asarray(ab["A"], np.float32), np.asarray(ab["B"], np.float32)
        if arch in PERMUTED:          # the product's rows are permuted as the base weight's are: B's rows
            if hf.endswith("q_proj.weight"):
                b = _permute(b, n_head)
            elif hf.endswith("k_proj.weight"):
                b = _permute(b, n_head_kv)
        for suffix, data in ((".lora_a", a), (".lora_b", b)):
            t = _tensor_type(gn + suffix, data.shape, matrix_type)
            w.add_tensor(gn + suffix, _encode(data, t), t)
            log(f"{gn + suffix:40s} -> {t.name}, shape = {{{', '.join(map(str, reversed(data.shape)))}}}")
    w.write()
    return dst
