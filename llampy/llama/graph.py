"""Shared graph-building helpers for the architectures (llama.cpp's llm_graph_context): inputs, norm, FFN, MoE
and attention over the KV cache. Architecture files call these and never see a cache cell, a buffer or a backend.
"""
from __future__ import annotations

import numpy as np

from ..ggml import ops
from ..ggml.graph import Graph
from ..ggml.tensor import Tensor
from ..ggml.types import GGMLType

F32, F16, I32, I64 = GGMLType.F32, GGMLType.F16, GGMLType.I32, GGMLType.I64


class GraphContext:
    """One forward graph for a micro-batch shape: ``n_tokens`` new tokens, ``n_outputs`` of them returning logits,
    attention over ``n_kv`` cache cells. Inputs are tensors set before each run (``inputs``)."""

    def __init__(self, model, kv, n_tokens: int, n_outputs: int, n_kv: int, embeddings: bool = False,
                 pooling: str = "none", *, loras=(), embd_input: bool = False):
        self.model = model
        # the micro-batch brings embeddings, not token ids (an image chunk): inp_embd is then an input of rows
        self.embd_input = embd_input
        self.hp = model.hparams
        self.kv = kv
        self.n_tokens = n_tokens
        self.n_outputs = n_outputs
        self.n_kv = n_kv
        self.embeddings = embeddings
        self.pooling = pooling if embeddings else "none"
        self.graph = Graph()
        self.inputs: dict[str, Tensor] = {}
        # inputs an architecture adds, each with the function of the micro-batch that fills it (set_input)
        self.input_fns: dict[str, object] = {}
        self.t_logits: Tensor | None = None
        self.t_embd: Tensor | None = None
        # (LoraAdapter, scale) pairs: every product mm() builds gains their low-rank terms (llama/lora.py)
        self.loras = list(loras)

    # ------------------------------------------------------------------ naming (llama.cpp's cb)
    def cb(self, t: Tensor, name: str, il: int = -1) -> Tensor:
        t.name = f"{name}-{il}" if il >= 0 else name
        return t

    def _input(self, key: str, type, *ne) -> Tensor:
        t = Tensor(type, ne, name=f"inp_{key}").set_input()
        self.inputs[key] = t
        return t

    # ------------------------------------------------------------------ inputs
    # -> [n_embd, n_tokens]
    def inp_embd(self, tok_embd: Tensor) -> Tensor:
        if self.embd_input:
            return self.cb(self._input("embd", F32, tok_embd.ne[0], self.n_tokens), "inp_embd")
        tokens = self.inp_tokens()
        cur = ops.get_rows(tok_embd, tokens)
        for ad, scale in self.loras:      # the embedding's pair is flipped: A's rows are indexed by token
            lw = ad.get(tok_embd)
            if lw is not None:
                delta = ops.mul_mat(lw.b, ops.get_rows(lw.a, tokens))
                cur = ops.add(cur, ops.scale(delta, lw.scale(ad.alpha, scale)))
        return self.cb(cur, "inp_embd")

    # -> I32 [n_tokens]: the micro-batch's token ids, one input however many tables read them (gemma3n's
    # per-layer embeddings beside inp_embd's)
    def inp_tokens(self) -> Tensor:
        return self.inputs["tokens"] if "tokens" in self.inputs else self._input("tokens", I32, self.n_tokens)

    def inp_pos(self) -> Tensor:
        # M-RoPE: four rows of positions (llm_graph_input_pos; a text token's rows are p, p, p, 0)
        return self._input("pos", I32, self.n_tokens * self.hp.n_pos_per_embd)

    def inp_out_ids(self) -> Tensor | None:
        """Rows of the last layer to keep: None when every token is an output (nothing to select)."""
        if self.n_outputs == self.n_tokens:
            return None
        return self._input("out_ids", I32, self.n_outputs)

    def _input_fn(self, key: str, type, ne, fn) -> Tensor:
        """An input filled before each run with ``fn(ubatch)`` (an array of ``ne``, in ggml order)."""
        if key not in self.inputs:
            self._input(key, type, *ne)
            self.input_fns[key] = fn
        return self.inputs[key]

    # -> [1, 1, n_tokens]: llama 4's attention temperature, log(floor((pos + offset) / floor_scale) + 1) * scale + 1
    def inp_attn_scale(self, f_scale: float, floor_scale: int, offset: float = 0.0) -> Tensor:
        def fill(ub):
            pos = np.asarray(ub.pos, np.float64)
            return (np.log(np.floor((pos + offset) / floor_scale) + 1.0) * f_scale + 1.0).astype(np.float32)
        return self._input_fn("attn_scale", F32, (1, 1, self.n_tokens), fill)

    # -> F16 [n_tokens, n_tokens]: a token sees every token of its own sequence, before and after it unless causal
    # (llm_graph_input_attn_no_cache); with ALiBi a seen token's entry is -|distance| (the slopes are the kernel's)
    def _kq_mask_no_cache(self, causal: bool, alibi: bool = False) -> Tensor:
        def fill(ub):
            seqs, pos = np.array([s[0] for s in ub.seq_id]), np.asarray(ub.pos, np.int64)
            seen = seqs[:, None] == seqs[None, :]
            if causal:
                seen &= pos[None, :] <= pos[:, None]
            val = -np.abs(pos[None, :] - pos[:, None]).astype(np.float64) if alibi else 0.0
            return np.where(seen, val, -np.inf).astype(np.float16)
        return self._input_fn("kq_mask_no_cache", F16, (self.n_tokens, self.n_tokens), fill)

    def _kq_mask(self, swa: bool) -> Tensor:
        key = "kq_mask_swa" if swa else "kq_mask"
        if key not in self.inputs:
            self._input(key, F16, self.n_kv, self.n_tokens)
        return self.inputs[key]

    def _kv_idxs(self) -> Tensor:
        if "kv_idxs" not in self.inputs:
            self._input("kv_idxs", I64, self.n_tokens)
        return self.inputs["kv_idxs"]

    # ------------------------------------------------------------------ blocks
    def norm(self, cur: Tensor, w: Tensor | None, b: Tensor | None = None, kind: str = "rms", il: int = -1) -> Tensor:
        eps = self.hp.f_norm_rms_eps if kind == "rms" else self.hp.f_norm_eps
        cur = ops.rms_norm(cur, eps) if kind == "rms" else ops.norm(cur, eps)
        if w is not None:
            cur = ops.mul(cur, w)
        if b is not None:
            cur = ops.add(cur, b)
        return cur

    def mm(self, w: Tensor, cur: Tensor, b: Tensor | None = None) -> Tensor:
        cur = self.lora_mm(w, cur)
        return ops.add(cur, b) if b is not None else cur

    # the output head (build_lora_mm on model.output): a head tied to token_embd takes no adapter pair, since the
    # embedding's pair is laid out for get_rows (llama.cpp aborts on it)
    def lm_head(self, w: Tensor, cur: Tensor, b: Tensor | None = None) -> Tensor:
        if w.name == "token_embd.weight":
            cur = ops.mul_mat(w, cur)
            return ops.add(cur, b) if b is not None else cur
        return self.mm(w, cur, b)

    # w: [n_in, n_out]  cur: [n_in, n_tokens]  ->  [n_out, n_tokens]: w @ cur plus each adapter's scaled B @ (A @ cur)
    # (llama.cpp's build_lora_mm)
    def lora_mm(self, w: Tensor, cur: Tensor) -> Tensor:
        res = ops.mul_mat(w, cur)
        for ad, scale in self.loras:
            lw = ad.get(w)
            if lw is not None:
                ab = ops.mul_mat(lw.b, ops.mul_mat(lw.a, cur))
                res = ops.add(res, ops.scale(ab, lw.scale(ad.alpha, scale)))
        return res

    # gated FFN: down(act(gate(x)) * up(x)); without gate: down(act(up(x))). gate may be None with up holding
    # [gate | up] rows (phi3's fused ffn_up).
    def ffn(self, cur: Tensor, up: Tensor, up_b: Tensor | None, gate: Tensor | None, gate_b: Tensor | None,
            down: Tensor, down_b: Tensor | None, act: str = "silu", fused_gate_up: bool = False, il: int = -1) -> Tensor:
        u = self.mm(up, cur, up_b)
        if fused_gate_up:
            cur = ops.swiglu(u) if act == "silu" else ops.geglu(u)
        elif gate is not None:
            g = self.cb(self.mm(gate, cur, gate_b), "ffn_gate", il)
            cur = ops.swiglu(g, u) if act == "silu" else ops.geglu(g, u)
        else:
            cur = {"silu": ops.silu, "gelu": ops.gelu, "relu": ops.relu}[act](u)
        self.cb(cur, "ffn_act", il)
        return self.mm(down, cur, down_b)

    # Mixture of experts (llama.cpp's build_moe_ffn): a router scores the experts of each token, the top n_used are
    # chosen and their outputs summed with the router's weights.
    #   gating: "softmax" (probabilities over all experts), "sigmoid" (each expert on its own), "softmax_weight"
    #           (the raw logits choose, then a softmax over the chosen ones weighs: gpt-oss)
    #   norm_w: the chosen weights renormalised to sum to 1; w_scale: then scaled (expert_weights_scale)
    #   exp_probs_b: a bias added to the probabilities for the choice only (the weights stay unbiased)
    #   gate_inp_b / up_b / gate_b / down_b: biases of the router and of each expert's matrices ([n, n_expert])
    #   act: "silu" (SwiGLU, or SiLU alone without gate_exps), "gelu", "swiglu_oai" (gpt-oss: clamp 7, alpha 1.702),
    #           "relu_sqr" (relu(up)^2, no gate_exps)
    #   n_groups / n_group_used: the experts cut into n_groups equal groups, the choice only among the experts of
    #           the n_group_used groups whose two best (biased) scores sum highest (DeepSeek V3)
    #   weight_before_ffn: llama 4: the raw logits choose, and each chosen expert's input (not its output) is
    #           scaled by its weight
    #   gate_up_exps: [n_embd, 2 * n_ff, n_expert], gate and up in one matrix (the converter's fuse_gate_up_exps),
    #           in place of up_exps and gate_exps
    #   router_logits: the router's output computed by the caller ([n_expert, n_tokens]; Nemotron-H's experts run
    #           on a latent projection of cur while its router reads cur itself)
    # cur: [n_embd, n_tokens]  gate_inp: [n_embd, n_expert]  up/gate_exps: [n_embd, n_ff, n_expert]
    # down_exps: [n_ff, n_embd, n_expert]  ->  [n_embd, n_tokens]
    def moe_ffn(self, cur: Tensor, gate_inp: Tensor, up_exps: Tensor, gate_exps: Tensor | None, down_exps: Tensor,
                n_expert: int, n_used: int, norm_w: bool, il: int = -1, *, gating: str = "softmax",
                w_scale: float = 0.0, exp_probs_b: Tensor | None = None, gate_inp_b: Tensor | None = None,
                up_b: Tensor | None = None, gate_b: Tensor | None = None, down_b: Tensor | None = None,
                act: str = "silu", n_groups: int = 0, n_group_used: int = 0,
                weight_before_ffn: bool = False, router_logits: Tensor | None = None,
                gate_up_exps: Tensor | None = None) -> Tensor:
        n_embd, n_tokens = cur.ne[0], cur.ne[1]
        logits = router_logits
        if logits is None:
            logits = self.cb(self.lora_mm(gate_inp, cur), "ffn_moe_logits", il)    # [n_expert, n_tokens]
        if gate_inp_b is not None:
            logits = self.cb(ops.add(logits, gate_inp_b), "ffn_moe_logits_biased", il)
        if gating == "softmax":
            probs = ops.soft_max(logits)
        elif gating == "sigmoid":
            probs = ops.sigmoid(logits)
        elif gating == "softmax_weight":
            probs = logits
        else:
            raise ValueError(f"unknown expert gating {gating!r}")
        self.cb(probs, "ffn_moe_probs", il)
        select = probs
        if exp_probs_b is not None:
            select = self.cb(ops.add(probs, exp_probs_b), "ffn_moe_probs_biased", il)
        if weight_before_ffn:
            select = logits
        if n_groups > 1:
            select = self._mask_expert_groups(select, n_groups, n_group_used, il)
        selected = self.cb(ops.top_k(select, n_used), "ffn_moe_topk", il)       # I32 [n_used, n_tokens]
        weights = self.cb(ops.get_rows(ops.reshape(probs, 1, n_expert, n_tokens), selected), "ffn_moe_weights", il)
        if gating == "softmax_weight":
            weights = ops.reshape(ops.soft_max(ops.reshape(weights, n_used, n_tokens)), 1, n_used, n_tokens)
        if norm_w:
            w2 = ops.reshape(weights, n_used, n_tokens)
            # a sum clamped to F16's smallest normal: no division by zero (sigmoid weights can all underflow)
            total = ops.clamp(ops.sum_rows(w2), 6.103515625e-5, float("inf"))
            weights = ops.reshape(ops.div(w2, total), 1, n_used, n_tokens)
        if w_scale and w_scale != 1.0:
            weights = self.cb(ops.scale(weights, w_scale), "ffn_moe_weights_scaled", il)
        x = ops.reshape(cur, n_embd, 1, n_tokens)
        if weight_before_ffn:       # [n_embd, n_used, n_tokens]: the token's row once per chosen expert, weighted
            x = ops.mul(ops.repeat(x, Tensor(F32, (n_embd, n_used, n_tokens))), weights)
            self.cb(x, "ffn_moe_weighted", il)
        gate = None
        if gate_up_exps is not None:     # one product, then its halves' views
            gu = self.cb(ops.mul_mat_id(gate_up_exps, x, selected), "ffn_moe_gate_up", il)
            n_ff = gu.ne[0] // 2
            gate = ops.view_3d(gu, n_ff, gu.ne[1], gu.ne[2], gu.nb[1], gu.nb[2], 0)
            up = ops.view_3d(gu, n_ff, gu.ne[1], gu.ne[2], gu.nb[1], gu.nb[2], n_ff * gu.nb[0])
        else:
            up = self.cb(self._add_id(ops.mul_mat_id(up_exps, x, selected), up_b, selected), "ffn_moe_up", il)
        if gate_exps is not None:
            gate = self.cb(self._add_id(ops.mul_mat_id(gate_exps, x, selected), gate_b, selected), "ffn_moe_gate", il)
        if act == "swiglu_oai":
            par = ops.swiglu_oai(gate, up, 1.702, 7.0)
        elif gate is not None:
            par = ops.swiglu(gate, up) if act == "silu" else ops.geglu(gate, up)
        elif act == "relu_sqr":
            par = ops.sqr(ops.relu(up))
        else:
            par = ops.silu(up) if act == "silu" else ops.gelu(up)
        experts = ops.mul_mat_id(down_exps, par, selected)                       # [n_embd, n_used, n_tokens]
        experts = self.cb(self._add_id(experts, down_b, selected), "ffn_moe_down", il)
        if not weight_before_ffn:
            experts = ops.mul(experts, weights)
        out = None
        for i in range(n_used):
            e = ops.view_2d(experts, n_embd, n_tokens, experts.nb[2], i * experts.nb[1])
            out = e if out is None else ops.add(out, e)
        if n_used == 1:
            out = ops.cont(out)
        return self.cb(out, "ffn_moe_out", il)

    # select: [n_expert, n_tokens] -> the same with -inf for every expert outside the chosen groups
    def _mask_expert_groups(self, select: Tensor, n_groups: int, n_group_used: int, il: int) -> Tensor:
        n_expert, n_tokens = select.ne[0], select.ne[1]
        n_per = n_expert // n_groups
        groups = ops.reshape(select, n_per, n_groups, n_tokens)
        top2 = ops.top_k(groups, 2)                                                # [2, n_groups, n_tokens]
        best = ops.get_rows(ops.reshape(groups, 1, n_per, n_groups, n_tokens), top2)   # [1, 2, n_groups, n_tokens]
        scores = ops.reshape(ops.sum_rows(ops.reshape(best, 2, n_groups, n_tokens)), n_groups, n_tokens)
        chosen = self.cb(ops.top_k(scores, n_group_used), "ffn_moe_group_topk", il)   # [n_group_used, n_tokens]
        kept = ops.get_rows(groups, chosen)                                        # [n_per, n_group_used, n_tokens]
        # every score -inf (ggml_fill), then the chosen groups' rows written back
        masked = ops.set_rows(ops.clamp(groups, float("-inf"), float("-inf")), kept, chosen)
        return self.cb(ops.reshape(masked, n_expert, n_tokens), "ffn_moe_probs_masked", il)

    # a: [n, n_used, n_tokens] plus, for each chosen expert, its row of b: [n, n_expert] (ggml_add_id; the rows
    # gathered by get_rows, then one add: the same float sums)
    @staticmethod
    def _add_id(a: Tensor, b: Tensor | None, ids: Tensor) -> Tensor:
        if b is None:
            return a
        n_used, n_tokens = ids.ne[0], ids.ne[1]
        rows = ops.get_rows(b, ops.reshape(ids, n_used * n_tokens))             # [n, n_used * n_tokens]
        return ops.add(a, ops.reshape(rows, b.ne[0], n_used, n_tokens))

    # the shared expert of qwen2moe / granitemoe shared: a plain gated FFN beside the routed ones, optionally
    # weighed per token by sigmoid(gate_inp_shexp . x) (written as silu(v) / v, as llama.cpp does)
    def shexp_ffn(self, cur: Tensor, layer, il: int = -1) -> Tensor:
        out = self.cb(self.ffn(cur, layer.ffn_up_shexp, None, layer.ffn_gate_shexp, None, layer.ffn_down_shexp, None,
                               "silu", il=il), "ffn_shexp", il)
        gi = getattr(layer, "ffn_gate_inp_shexp", None)
        if gi is not None:
            v = self.cb(self.lora_mm(gi, cur), "ffn_shexp_gate_inp", il)            # [1, n_tokens]
            out = self.cb(ops.mul(out, ops.div(ops.silu(v), v)), "ffn_shexp_out", il)
        return out

    # cur: [n_embd, n_tokens] -> q [head_dim, n_head, n_tokens], k and v [head_dim, n_head_kv, n_tokens];
    # separate attn_q/k/v (with optional biases) or one fused attn_qkv
    def qkv(self, layer, cur: Tensor, il: int):
        hp = self.hp
        d_k, d_v, n_head, n_head_kv = hp.n_embd_head_k, hp.n_embd_head_v, hp.n_head(il), hp.n_head_kv(il)
        n_tokens = cur.ne[1]
        if getattr(layer, "wqkv", None) is not None:
            qkv = self.cb(self.mm(layer.wqkv, cur, getattr(layer, "bqkv", None)), "wqkv", il)
            es = 4  # F32
            q = ops.view_3d(qkv, d_k, n_head, n_tokens, d_k * es, qkv.nb[1], 0)
            k = ops.view_3d(qkv, d_k, n_head_kv, n_tokens, d_k * es, qkv.nb[1], d_k * n_head * es)
            v = ops.view_3d(qkv, d_v, n_head_kv, n_tokens, d_v * es, qkv.nb[1], d_k * (n_head + n_head_kv) * es)
            q, k, v = ops.cont(q), ops.cont(k), ops.cont(v)
        else:
            q = ops.reshape(self.mm(layer.wq, cur, getattr(layer, "bq", None)), d_k, n_head, n_tokens)
            k = ops.reshape(self.mm(layer.wk, cur, getattr(layer, "bk", None)), d_k, n_head_kv, n_tokens)
            v = ops.reshape(self.mm(layer.wv, cur, getattr(layer, "bv", None)), d_v, n_head_kv, n_tokens)
        return self.cb(q, "Qcur_raw", il), self.cb(k, "Kcur_raw", il), self.cb(v, "Vcur", il)

    # q: [head_dim, n_head, n_tokens]  k: [head_dim, n_head_kv, n_tokens]  v: [head_dim_v, n_head_kv, n_tokens]
    # -> [n_embd_out, n_tokens] after the output projection wo
    # sinks: F32 [n_head], gpt-oss's per-head logit that joins each softmax with no value
    # v_mla: [d_v_compressed, d_v, n_head], MLA's decompression of each head's attention output (llama.cpp's
    # build_attn_mha v_mla: there the one K/V head holds the compressed KV, V inside K)
    # k and v None: a layer attending over another layer's cache (hparams.kv_source) stores nothing
    def attn(self, il: int, wo: Tensor | None, wo_b: Tensor | None, q: Tensor, k: Tensor | None, v: Tensor | None,
             kq_scale: float, softcap: float = 0.0, sinks: Tensor | None = None,
             v_mla: Tensor | None = None) -> Tensor:
        if k is not None:
            # write this batch's K and V into the cache first: the attention below reads them back
            idxs = self._kv_idxs()
            self.graph.expand(self.kv.store_k(il, k, idxs))
            stored_v = self.kv.store_v(il, v, idxs)
            if stored_v is not None:
                self.graph.expand(stored_v)
        elif self.hp.kv_source(il) == il:
            raise ValueError(f"layer {il} keeps its own K and V: its attention needs them")
        swa = self.hp.is_swa(il) and self.hp.n_swa > 0
        mask = self._kq_mask(swa)
        kc = self.kv.view_k(il, self.n_kv)                     # [head_dim, n_kv, n_head_kv]
        vc = self.kv.view_v(il, self.n_kv)
        qp = ops.permute(q, 0, 2, 1, 3)                        # [head_dim, n_tokens, n_head]
        cur = ops.flash_attn_ext(qp, kc, vc, mask, kq_scale, 0.0, softcap, sinks)  # [head_dim_v, n_head, n_tokens]
        if v_mla is not None:      # per head as one product over the tokens: [d_v, n_tokens, n_head], back
            cur = ops.mul_mat(v_mla, ops.permute(cur, 0, 2, 1, 3))
            cur = ops.cont(ops.permute(cur, 0, 2, 1, 3))
        self.cb(cur, "kqv_out", il)
        cur = ops.reshape(cur, cur.ne[0] * cur.ne[1], cur.ne[2])
        if wo is not None:
            cur = self.mm(wo, cur, wo_b)
        return cur

    # Encoders (bert): attention over this micro-batch only, no cache and no causal mask. Flash attention takes
    # K and V in F16, cast here as llama.cpp's build_attn_mha does when there is no cache to store them in.
    # q: [head_dim, n_head, n_tokens]  k, v: [head_dim, n_head_kv, n_tokens]  ->  [n_embd_out, n_tokens]
    def attn_no_cache(self, il: int, wo: Tensor | None, wo_b: Tensor | None, q: Tensor, k: Tensor, v: Tensor,
                      kq_scale: float, causal: bool = False, max_alibi_bias: float = 0.0) -> Tensor:
        mask = self._kq_mask_no_cache(causal, alibi=max_alibi_bias > 0)
        qp = ops.permute(q, 0, 2, 1, 3)                        # [head_dim, n_tokens, n_head]
        kp = ops.cast(ops.permute(k, 0, 2, 1, 3), F16)
        vp = ops.cast(ops.permute(v, 0, 2, 1, 3), F16)
        cur = self.cb(ops.flash_attn_ext(qp, kp, vp, mask, kq_scale, max_alibi_bias), "kqv_out", il)
        cur = ops.reshape(cur, cur.ne[0] * cur.ne[1], cur.ne[2])
        if wo is not None:
            cur = self.mm(wo, cur, wo_b)
        return cur

    def rope(self, x: Tensor, pos: Tensor, il: int, freq_factors: Tensor | None = None) -> Tensor:
        hp = self.hp
        base, scale = hp.rope_freq_base, hp.rope_freq_scale
        if hp.is_swa(il):
            base, scale = hp.rope_freq_base_swa, hp.rope_freq_scale_swa
        if hp.n_pos_per_embd == 4:
            return ops.rope_multi(x, pos, freq_factors, hp.n_rot, hp.rope_sections, hp.rope_type, hp.n_ctx_orig_yarn,
                                  base, scale, hp.yarn_ext_factor, hp.yarn_attn_factor, hp.yarn_beta_fast,
                                  hp.yarn_beta_slow)
        return ops.rope_ext(x, pos, freq_factors, hp.n_rot, hp.rope_type, hp.n_ctx_orig_yarn, base, scale,
                            hp.yarn_ext_factor, hp.yarn_attn_factor, hp.yarn_beta_fast, hp.yarn_beta_slow)

    # ------------------------------------------------------------------ recurrent state (llama.cpp's build_rs)
    # With a recurrent memory the micro-batch holds n_seqs sequences of n_seq_tokens tokens each, grouped by
    # sequence (the graph's shape depends on n_seqs: the context's graph key holds it). Each sequence reads its
    # state from row rs_src and writes the new one to row rs_dst (another row when its state was shared: copy on
    # write).
    @property
    def n_seqs(self) -> int:
        return self.kv.n_seqs()

    def _rs_ids(self) -> tuple[Tensor, Tensor]:
        if "rs_src" not in self.inputs:
            self._input("rs_src", I32, self.n_seqs)
            self._input("rs_dst", I32, self.n_seqs)
        return self.inputs["rs_src"], self.inputs["rs_dst"]

    # -> [n_embd_r, n_seqs]: the rolling rows (the convolution's last inputs) of the sequences
    def rs_get_r(self, il: int) -> Tensor:
        return self.kv.get_r(il, self._rs_ids()[0])

    # new: [n_embd_r, n_seqs], written back after the graph has read the old rows (its sources depend on them)
    def rs_store_r(self, il: int, new: Tensor) -> None:
        self.graph.expand(self.kv.store_r(il, new, self._rs_ids()[1]))

    # -> (every state row [n_embd_s, n_cells], I32 [n_seqs] the row each sequence starts from): for ssm_scan
    def rs_s(self, il: int) -> tuple[Tensor, Tensor]:
        return self.kv.states_s(il), self._rs_ids()[0]

    def rs_store_s(self, il: int, new: Tensor) -> None:
        self.graph.expand(self.kv.store_s(il, new, self._rs_ids()[1]))

    # the last layer keeps only the rows that return outputs
    def select_outputs(self, *ts: Tensor, out_ids: Tensor | None):
        if out_ids is None:
            return ts
        return tuple(ops.get_rows(t, out_ids) for t in ts)

    def finish(self, embd: Tensor, logits: Tensor | None) -> Graph:
        self.t_embd = self.cb(embd, "result_norm").set_output()
        outs = [self.t_embd]
        if logits is not None and not self.embeddings:
            self.t_logits = self.cb(logits, "result_output").set_output()
            outs = [self.t_logits]
        for t in outs:
            self.graph.expand(t)
        # fusion (rms_norm·mul and the like) is the scheduler's: each backend fuses its own splits after placement,
        # and a fused node keeps the identity of its pattern's last node, so t_embd and t_logits stay valid
        return self.graph


def build_graph(model, kv, n_tokens: int, n_outputs: int, n_kv: int, embeddings: bool = False,
                pooling: str = "none", *, loras=(), embd_input: bool = False) -> GraphContext:
    g = GraphContext(model, kv, n_tokens, n_outputs, n_kv, embeddings, pooling, loras=loras, embd_input=embd_input)
    model.arch.build_graph(model, g)
    return g
