"""The mixture-of-experts block (GraphContext.moe_ffn, llama.cpp's build_moe_ffn) on the cpu backend against a
direct float64 NumPy formula, for each routing variant the architectures use; and the CPU's expert product reads
only the experts a batch chose."""
from __future__ import annotations

import numpy as np
import pytest

from llampy.ggml import ops
from llampy.ggml.backend import backend_init
from llampy.ggml.types import GGMLType as T
from llampy.llama.graph import GraphContext

from tests.ggml.helpers import leaf, run

CPU = backend_init("cpu")
N_EMBD, N_FF, N_EXPERT, N_USED, N_TOKENS = 32, 24, 6, 3, 5


def _graph_context():
    g = GraphContext.__new__(GraphContext)     # the block needs no model: only naming and the adapter list
    g.loras = []
    return g


def _reference(x, w, gating, norm_w, w_scale, probs_b, gate_inp_b, biases, act, gated):
    logits = x @ w["gate_inp"].T + (gate_inp_b if gate_inp_b is not None else 0)
    if gating == "softmax":
        e = np.exp(logits - logits.max(-1, keepdims=True))
        probs = e / e.sum(-1, keepdims=True)
    elif gating == "sigmoid":
        probs = 1 / (1 + np.exp(-logits))
    else:
        probs = logits
    sel = np.argsort(-(probs + (probs_b if probs_b is not None else 0)), axis=-1, kind="stable")[:, :N_USED]
    wts = np.take_along_axis(probs, sel, -1)
    if gating == "softmax_weight":
        e = np.exp(wts - wts.max(-1, keepdims=True))
        wts = e / e.sum(-1, keepdims=True)
    if norm_w:
        wts = wts / np.maximum(wts.sum(-1, keepdims=True), 6.103515625e-5)
    if w_scale:
        wts = wts * w_scale
    out = np.zeros_like(x)
    for t in range(x.shape[0]):
        for j, e in enumerate(sel[t]):
            up = w["up"][e] @ x[t] + (biases["up"][e] if biases else 0)
            g = (w["gate"][e] @ x[t] + (biases["gate"][e] if biases else 0)) if gated else None
            if act == "swiglu_oai":
                xg = np.minimum(g, 7.0)
                h = xg / (1 + np.exp(-1.702 * xg)) * (np.clip(up, -7.0, 7.0) + 1)
            elif gated:
                h = g / (1 + np.exp(-g)) * up
            else:
                h = up / (1 + np.exp(-up))
            d = w["down"][e] @ h + (biases["down"][e] if biases else 0)
            out[t] += wts[t, j] * d
    return out


@pytest.mark.parametrize("gating, norm_w, w_scale, probs_bias, with_biases, act, gated", [
    ("softmax", True, 0.0, False, False, "silu", True),           # mixtral, qwen3moe, granitemoe
    ("softmax", False, 0.0, False, False, "silu", False),         # no ffn_gate_exps: SiLU(up) alone
    ("sigmoid", True, 2.5, True, False, "silu", True),            # deepseek-style: sigmoid, selection bias, scale
    ("softmax_weight", False, 0.0, False, True, "swiglu_oai", True),  # gpt-oss
])
def test_moe_ffn_matches_formula(gating, norm_w, w_scale, probs_bias, with_biases, act, gated):
    rng = np.random.default_rng(3)
    x = rng.normal(size=(N_TOKENS, N_EMBD)).astype(np.float32)
    w = {"gate_inp": rng.normal(0, 0.6, (N_EXPERT, N_EMBD)), "up": rng.normal(0, 0.3, (N_EXPERT, N_FF, N_EMBD)),
         "gate": rng.normal(0, 0.3, (N_EXPERT, N_FF, N_EMBD)), "down": rng.normal(0, 0.3, (N_EXPERT, N_EMBD, N_FF))}
    w = {k: v.astype(np.float32) for k, v in w.items()}
    probs_b = rng.normal(0, 0.2, N_EXPERT).astype(np.float32) if probs_bias else None
    gate_inp_b = rng.normal(0, 0.5, N_EXPERT).astype(np.float32) if with_biases else None
    biases = {k: rng.normal(0, 0.1, (N_EXPERT, n)).astype(np.float32)
              for k, n in (("up", N_FF), ("gate", N_FF), ("down", N_EMBD))} if with_biases else None
    L = lambda a: leaf(CPU, T.F32, a.shape, a)       # noqa: E731
    g = _graph_context()
    out = g.moe_ffn(L(x), L(w["gate_inp"]), L(w["up"]), L(w["gate"]) if gated else None, L(w["down"]),
                    N_EXPERT, N_USED, norm_w, 0, gating=gating, w_scale=w_scale,
                    exp_probs_b=L(probs_b) if probs_b is not None else None,
                    gate_inp_b=L(gate_inp_b) if gate_inp_b is not None else None,
                    up_b=L(biases["up"]) if biases else None, gate_b=L(biases["gate"]) if biases else None,
                    down_b=L(biases["down"]) if biases else None, act=act)
    (got,) = run(CPU, out)
    f64 = lambda a: None if a is None else a.astype(np.float64)      # noqa: E731
    want = _reference(x.astype(np.float64), {k: f64(v) for k, v in w.items()}, gating, norm_w, w_scale, f64(probs_b),
                      f64(gate_inp_b), {k: f64(v) for k, v in biases.items()} if biases else None, act, gated)
    np.testing.assert_allclose(got.reshape(want.shape), want, rtol=0, atol=1e-4 * max(1.0, np.abs(want).max()))


def test_expert_product_reads_only_the_chosen_experts():
    """A decode step's expert products touch only its chosen experts: experts no token chose hold NaN and the
    result stays finite (ggml groups the batch's rows by expert the same way)."""
    rng = np.random.default_rng(5)
    w = rng.normal(size=(8, 16, 64)).astype(np.float32)
    ids = np.array([[1, 6], [6, 3]], np.int32)                  # [n_tokens, n_used]: experts 1, 3, 6
    w[[0, 2, 4, 5, 7]] = np.nan
    x = rng.normal(size=(2, 1, 64)).astype(np.float32)
    out = ops.mul_mat_id(leaf(CPU, T.Q8_0, w.shape, w), leaf(CPU, T.F32, x.shape, x), leaf(CPU, T.I32, ids.shape, ids))
    (got,) = run(CPU, out)
    got = got.reshape(2, 2, 16)
    assert np.isfinite(got).all()
    from llampy.ggml.quants import dequantize, quantize
    wd = dequantize(quantize(w.reshape(-1, 64), T.Q8_0), T.Q8_0).reshape(w.shape)
    for t in range(2):
        for j, e in enumerate(ids[t]):
            np.testing.assert_allclose(got[t, j], wd[e] @ x[t, 0], rtol=0, atol=0.2)   # x rounded to Q8_0
