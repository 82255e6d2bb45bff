"""The vision encoder's graph (llama.cpp's clip_graph: build_inp, build_vit, then the projector's tail) and its run.

An image is its own graph, apart from the language model's, placed by the same scheduler over the projector's
backends. Graphs are kept per image size (one for gemma3, whose images are all image_size square).
"""
from __future__ import annotations


import numpy as np

from ..ggml import ops
from ..ggml.backend import tensor_get, tensor_set
from ..ggml.graph import Graph
from ..ggml.sched import Scheduler
from ..ggml.tensor import Tensor
from ..ggml.types import GGMLType

F32, F16 = GGMLType.F32, GGMLType.F16


def _norm(cur: Tensor, w: Tensor | None, b: Tensor | None, eps: float) -> Tensor:
    cur = ops.norm(cur, eps)
    if w is not None:
        cur = ops.mul(cur, w)
    if b is not None:
        cur = ops.add(cur, b)
    return cur


def _mm(w: Tensor, cur: Tensor, b: Tensor | None = None) -> Tensor:
    cur = ops.mul_mat(w, cur)
    return ops.add(cur, b) if b is not None else cur


def _rms(cur: Tensor, w: Tensor | None, b: Tensor | None, eps: float) -> Tensor:
    cur = ops.rms_norm(cur, eps)
    if w is not None:
        cur = ops.mul(cur, w)
    if b is not None:
        cur = ops.add(cur, b)
    return cur


def _cb(t: Tensor, name: str, il: int = -1) -> Tensor:
    """Name an intermediate as clip.cpp's cb does (the names its eval callback shows)."""
    t.name = f"{name}-{il}" if il >= 0 else name
    return t


_ACT = {"gelu": ops.gelu, "silu": ops.silu, "gelu_quick": ops.gelu_quick}


class EncoderGraph:
    """One image size's graph: ``inp_raw`` F32 [W, H, 3, 1] in, ``out`` [n_mmproj_embd, n_tokens] out."""

    def __init__(self, proj, width: int, height: int):
        self.proj = proj
        hp = proj.hparams
        self.width, self.height = width, height
        self.n_px, self.n_py = width // hp.patch_size, height // hp.patch_size
        self.graph = Graph()
        self.inp_raw = Tensor(F32, (width, height, 3, 1), name="inp_raw").set_input()
        self.positions = self.window_idx = self.inv_window_idx = self.window_mask = None
        if hp.proj_type in ("qwen2vl_merger", "qwen2.5vl_merger"):
            n_pos = self.n_px * self.n_py
            self.positions = Tensor(GGMLType.I32, (4 * n_pos,), name="positions").set_input()
            if hp.n_wa_pattern > 0:         # qwen2.5-VL's windows: the merged tokens regrouped window by window
                self.window_idx = Tensor(GGMLType.I32, (n_pos // 4,), name="window_idx").set_input()
                self.inv_window_idx = Tensor(GGMLType.I32, (n_pos // 4,), name="inv_window_idx").set_input()
                self.window_mask = Tensor(F32, (n_pos, n_pos), name="window_mask").set_input()
            cur = self._qwen2vl_tail(self._build_vit(self._qwen2vl_inp()))
        elif hp.proj_type == "gemma3":
            cur = self._gemma3_tail(self._build_vit(self._build_inp()))
        else:
            cur = self._idefics3_tail(self._build_vit(self._build_inp()))
        cur.name = "mmproj_out"
        self.out = cur.set_output()
        self.graph.expand(self.out)

    # inp_raw -> [n_embd, n_patches]: the patch convolution (ggml_conv_2d: im2col to F16, a product), transposed
    def _build_inp(self) -> Tensor:
        p = self.proj
        ps = p.hparams.patch_size
        cur = ops.conv_2d(p.patch_embd, self.inp_raw, ps, ps, 0, 0, 1, 1)         # [n_px, n_py, n_embd, 1]
        cur = ops.reshape(cur, self.n_px * self.n_py, p.hparams.n_embd, 1)
        cur = ops.cont(ops.transpose(cur))
        if p.patch_bias is not None:
            cur = _cb(ops.add(cur, p.patch_bias), "patch_bias")
        return cur

    # [n_embd, n_pos] -> [n_embd, n_pos]: learned positions, pre-norm blocks with non-causal attention, post-norm
    def _build_vit(self, cur: Tensor) -> Tensor:
        p, hp = self.proj, self.proj.hparams
        n_pos, n_head, d_head = cur.ne[1], hp.n_head, hp.d_head
        if p.pos_embd is not None:
            cur = _cb(ops.add(cur, p.pos_embd), "pos_embed")
        norm = _rms if hp.norm == "rms" else _norm
        if p.pre_ln_w is not None:
            cur = norm(cur, p.pre_ln_w, p.pre_ln_b, hp.eps)
        mask16 = None
        if self.window_mask is not None:    # the tokens in window order (groups of 4 patches move together)
            cur = ops.get_rows(ops.reshape(cur, hp.n_embd * 4, n_pos // 4), self.inv_window_idx)
            cur = ops.reshape(cur, hp.n_embd, n_pos, 1)
            mask16 = ops.cast(self.window_mask, F16)
        inpL = cur
        # clip.cpp's 1.0f / sqrtf(d_head), in float32: one ulp off the double's rounding at head sizes 72 (SigLIP's)
        # and 96, which changes every score
        kq_scale = float(np.float32(1.0) / np.sqrt(np.float32(d_head)))
        act = _ACT[hp.ffn_op]
        for il, L in enumerate(p.layers):
            # qwen2.5-VL: every n_wa_pattern-th block attends to all patches, the others within their window
            mask = None if mask16 is None or (il + 1) % hp.n_wa_pattern == 0 else mask16
            cur = _cb(norm(inpL, L.ln_1_w, L.ln_1_b, hp.eps), "layer_inp_normed", il)
            q = ops.reshape(_cb(_mm(L.q_w, cur, L.q_b), "Qcur", il), d_head, n_head, n_pos)
            k = ops.reshape(_cb(_mm(L.k_w, cur, L.k_b), "Kcur", il), d_head, n_head, n_pos)
            v = ops.reshape(_cb(_mm(L.v_w, cur, L.v_b), "Vcur", il), d_head, n_head, n_pos)
            if self.positions is not None:      # qwen2-VL: the 2-D rope (rows y, x, y, x), theta 10000
                sect = (d_head // 4,) * 4
                q = _cb(ops.rope_multi(q, self.positions, None, d_head // 2, sect, ops.ROPE_TYPE_VISION, 32768,
                                       10000.0, 1.0, 0.0, 1.0, 32.0, 1.0), "Qcur_rope", il)
                k = _cb(ops.rope_multi(k, self.positions, None, d_head // 2, sect, ops.ROPE_TYPE_VISION, 32768,
                                       10000.0, 1.0, 0.0, 1.0, 32.0, 1.0), "Kcur_rope", il)
            # clip's flash-attention path (chosen on the CPU): K and V cast to F16, no mask
            qp = ops.permute(q, 0, 2, 1, 3)
            kp = ops.cast(ops.permute(k, 0, 2, 1, 3), F16)
            vp = ops.cast(ops.permute(v, 0, 2, 1, 3), F16)
            cur = _cb(ops.flash_attn_ext(qp, kp, vp, mask, kq_scale), "kqv_out", il)   # [d_head, n_head, n_pos]
            cur = ops.reshape(cur, d_head * n_head, n_pos)
            cur = _cb(_mm(L.o_w, cur, L.o_b), "attn_out", il)
            cur = _cb(ops.add(cur, inpL), "ffn_inp", il)
            inpL = cur
            cur = _cb(norm(cur, L.ln_2_w, L.ln_2_b, hp.eps), "ffn_inp_normed", il)
            up = _mm(L.ff_up_w, cur, L.ff_up_b)
            if L.ff_gate_w is not None:     # gated (qwen2.5-VL): act(gate) * up, the fused GLU ops
                gate = _mm(L.ff_gate_w, cur, L.ff_gate_b)
                glu = {"silu": ops.swiglu, "gelu": ops.geglu}.get(hp.ffn_op)
                if glu is None:
                    raise ValueError(f"a gated encoder FFN with {hp.ffn_op} is not built")
                hidden = glu(gate, up)
            else:
                hidden = act(up)
            cur = _cb(_mm(L.ff_down_w, hidden, L.ff_down_b), "ffn_out", il)
            inpL = _cb(ops.add(inpL, cur), "layer_out", il)
        if p.post_ln_w is not None:
            inpL = norm(inpL, p.post_ln_w, p.post_ln_b, hp.eps)
        return inpL

    # qwen2-VL: two patch kernels added; the patches reordered so that each 2x2 block of neighbours is consecutive
    # (the merger concatenates them) -> [n_embd, n_patches]
    def _qwen2vl_inp(self) -> Tensor:
        p, hp = self.proj, self.proj.hparams
        ps, e = hp.patch_size, hp.n_embd
        w, h = self.n_px, self.n_py
        cur = ops.add(ops.conv_2d(p.patch_embd, self.inp_raw, ps, ps, 0, 0, 1, 1),
                      ops.conv_2d(p.patch_embd_1, self.inp_raw, ps, ps, 0, 0, 1, 1))    # [w, h, e, 1]
        cur = ops.permute(cur, 1, 2, 0, 3)                                         # [e, w, h, 1]
        cur = ops.cont(cur, e * 2, w // 2, h, 1)
        cur = ops.reshape(cur, e * 2, w // 2, 2, h // 2)
        cur = ops.permute(cur, 0, 2, 1, 3)
        return ops.cont(cur, e, w * h, 1)

    def window_inputs(self):
        """qwen2.5-VL's windows (clip.cpp's set_input): idx[token] = its place in window order, inv_idx the inverse,
        and the mask [n_pos, n_pos] letting each patch see the patches of its window (rows in window order)."""
        hp = self.proj.hparams
        pw, ph = self.n_px // 2, self.n_py // 2
        n = self.n_px * self.n_py
        idx = np.arange(pw * ph, dtype=np.int32)
        inv = idx.copy()
        mask = None
        if self.window_mask is not None:
            gw = hp.attn_window // hp.patch_size // 2
            mask = np.full((n, n), -np.inf, np.float32)     # llama.cpp's lowest float, -inf once cast to F16
            dst = row = 0
            for y in range(0, ph, gw):
                for x in range(0, pw, gw):
                    wh, ww = min(gw, ph - y), min(gw, pw - x)
                    d0 = dst
                    for dy in range(wh):
                        for dx in range(ww):
                            src = (y + dy) * pw + (x + dx)
                            idx[src], inv[dst] = dst, src
                            dst += 1
                    for _ in range(wh * ww * 4):
                        mask[row, d0 * 4:dst * 4] = 0.0
                        row += 1
        return idx, inv, mask

    def position_rows(self, idx: np.ndarray | None = None) -> np.ndarray:
        """The encoder's rope positions in the reordered patch order: rows (y, x, y, x) of each 2x2 block's patches
        (block b placed at idx[b] when the blocks are regrouped by window)."""
        n = self.n_px * self.n_py
        out = np.empty((4, n), np.int32)
        i = 0
        for y in range(0, self.n_py, 2):
            for x in range(0, self.n_px, 2):
                for dy in range(2):
                    for dx in range(2):
                        r = i if idx is None else int(idx[i // 4]) * 4 + i % 4
                        out[:, r] = (y + dy, x + dx, y + dy, x + dx)
                        i += 1
        return out.reshape(-1)

    # qwen2-VL's merger: each 4 consecutive patches (a 2x2 block) concatenated, then Linear, GELU, Linear
    def _qwen2vl_tail(self, cur: Tensor) -> Tensor:
        p, hp = self.proj, self.proj.hparams
        cur = ops.reshape(cur, hp.n_embd * 4, cur.ne[1] // 4, 1)
        cur = _mm(p.mm_1_w, ops.gelu(_mm(p.mm_0_w, cur, p.mm_0_b)), p.mm_1_b)
        if self.window_idx is not None:     # back from window order to the image's
            cur = ops.get_rows(ops.reshape(cur, cur.ne[0], cur.ne[1]), self.window_idx)
        return cur

    # gemma3: average pool by n_merge over the patch grid, RMS norm x soft_emb_norm, x input_projection
    def _gemma3_tail(self, cur: Tensor) -> Tensor:
        p, hp = self.proj, self.proj.hparams
        k = hp.n_merge
        side = self.n_px
        cur = ops.cont(ops.transpose(cur), side, side, hp.n_embd, 1)              # [n_px, n_py, n_embd, 1]
        cur = ops.pool_2d(cur, ops.POOL_AVG, k, k, k, k, 0, 0)
        cur = ops.reshape(cur, cur.ne[0] * cur.ne[0], hp.n_embd, 1)
        cur = ops.cont(ops.transpose(cur))                                         # [n_embd, n_tokens]
        cur = ops.mul(ops.rms_norm(cur, hp.eps), p.mm_soft_emb_norm_w)
        return ops.mul_mat(ops.cont(ops.transpose(p.mm_input_proj_w)), cur)

    # idefics3: pixel shuffle (each n_merge x n_merge block of patches into one row), then mm.model.fc
    def _idefics3_tail(self, cur: Tensor) -> Tensor:
        p, hp = self.proj, self.proj.hparams
        s, n_embd = hp.n_merge, hp.n_embd
        w, h = self.n_px, self.n_py
        cur = ops.reshape(cur, n_embd * s, w // s, h)
        cur = ops.permute(cur, 0, 2, 1, 3)
        cur = ops.cont(cur, n_embd * s * s, h // s, w // s)
        cur = ops.permute(cur, 0, 2, 1, 3)
        cur = ops.cont(cur, cur.ne[0], cur.ne[1] * cur.ne[2])
        return ops.mul_mat(p.mm_fc_w, cur)


class Encoder:
    """Runs images through the projector: ``encode(pixels)`` with pixels float32 (H, W, 3), normalised."""

    def __init__(self, proj, backends=None):
        """``backends``: the scheduler's, in priority order; by default the projector's backend, then the CPU
        where that is an accelerator (the ops it lacks fall back there, op by op, as ggml's scheduler does)."""
        self.proj = proj
        if not backends:
            backends = [proj.backend] + ([proj.cpu] if getattr(proj, "cpu", proj.backend) is not proj.backend else [])
        self.sched = Scheduler(list(backends))
        self._graphs: dict[tuple, EncoderGraph] = {}

    def graph_for(self, width: int, height: int) -> EncoderGraph:
        key = (width, height)
        g = self._graphs.get(key)
        if g is None:
            g = self._graphs[key] = EncoderGraph(self.proj, width, height)
        return g

    def encode(self, pixels: np.ndarray) -> np.ndarray:
        """float32 (H, W, 3) -> the image's embeddings, float32 [n_tokens, n_mmproj_embd]."""
        h, w, _ = pixels.shape
        g = self.graph_for(w, h)
        self.sched.alloc_graph(g.graph)
        tensor_set(g.inp_raw, np.ascontiguousarray(pixels.transpose(2, 0, 1), dtype=np.float32)[None])
        if g.positions is not None:
            idx, inv, mask = g.window_inputs()
            tensor_set(g.positions, g.position_rows(idx if mask is not None else None))
            if mask is not None:
                tensor_set(g.window_idx, idx)
                tensor_set(g.inv_window_idx, inv)
                tensor_set(g.window_mask, mask)
        self.sched.graph_compute(g.graph)
        return tensor_get(g.out).reshape(-1, g.out.ne[0]).copy()
