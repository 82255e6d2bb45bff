"""Model hyper-parameters from GGUF metadata, with llama.cpp's defaults (llama-model.cpp load_hparams)."""
from __future__ import annotations

import math
import re
from dataclasses import dataclass, field

import numpy as np


class MissingMetadata(ValueError):
    """A key the model needs is absent, or its value is of the wrong type or out of range (InvalidMetadata)."""


class InvalidMetadata(MissingMetadata):
    """A hyper-parameter the file gives that no model can have: a NaN epsilon, a zero RoPE base, more layers than
    the file has tensors for... One per problem, naming the key, found at load before anything is allocated."""


LLAMA_MAX_LAYERS = 512      # llama.cpp's limits on per-layer arrays
LLAMA_MAX_EXPERTS = 512
ROPE_SCALING_TYPES = ("none", "linear", "yarn", "longrope")
_BLK = re.compile(r"blk\.(\d+)\.")


def md_int(md: dict, key: str, default=None, lo: int | None = None, hi: int | None = None):
    """md[key] as an int (a GGUF integer or bool, not a float, string or array), within [lo, hi]; default when
    absent. InvalidMetadata names the key otherwise."""
    v = md.get(key, default)
    if v is None or v is default and key not in md:
        return v
    if isinstance(v, np.generic):
        v = v.item()
    if isinstance(v, bool) or not isinstance(v, int):
        raise InvalidMetadata(f"metadata {key!r} must be an integer, not {_what(v)}")
    if (lo is not None and v < lo) or (hi is not None and v > hi):
        rng = f"at least {lo}" if hi is None else f"in {lo}..{hi}" if lo is not None else f"at most {hi}"
        raise InvalidMetadata(f"metadata {key!r} is {v}; it must be {rng}")
    return v


def md_float(md: dict, key: str, default=None, positive: bool = False, nonneg: bool = False):
    """md[key] as a finite float (a GGUF float or integer); with ``positive``/``nonneg``, > 0 / >= 0."""
    v = md.get(key, default)
    if v is None or v is default and key not in md:
        return v
    if isinstance(v, np.generic):
        v = v.item()
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise InvalidMetadata(f"metadata {key!r} must be a number, not {_what(v)}")
    v = float(v)
    if not math.isfinite(v) or (positive and v <= 0) or (nonneg and v < 0):
        need = "a positive number" if positive else "a number >= 0" if nonneg else "a finite number"
        raise InvalidMetadata(f"metadata {key!r} is {v}; it must be {need}")
    return v


def _f32(x: float) -> float:
    return float(np.float32(x))


def yarn_attn_factor(freq_scale: float, rope_attn_factor: float = 1.0, log_mul: float = 0.0,
                     mscale: float = 1.0) -> float:
    """The rope's attention factor under YaRN, as llama.cpp's context sets it, in its float32 arithmetic:
    get_mscale(s, mscale) / get_mscale(s, log_mul) with a yarn_log_multiplier (mscale_all_dim), else
    get_mscale(s, 1); then divided by 1 + 0.1 ln s (ggml's rope multiplies that back) and times rope.scaling's
    attn_factor. get_mscale(s, m) = 0.1 m ln s + 1 for a factor s > 1."""
    s = _f32(1.0 / _f32(freq_scale))
    tenth = _f32(0.1)

    def get_mscale(m):
        return 1.0 if s <= 1.0 else _f32(_f32(_f32(tenth * _f32(m)) * _f32(math.log(s))) + 1.0)

    att = _f32(get_mscale(mscale) / get_mscale(log_mul)) if log_mul else get_mscale(1.0)
    att = _f32(att * _f32(1.0 / _f32(1.0 + _f32(tenth * _f32(math.log(s))))))
    return _f32(att * _f32(rope_attn_factor))


def load_swa_pattern(hp, md: dict, n_pattern: int) -> None:
    """llama.cpp's load_swa_pattern: attention.sliding_window_pattern as a per-layer bool array (layers past its end
    not sliding, the array's default there) or as a period (every n-th layer dense), n_pattern when absent."""
    key = f"{hp.arch}.attention.sliding_window_pattern"
    pattern = md.get(key)
    if pattern is not None and not isinstance(pattern, (int, np.integer, bool)):
        if len(pattern) > LLAMA_MAX_LAYERS:
            raise InvalidMetadata(f"{key} has {len(pattern)} values (at most {LLAMA_MAX_LAYERS})")
        hp.swa_layers = ([bool(x) for x in pattern] + [False] * hp.n_layer)[:hp.n_layer]
    else:
        hp.set_swa_pattern(md_int(md, key, n_pattern, lo=0))


def _what(v) -> str:
    if isinstance(v, (list, np.ndarray)):
        return f"an array of {len(v)}"
    return f"a {type(v).__name__} ({str(v)[:40]!r})"


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
    # M-RoPE (qwen2-VL): 4 positions a token (t, h, w, e rows), the rotated pairs split among them by sections
    n_pos_per_embd: int = 1
    rope_sections: tuple = (0, 0, 0, 0)
    # attention
    f_attention_scale: float = 0.0
    n_swa: int = 0
    swa_layers: list = field(default_factory=list)   # bool per layer
    swa_chunked: bool = False   # llama 4: the SWA layers attend within fixed chunks of n_swa positions
    attn_soft_cap: float = 0.0
    final_logit_softcap: float = 0.0
    # MoE
    n_expert: int = 0
    n_expert_used: int = 0
    n_ff_exp: int = 0
    n_ff_shexp: int = 0          # the shared expert's width (qwen2moe, granitemoe shared)
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
    # RWKV: head size of the wkv state, rows of token shift per layer (time mix, channel mix), low-rank sizes
    wkv_head_size: int = 0
    token_shift_count: int = 2
    time_mix_extra_dim: int = 0
    time_decay_extra_dim: int = 0
    rescale_every_n_layers: int = 0
    n_lora_decay: int = 0
    n_lora_iclr: int = 0
    n_lora_value_res_mix: int = 0
    n_lora_gate: int = 0
    # LFM2: the short convolution's width (shortconv.l_cache)
    n_shortconv_l_cache: int = 0
    # layers that keep K and V (bool per layer); empty: the layers that are not recurrent. Falcon-H1's layers run
    # attention and a Mamba-2 mixer side by side, so they are in both memories
    kv_layers: list = field(default_factory=list)
    # MLA (deepseek2): the cache keeps K alone, V being the first n_embd_head_v values of each K row; the roped
    # part of a K row starts at k_rope_offset (K-shift turns only that part)
    v_in_k: bool = False
    k_rope_offset: int = 0
    # layers that keep no K and V of their own but attend over another layer's (gemma3n: llama.cpp's reuse
    # callback): per layer, the layer whose cache it reads, or -1; empty: every layer its own
    kv_reuse: list = field(default_factory=list)

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

    def has_kv(self, il: int) -> bool:
        return self.kv_layers[il] if self.kv_layers else not self.is_recurrent(il)

    def kv_source(self, il: int) -> int:
        """The layer whose K/V cache layer il attends over: its own unless it reuses another's."""
        src = self.kv_reuse[il] if self.kv_reuse else -1
        return il if src < 0 else src

    def n_embd_r(self) -> int:
        """Floats of a recurrent layer's rolling row per sequence: the convolution's last d_conv - 1 inputs (RWKV:
        the previous token's normed inputs of time mix and channel mix)."""
        if self.wkv_head_size:
            return self.token_shift_count * self.n_embd
        if self.n_shortconv_l_cache:
            return self.n_embd * (self.n_shortconv_l_cache - 1)
        return max(self.ssm_d_conv - 1, 0) * (self.ssm_d_inner + 2 * self.ssm_n_group * self.ssm_d_state)

    def n_embd_s(self) -> int:
        """Floats of a recurrent layer's state per sequence."""
        if self.wkv_head_size:
            return self.n_embd * self.wkv_head_size
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

    def get_int(self, k: str, default=None, required: bool = False, lo: int | None = None, hi: int | None = None):
        if required and not self.has(k):
            raise MissingMetadata(f"missing metadata key {self.key(k)!r}")
        return md_int(self.md, self.key(k), default, lo, hi)

    def get_float(self, k: str, default=None, positive: bool = False, nonneg: bool = False):
        return md_float(self.md, self.key(k), default, positive, nonneg)

    def get_per_layer(self, k: str, n_layer: int, default=None, required: bool = False, lo: int = 0,
                      hi: int | None = None) -> list:
        """One integer per layer: an array of n_layer, or one value for all (llama.cpp's get_key_or_arr)."""
        v = self.get(k, default, required)
        key = self.key(k)
        if key not in self.md:
            return [v] * n_layer
        if isinstance(v, (list, np.ndarray)):
            if len(v) != n_layer:
                raise InvalidMetadata(f"{key} has {len(v)} values for {n_layer} layers")
            arr = np.asarray(v) if isinstance(v, np.ndarray) else None
            if arr is None or arr.dtype.kind not in "iu":
                raise InvalidMetadata(f"{key} must be integers, not {_what(v)} of {type(v[0]).__name__}"
                                      if len(v) else f"{key} must be integers")
            vals = [int(x) for x in arr]
            bad = [x for x in vals if x < lo or (hi is not None and x > hi)]
            if bad:
                raise InvalidMetadata(f"{key} holds {bad[0]}; each value must be "
                                      f"{f'at least {lo}' if hi is None else f'in {lo}..{hi}'}")
            return vals
        return [md_int(self.md, key, None, lo, hi)] * n_layer


def load_hparams(md: dict, module=None, tensors=None) -> HParams:
    """The hyper-parameters of ``md`` with llama.cpp's defaults, then the architecture ``module``'s own
    (``module.load_hparams``), then checked (check_hparams; against ``tensors``, the file's tensor names, when
    given). Each problem is one MissingMetadata/InvalidMetadata naming its key."""
    arch = md.get("general.architecture")
    if not isinstance(arch, str):
        raise MissingMetadata("missing metadata key 'general.architecture'")
    m = Meta(md, arch)
    hp = HParams(arch=arch, name=str(md.get("general.name", "")))
    hp.n_ctx_train = m.get_int("context_length", required=True, lo=0)
    hp.n_embd = m.get_int("embedding_length", required=True, lo=1)
    # before any per-layer list is made: a count read from the file sizes them (2^32 - 1 layers: a MemoryError)
    hp.n_layer = m.get_int("block_count", required=True, lo=1, hi=LLAMA_MAX_LAYERS)
    if tensors is not None:
        check_layers(hp, tensors)
    hp.n_ff_arr = m.get_per_layer("feed_forward_length", hp.n_layer, 0)
    # 0 for a recurrent layer (check_hparams holds the others to at least 1)
    hp.n_head_arr = m.get_per_layer("attention.head_count", hp.n_layer, required=True, lo=0)
    hp.n_head_kv_arr = m.get_per_layer("attention.head_count_kv", hp.n_layer, None, lo=0)
    if hp.n_head_kv_arr[0] is None:
        hp.n_head_kv_arr = list(hp.n_head_arr)
    head = hp.n_embd // hp.n_head() if hp.n_head() else 0
    hp.n_embd_head_k = m.get_int("attention.key_length", head, lo=1)
    hp.n_embd_head_v = m.get_int("attention.value_length", head, lo=1)
    hp.n_rot = m.get_int("rope.dimension_count", hp.n_embd_head_k, lo=0)
    hp.f_norm_eps = m.get_float("attention.layer_norm_epsilon", 1e-5, positive=True)
    hp.f_norm_rms_eps = m.get_float("attention.layer_norm_rms_epsilon", 1e-5, positive=True)
    tokens = md.get("tokenizer.ggml.tokens")
    hp.n_vocab = m.get_int("vocab_size", len(tokens) if isinstance(tokens, (list, np.ndarray)) else 0, lo=0,
                           hi=(1 << 31) - 1)

    # rope
    hp.rope_freq_base = m.get_float("rope.freq_base", 10000.0, positive=True)
    hp.rope_scaling_type = m.get("rope.scaling.type", "linear")
    if hp.rope_scaling_type not in ROPE_SCALING_TYPES:
        raise InvalidMetadata(f"metadata {m.key('rope.scaling.type')!r} is {str(hp.rope_scaling_type)[:40]!r}; "
                              f"llampy knows {', '.join(ROPE_SCALING_TYPES)}")
    factor = m.get_float("rope.scaling.factor", m.get_float("rope.scale_linear", 0.0, nonneg=True), nonneg=True)
    hp.rope_freq_scale = 1.0 if factor == 0.0 else 1.0 / factor
    if hp.rope_scaling_type == "none":
        hp.rope_freq_scale = 1.0
    hp.n_ctx_orig_yarn = m.get_int("rope.scaling.original_context_length", hp.n_ctx_train, lo=0)
    hp.rope_attn_factor = m.get_float("rope.scaling.attn_factor", 1.0, positive=True)
    if hp.rope_scaling_type == "yarn":
        hp.yarn_ext_factor = 1.0
        hp.yarn_attn_factor = yarn_attn_factor(hp.rope_freq_scale, hp.rope_attn_factor)
    else:
        hp.yarn_attn_factor *= hp.rope_attn_factor
    hp.rope_freq_base_swa = m.get_float("rope.freq_base_swa", 10000.0, positive=True)

    # MoE
    hp.n_expert = m.get_int("expert_count", 0, lo=0, hi=LLAMA_MAX_EXPERTS)
    hp.n_expert_used = m.get_int("expert_used_count", 0, lo=0)
    hp.n_ff_exp = m.get_int("expert_feed_forward_length", 0, lo=0)
    if hp.n_expert and not 0 < hp.n_expert_used <= hp.n_expert:
        raise InvalidMetadata(f"{arch}.expert_used_count must be in 1..{hp.n_expert}")
    if module is not None:
        try:
            module.load_hparams(hp, md)
        except MissingMetadata:
            raise
        except (ValueError, TypeError, OverflowError, ZeroDivisionError) as e:
            raise InvalidMetadata(f"{arch}: {e}") from None
    check_hparams(hp)
    return hp


def check_layers(hp: HParams, tensors) -> None:
    """block_count against the layers the file has tensors for (blk.0 .. blk.N-1), before anything is sized by it."""
    present = {int(mt.group(1)) for name in tensors if (mt := _BLK.match(name))}
    n = max(present) + 1 if present else 0
    if n != hp.n_layer:
        raise InvalidMetadata(f"{hp.arch}.block_count is {hp.n_layer} but the file has tensors for {n} layers "
                              f"(blk.0 .. blk.{n - 1})" if n else
                              f"{hp.arch}.block_count is {hp.n_layer} but the file has no layer tensors (blk.*)")


def check_hparams(hp: HParams) -> None:
    """What the graph needs of the hyper-parameters, whatever the architecture set (llama.cpp asserts most of
    these while it builds the graph; here they fail at load, one clean error each)."""
    a = hp.arch
    for il in range(hp.n_layer):
        if not hp.has_kv(il):
            continue
        if hp.n_head(il) < 1 or hp.n_head_kv(il) < 1:
            raise InvalidMetadata(f"{a}.attention.head_count and head_count_kv must be at least 1 in layer {il}, "
                                  f"not {hp.n_head(il)} and {hp.n_head_kv(il)}")
        if hp.n_head_kv(il) > hp.n_head(il) or hp.n_head(il) % hp.n_head_kv(il):
            raise InvalidMetadata(f"{a}.attention.head_count ({hp.n_head(il)}) is not a multiple of "
                                  f"{a}.attention.head_count_kv ({hp.n_head_kv(il)}) in layer {il}")
    attention = any(hp.has_kv(il) for il in range(hp.n_layer))
    if attention and (hp.n_rot % 2 or not 0 < hp.n_rot <= hp.n_embd_head_k):
        raise InvalidMetadata(f"{a}.rope.dimension_count is {hp.n_rot}: RoPE turns pairs of a head's "
                              f"{hp.n_embd_head_k} dimensions, so it must be even and in 2..{hp.n_embd_head_k}")
    for name in ("rope_freq_scale", "rope_freq_scale_swa", "rope_freq_base_swa", "yarn_attn_factor",
                 "yarn_beta_fast", "yarn_beta_slow", "f_attention_scale", "attn_soft_cap", "final_logit_softcap",
                 "f_embedding_scale", "f_residual_scale", "f_logit_scale", "f_norm_eps", "f_norm_rms_eps"):
        v = getattr(hp, name)
        if not math.isfinite(v) or v < 0 or (name in ("rope_freq_scale", "rope_freq_scale_swa",
                                                        "rope_freq_base_swa", "f_norm_eps", "f_norm_rms_eps",
                                                        "yarn_beta_fast", "yarn_beta_slow")   # YaRN divides by them
                                             and v == 0):
            raise InvalidMetadata(f"{a}: hyper-parameter {name} is {v}")
    if hp.n_swa < 0:
        raise InvalidMetadata(f"{a}.attention.sliding_window is {hp.n_swa}; it must be at least 0")
