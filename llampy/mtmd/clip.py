"""A projector GGUF (``--mmproj``): the vision encoder's hyper-parameters (``clip.*``) and weights (``v.*`` encoder,
``mm.*`` projector), placed on a backend like a model's (llama.cpp's clip_model_loader).

The projector is a file of its own, read beside the language model; ``check_text_model`` holds it to that model's
width at load, with llama.cpp's message. Only the projector types llampy builds graphs for load; any other type
is an error that names it.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace

from ..ggml.backend import BufferUsage, backend_init, tensor_alloc
from ..ggml.tensor import Flags, Tensor
from ..ggml.types import GGMLType
from ..gguf.reader import GGUFError
from ..gguf.split import open_gguf
from ..llama.hparams import InvalidMetadata, md_float, md_int

# projector types by their clip.projector_type string, in the order llampy supports them; the others llama.cpp
# knows are named in the error (clip-impl.h's PROJECTOR_TYPE_NAMES)
SUPPORTED = ("gemma3", "idefics3", "qwen2vl_merger", "qwen2.5vl_merger")
KNOWN_UNSUPPORTED = ("mlp", "ldp", "ldpv2", "resampler", "glm_edge",
                     "qwen3vl_merger", "gemma3nv", "gemma4v", "ultravox", "internvl", "llama4", "pixtral", "qwen2a",
                     "qwen2.5o", "voxtral", "lfm2", "kimivl", "lightonocr", "cogvlm", "janus_pro", "phi4",
                     "minicpmv", "glm4v", "whisper")

NOT_WEIGHTS = frozenset({GGMLType.I8, GGMLType.I16, GGMLType.I32, GGMLType.I64, GGMLType.F64})


class ProjectorError(ValueError):
    """The projector file cannot be used: unreadable, malformed, of an unsupported type, or for another model."""


@dataclass
class ClipHParams:
    proj_type: str = ""
    n_embd: int = 0              # the encoder's width
    n_ff: int = 0
    n_head: int = 0
    n_layer: int = 0
    eps: float = 1e-6
    image_size: int = 0
    patch_size: int = 0
    projection_dim: int = 0
    n_merge: int = 1             # gemma3's pooling kernel, idefics3's pixel-shuffle factor
    ffn_op: str = "gelu_quick"   # clip.use_gelu / clip.use_silu, else GELU_QUICK (llama.cpp's default)
    image_mean: list = field(default_factory=lambda: [0.0, 0.0, 0.0])
    image_std: list = field(default_factory=lambda: [1.0, 1.0, 1.0])
    resize_algo: str = "bilinear"
    resize_pad: str = "ceil"     # letterbox (PAD_CEIL) with pad_color, or "none": stretch
    pad_color: tuple = (0, 0, 0)
    preproc_image_size: int = 0  # idefics3: the longest edge before slicing
    min_pixels: int = 0          # qwen2-VL: the range the image's area is resized into (llama.cpp's token limits)
    max_pixels: int = 0
    norm: str = "layer"          # the blocks' norms: LayerNorm, or RMS (qwen2.5-VL)
    n_wa_pattern: int = 0        # qwen2.5-VL: every n-th block attends fully, the others within windows
    attn_window: int = 0         # the windows' side in pixels

    @property
    def d_head(self) -> int:
        return self.n_embd // self.n_head

    @property
    def n_patches_side(self) -> int:
        return self.image_size // self.patch_size


def _load_hparams(md: dict) -> ClipHParams:
    hp = ClipHParams()
    pt = md.get("clip.projector_type", md.get("clip.vision.projector_type", ""))
    if not isinstance(pt, str) or not pt:
        raise ProjectorError("not a projector file: metadata 'clip.projector_type' is missing")
    if pt not in SUPPORTED:
        known = "a type llampy does not support yet" if pt in KNOWN_UNSUPPORTED else "an unknown type"
        raise ProjectorError(f"unknown projector type: {pt} ({known}; supported: {', '.join(SUPPORTED)})")
    if not md.get("clip.has_vision_encoder", True):
        raise ProjectorError("the projector has no vision encoder (clip.has_vision_encoder is false)")
    hp.proj_type = pt
    v = "clip.vision"
    hp.n_embd = md_int(md, f"{v}.embedding_length", lo=1)
    hp.n_ff = md_int(md, f"{v}.feed_forward_length", lo=1)
    hp.n_head = md_int(md, f"{v}.attention.head_count", lo=1)
    hp.n_layer = md_int(md, f"{v}.block_count", lo=0, hi=1024)
    hp.projection_dim = md_int(md, f"{v}.projection_dim", 0, lo=0)
    hp.eps = md_float(md, f"{v}.attention.layer_norm_epsilon", positive=True)
    hp.image_size = md_int(md, f"{v}.image_size", lo=1, hi=1 << 15)
    hp.patch_size = md_int(md, f"{v}.patch_size", lo=1, hi=1 << 12)
    for key, name in ((f"{v}.embedding_length", "n_embd"), (f"{v}.feed_forward_length", "n_ff"),
                      (f"{v}.attention.head_count", "n_head"), (f"{v}.block_count", "n_layer"),
                      (f"{v}.attention.layer_norm_epsilon", "eps"), (f"{v}.image_size", "image_size"),
                      (f"{v}.patch_size", "patch_size")):
        if getattr(hp, name) is None:
            raise ProjectorError(f"projector metadata {key!r} is missing")
    if hp.n_embd % hp.n_head:
        raise ProjectorError(f"the encoder's width {hp.n_embd} is not a multiple of its {hp.n_head} heads")
    if md.get("clip.use_gelu") and md.get("clip.use_silu"):
        raise ProjectorError("both clip.use_gelu and clip.use_silu are set to true")
    hp.ffn_op = "gelu" if md.get("clip.use_gelu") else "silu" if md.get("clip.use_silu") else "gelu_quick"
    for key, name in ((f"{v}.image_mean", "image_mean"), (f"{v}.image_std", "image_std")):
        arr = md.get(key)
        if arr is None or len(arr) < 3:
            raise ProjectorError(f"projector metadata {key!r} must hold 3 values")
        vals = [float(x) for x in list(arr)[:3]]
        if name == "image_std" and any(s == 0 for s in vals):
            raise ProjectorError(f"projector metadata {key!r} holds a zero")
        setattr(hp, name, vals)
    if pt == "gemma3":
        hp.n_merge = md_int(md, f"{v}.projector.scale_factor", 4, lo=1)   # every Gemma 3 size pools by 4
        hp.resize_algo = "bilinear"
        side = hp.n_patches_side
        if side % hp.n_merge:
            raise ProjectorError(f"gemma3: {side} patches a side do not pool by {hp.n_merge}")
    elif pt in ("qwen2vl_merger", "qwen2.5vl_merger"):
        hp.n_merge = md_int(md, f"{v}.spatial_merge_size", 2, lo=1, hi=64)
        if hp.n_merge != 2:      # the graph merges 2x2 patches whatever the key says (clip_graph_qwen2vl)
            raise ProjectorError(f"{pt}: spatial_merge_size {hp.n_merge} (only 2 is built)")
        if pt == "qwen2.5vl_merger":
            hp.norm = "rms"
            hp.n_wa_pattern = md_int(md, f"{v}.n_wa_pattern", lo=1)
            if hp.n_wa_pattern is None:
                raise ProjectorError(f"qwen2.5vl_merger: projector metadata '{v}.n_wa_pattern' is missing")
            hp.attn_window = 112      # llama.cpp reads no window size for qwen2.5-VL: its default, 112 px
        hp.resize_algo, hp.resize_pad = "bicubic", "ceil"
        if hp.d_head % 4:
            raise ProjectorError(f"{pt}: head size {hp.d_head} does not split into the 2-D rope's 4 "
                                 f"sections")
        area = hp.patch_size ** 2 * hp.n_merge ** 2              # set_limit_image_tokens(8, 4096)
        hp.min_pixels, hp.max_pixels = 8 * area, 4096 * area
    elif pt == "idefics3":
        # llama.cpp leaves n_merge at 1 without the key and then aborts in the pixel shuffle: an error here
        hp.n_merge = md_int(md, f"{v}.projector.scale_factor", lo=2)
        if hp.n_merge is None:
            raise ProjectorError(f"idefics3: projector metadata '{v}.projector.scale_factor' is missing")
        hp.resize_algo, hp.resize_pad = "lanczos", "none"
        hp.preproc_image_size = md_int(md, f"{v}.preproc_image_size", 0, lo=0, hi=1 << 15)
        side = hp.n_patches_side
        if side % hp.n_merge or hp.image_size % hp.patch_size:
            raise ProjectorError(f"idefics3: tiles of {hp.image_size} px in patches of {hp.patch_size} do not "
                                 f"shuffle by {hp.n_merge}")
    return hp


class Projector:
    """The loaded projector: ``hparams``, weights by GGUF name (``tensors``), per-block weights (``layers``)."""

    def __init__(self, path, n_threads: int | None = None, backend=None):
        self.path = Path(path)
        if not self.path.is_file():
            raise ProjectorError(f"projector file not found: {self.path}")
        try:
            self.reader = open_gguf(self.path)
        except (GGUFError, OSError, ValueError) as e:
            raise ProjectorError(f"cannot read the projector {self.path.name}: {e}") from None
        md = self.reader.metadata
        try:
            self.hparams = _load_hparams(md)
        except InvalidMetadata as e:
            raise ProjectorError(f"projector {self.path.name}: {e}") from None
        # the encoder's backend (an accelerator when given: llama.cpp's mmproj offload) and the CPU, which runs what
        # the accelerator does not and holds the weights of a type it cannot read
        self.cpu = backend_init("cpu", n_threads=n_threads)
        self.backend = backend or self.cpu
        self.tensors: dict[str, Tensor] = {}
        self._load_tensors()

    # ------------------------------------------------------------------ weights
    def _get(self, name: str, ne=None, required: bool = True) -> Tensor | None:
        info = self.reader.tensors.get(name)
        if info is None:
            if required:
                raise ProjectorError(f"projector {self.path.name}: missing tensor {name!r}")
            return None
        if ne is not None:         # None in ne: any size there
            got = tuple(info.ne) + (1,) * (len(ne) - len(info.ne))
            want = tuple(got[i] if n is None else int(n) for i, n in enumerate(ne))
            if got[:len(want)] != want or any(n != 1 for n in got[len(want):]):
                raise ProjectorError(f"projector tensor {name!r} has shape {list(info.ne)}, expected {list(want)}")
        if GGMLType(info.type) in NOT_WEIGHTS:
            raise ProjectorError(f"projector tensor {name!r} has type {GGMLType(info.type).name}")
        t = Tensor(GGMLType(info.type), info.ne, name=name)
        t.flags |= Flags.WEIGHT
        be = self.backend
        if be is not self.cpu and not getattr(be, "supports_weight", lambda _t: True)(GGMLType(info.type)):
            be = self.cpu
        buft = be.get_default_buffer_type()
        tensor_alloc(buft.buffer_from_host(info.data, BufferUsage.WEIGHTS), t, 0)
        self.tensors[name] = t
        return t

    def _load_tensors(self) -> None:
        hp = self.hparams
        e, f, p = hp.n_embd, hp.n_ff, hp.patch_size
        self.patch_embd = self._get("v.patch_embd.weight", (p, p, 3, e))
        self.patch_bias = self._get("v.patch_embd.bias", (e,), required=False)
        qwen = hp.proj_type in ("qwen2vl_merger", "qwen2.5vl_merger")
        n_pos = hp.n_patches_side ** 2
        # qwen2-VL: a second patch kernel (the video's second frame, added for a still image), no learned positions
        self.patch_embd_1 = self._get("v.patch_embd.weight.1", (p, p, 3, e)) if qwen else None
        self.pos_embd = None if qwen else self._get("v.position_embd.weight", (e, n_pos))
        self.pre_ln_w = self._get("v.pre_ln.weight", (e,), required=False)
        self.pre_ln_b = self._get("v.pre_ln.bias", (e,), required=False)
        self.post_ln_w = self._get("v.post_ln.weight", (e,), required=False)
        self.post_ln_b = self._get("v.post_ln.bias", (e,), required=False)
        self.layers = []
        for il in range(hp.n_layer):
            b = f"v.blk.{il}"
            L = SimpleNamespace()
            for short, gname, shape in (("q", "attn_q", (e, e)), ("k", "attn_k", (e, e)), ("v", "attn_v", (e, e)),
                                        ("o", "attn_out", (e, e))):
                setattr(L, f"{short}_w", self._get(f"{b}.{gname}.weight", shape))
                setattr(L, f"{short}_b", self._get(f"{b}.{gname}.bias", (e,), required=False))
            L.ln_1_w, L.ln_1_b = self._get(f"{b}.ln1.weight", (e,)), self._get(f"{b}.ln1.bias", (e,), False)
            L.ln_2_w, L.ln_2_b = self._get(f"{b}.ln2.weight", (e,)), self._get(f"{b}.ln2.bias", (e,), False)
            up = self._get(f"{b}.ffn_up.weight")
            down = self._get(f"{b}.ffn_down.weight")
            up_b = self._get(f"{b}.ffn_up.bias", required=False)
            down_b = self._get(f"{b}.ffn_down.bias", required=False)
            # files from older converters hold up and down under each other's names; llama.cpp swaps them back
            # when ffn_down reads the encoder's width (a file with n_ff == n_embd is therefore ambiguous)
            if down.ne[0] == e:
                up, down, up_b, down_b = down, up, down_b, up_b
            if up.ne[:2] != (e, f) or down.ne[:2] != (f, e):
                raise ProjectorError(f"projector block {il}: ffn_up {list(up.ne[:2])} and ffn_down "
                                     f"{list(down.ne[:2])} do not match width {e} and feed-forward {f}")
            L.ff_up_w, L.ff_up_b, L.ff_down_w, L.ff_down_b = up, up_b, down, down_b
            L.ff_gate_w = self._get(f"{b}.ffn_gate.weight", (e, f), required=False)
            L.ff_gate_b = self._get(f"{b}.ffn_gate.bias", (f,), required=False)
            self.layers.append(L)
        if hp.proj_type == "gemma3":
            self.mm_input_proj_w = self._get("mm.input_projection.weight")
            self.mm_soft_emb_norm_w = self._get("mm.soft_emb_norm.weight", (e,))
            if self.mm_input_proj_w.ne[1] != e or self.mm_input_proj_w.n_dims > 2:
                raise ProjectorError(f"projector tensor 'mm.input_projection.weight' has shape "
                                     f"{list(self.mm_input_proj_w.ne[:2])}: its second dimension must be {e}")
        elif hp.proj_type in ("qwen2vl_merger", "qwen2.5vl_merger"):
            # the merger: 2x2 neighbouring patches concatenated, an MLP with GELU
            self.mm_0_w = self._get("mm.0.weight", (4 * e, None))
            self.mm_0_b = self._get("mm.0.bias", (self.mm_0_w.ne[1],))
            self.mm_1_w = self._get("mm.2.weight", (self.mm_0_w.ne[1], None))
            self.mm_1_b = self._get("mm.2.bias", (self.mm_1_w.ne[1],))
        elif hp.proj_type == "idefics3":
            self.mm_fc_w = self._get("mm.model.fc.weight")
            if self.mm_fc_w.ne[0] != e * hp.n_merge ** 2:
                raise ProjectorError(f"projector tensor 'mm.model.fc.weight' reads {self.mm_fc_w.ne[0]} values, "
                                     f"not {e * hp.n_merge ** 2} (width x scale factor^2)")

    # ------------------------------------------------------------------ facts
    @property
    def n_mmproj_embd(self) -> int:
        """The width of the embeddings the projector gives the language model (clip_n_mmproj_embd)."""
        if self.hparams.proj_type == "gemma3":
            return self.mm_input_proj_w.ne[0]
        if self.hparams.proj_type in ("qwen2vl_merger", "qwen2.5vl_merger"):
            return self.mm_1_b.ne[0]
        return self.mm_fc_w.ne[1]

    def check_text_model(self, n_embd_text: int) -> None:
        """The language model must take embeddings of the projector's width (mtmd_context's check, its words)."""
        if n_embd_text != self.n_mmproj_embd:
            raise ProjectorError(f"mismatch between text model (n_embd = {n_embd_text}) and mmproj (n_embd = "
                                 f"{self.n_mmproj_embd}); hint: you may be using wrong mmproj")

    def n_image_tokens(self, width: int, height: int) -> int:
        """The embeddings one preprocessed image of this size becomes."""
        hp = self.hparams
        n = (width // hp.patch_size) * (height // hp.patch_size)
        return n // (hp.n_merge * hp.n_merge)

    def close(self) -> None:
        self.reader.close()
