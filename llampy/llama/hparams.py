"""Model hyper-parameters from GGUF metadata, with llama.cpp's defaults (llama-model.cpp load_hparams)."""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np


class MissingMetadata(ValueError):
    pass


@dataclass
class HParams:
    arch: str
    name: str = ""
    n_ctx_train: int = 0
    n_embd: int = 0
    n_layer: int = 0
    n_head_arr: list = field(default_factory=list)
    n_head_kv_arr: list = field(default_factory=list)
    n_ff_arr: list = field(default_factory=list)
    n_embd_head_k: int = 0
    n_embd_head_v: int = 0
    n_rot: int = 0
    n_vocab: int = 0
    f_norm_eps: float = 1e-5
    f_norm_rms_eps: float = 1e-5
    # rope
    rope_type: int = 0
    rope_freq_base: float = 10000.0
    rope_freq_scale: float = 1.0
    rope_scaling_type: str = "linear"
    n_ctx_orig_yarn: int = 0
    rope_attn_factor: float = 1.0
    yarn_ext_factor: float = 0.0
    yarn_attn_factor: float = 1.0
    yarn_beta_fast: float = 32.0
    yarn_beta_slow: float = 1.0
    rope_freq_base_swa: float = 10000.0
    rope_freq_scale_swa: float = 1.0
    # attention
    f_attention_scale: float = 0.0
    n_swa: int = 0
    swa_layers: list = field(default_factory=list)   # bool per layer
    attn_soft_cap: float = 0.0
    final_logit_softcap: float = 0.0
    # MoE
    n_expert: int = 0
    n_expert_used: int = 0
    n_ff_exp: int = 0
    expert_weights_norm: bool = False
    # granite
    f_embedding_scale: float = 0.0
    f_residual_scale: float = 0.0
    f_logit_scale: float = 0.0
    # state-space layers (mamba, mamba2, hybrids): llama.cpp's ssm_* hparams; recurrent_layers: bool per layer
    ssm_d_conv: int = 0
    ssm_d_inner: int = 0
    ssm_d_state: int = 0
    ssm_dt_rank: int = 0
    ssm_n_group: int = 0
    ssm_dt_b_c_rms: bool = False
    recurrent_layers: list = field(default_factory=list)

    def n_head(self, il: int = 0) -> int:
        return self.n_head_arr[il]

    def n_head_kv(self, il: int = 0) -> int:
        return self.n_head_kv_arr[il]

    def n_ff(self, il: int = 0) -> int:
        return self.n_ff_arr[il]

    def n_embd_k_gqa(self, il: int = 0) -> int:
        return self.n_embd_head_k * self.n_head_kv(il)

    def n_embd_v_gqa(self, il: int = 0) -> int:
        return self.n_embd_head_v * self.n_head_kv(il)

    def is_recurrent(self, il: int) -> bool:
        return bool(self.recurrent_layers) and self.recurrent_layers[il]

    def n_embd_r(self) -> int:
        """Floats of a recurrent layer's rolling row per sequence: the convolution's last d_conv - 1 inputs."""
        return max(self.ssm_d_conv - 1, 0) * (self.ssm_d_inner + 2 * self.ssm_n_group * self.ssm_d_state)

    def n_embd_s(self) -> int:
        """Floats of a recurrent layer's state per sequence."""
        return self.ssm_d_state * self.ssm_d_inner

    def is_swa(self, il: int) -> bool:
        return bool(self.swa_layers) and self.swa_layers[il]

    def set_swa_pattern(self, n_pattern: int) -> None:
        """Every n_pattern-th layer is dense, the others use the sliding window (llama_hparams::set_swa_pattern)."""
        self.swa_layers = [n_pattern == 0 or (il % n_pattern < n_pattern - 1) for il in range(self.n_layer)]


class Meta:
    """Typed access to one architecture's keys: ``m.get("context_length")`` reads ``{arch}.context_length``."""

    def __init__(self, md: dict, arch: str):
        self.md = md
        self.arch = arch

    def key(self, k: str) -> str:
        return k if k.startswith(("general.", "tokenizer.")) else f"{self.arch}.{k}"

    def has(self, k: str) -> bool:
        return self.key(k) in self.md

    def get(self, k: str, default=None, required: bool = False):
        full = self.key(k)
        if full not in self.md:
            if required:
                raise MissingMetadata(f"missing metadata key {full!r}")
            return default
        return self.md[full]

    def get_per_layer(self, k: str, n_layer: int, default=None, required: bool = False) -> list:
        v = self.get(k, default, required)
        if isinstance(v, (list, np.ndarray)):
            if len(v) != n_layer:
                raise MissingMetadata(f"{self.key(k)} has {len(v)} values for {n_layer} layers")
            return [int(x) for x in v]
        return [v] * n_layer


def load_hparams(md: dict) -> HParams:
    arch = md.get("general.architecture")
    if not isinstance(arch, str):
        raise MissingMetadata("missing metadata key 'general.architecture'")
    m = Meta(md, arch)
    hp = HParams(arch=arch, name=str(md.get("general.name", "")))
    hp.n_ctx_train = int(m.get("context_length", required=True))
    hp.n_embd = int(m.get("embedding_length", required=True))
    hp.n_layer = int(m.get("block_count", required=True))
    if hp.n_layer <= 0 or hp.n_embd <= 0:
        raise MissingMetadata(f"{arch}.block_count and {arch}.embedding_length must be positive")
    hp.n_ff_arr = m.get_per_layer("feed_forward_length", hp.n_layer, 0)
    hp.n_head_arr = m.get_per_layer("attention.head_count", hp.n_layer, required=True)
    hp.n_head_kv_arr = m.get_per_layer("attention.head_count_kv", hp.n_layer, None)
    if hp.n_head_kv_arr[0] is None:
        hp.n_head_kv_arr = list(hp.n_head_arr)
    hp.n_head_arr = [int(x) for x in hp.n_head_arr]
    hp.n_head_kv_arr = [int(x) for x in hp.n_head_kv_arr]
    if hp.n_head() < 0:     # 0 for recurrent layers (mamba)
        raise MissingMetadata(f"{arch}.attention.head_count must not be negative")
    head = hp.n_embd // hp.n_head() if hp.n_head() else 0
    hp.n_embd_head_k = int(m.get("attention.key_length", head))
    hp.n_embd_head_v = int(m.get("attention.value_length", head))
    hp.n_rot = int(m.get("rope.dimension_count", hp.n_embd_head_k))
    hp.f_norm_eps = float(m.get("attention.layer_norm_epsilon", 1e-5))
    hp.f_norm_rms_eps = float(m.get("attention.layer_norm_rms_epsilon", 1e-5))
    tokens = md.get("tokenizer.ggml.tokens")
    hp.n_vocab = int(m.get("vocab_size", len(tokens) if tokens is not None else 0))

    # rope
    hp.rope_freq_base = float(m.get("rope.freq_base", 10000.0))
    hp.rope_scaling_type = str(m.get("rope.scaling.type", "linear"))
    factor = float(m.get("rope.scaling.factor", m.get("rope.scale_linear", 0.0)))
    hp.rope_freq_scale = 1.0 if factor == 0.0 else 1.0 / factor
    if hp.rope_scaling_type == "none":
        hp.rope_freq_scale = 1.0
    hp.n_ctx_orig_yarn = int(m.get("rope.scaling.original_context_length", hp.n_ctx_train))
    hp.rope_attn_factor = float(m.get("rope.scaling.attn_factor", 1.0))
    if hp.rope_scaling_type == "yarn":
        hp.yarn_ext_factor = 1.0
        f = 1.0 / hp.rope_freq_scale
        mscale = 1.0 if f <= 1.0 else 0.1 * math.log(f) + 1.0
        hp.yarn_attn_factor = mscale / (1.0 + 0.1 * math.log(f)) if f > 1.0 else mscale
    hp.yarn_attn_factor *= hp.rope_attn_factor
    hp.rope_freq_base_swa = float(m.get("rope.freq_base_swa", 10000.0))

    # MoE
    hp.n_expert = int(m.get("expert_count", 0))
    hp.n_expert_used = int(m.get("expert_used_count", 0))
    hp.n_ff_exp = int(m.get("expert_feed_forward_length", 0))
    if hp.n_expert and not 0 < hp.n_expert_used <= hp.n_expert:
        raise MissingMetadata(f"{arch}.expert_used_count must be in 1..{hp.n_expert}")
    return hp
