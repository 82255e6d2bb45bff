"""qwen2vl: qwen2's block with M-RoPE (each token four positions, t, h, w, e, the rotated pairs split among them by
``rope.dimension_sections``): text tokens take p, p, p, 0, an image's tokens their row and column
(llama.cpp's llm_build_qwen2vl)."""
from __future__ import annotations

from ...ggml import ops
from ..hparams import InvalidMetadata
from . import qwen2

load_tensors = qwen2.load_tensors
build_graph = qwen2.build_graph


def load_hparams(hp, md):
    hp.rope_type = ops.ROPE_TYPE_MROPE
    hp.n_pos_per_embd = 4
    sect = md.get("qwen2vl.rope.dimension_sections")
    if sect is None:
        raise InvalidMetadata("metadata 'qwen2vl.rope.dimension_sections' is missing (M-RoPE needs it)")
    sect = [int(x) for x in list(sect)[:4]] + [0] * max(0, 4 - len(sect))
    if any(x < 0 for x in sect) or not any(sect[:3]):
        raise InvalidMetadata(f"metadata 'qwen2vl.rope.dimension_sections' is {sect}")
    hp.rope_sections = tuple(sect)
