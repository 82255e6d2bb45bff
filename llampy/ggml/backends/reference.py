"""The reference backend: the oracle that tests compare the others against.

The same rounding points as llama.cpp's CPU backend (activations through the dot type, F16 K/V, F16 GELU table)
but every product and sum in float64, in plain NumPy: slow and simple.
"""
from __future__ import annotations

import numpy as np

from ..backend import register_backend
from ..types import GGMLType, TYPE_TRAITS
from .cpu.backend import CPUBackend
from .cpu import kernels as K

T = GGMLType


def _mul_mat_f64(w: np.ndarray, wtype: GGMLType, x: np.ndarray, out: np.ndarray, exact_max_rows=None) -> None:
    from .cpu.matmul import round_act
    from ..quants import quantize_act
    vdt = TYPE_TRAITS[wtype].vec_dot_type
    x = np.ascontiguousarray(x, dtype=np.float32)
    xr = round_act(x, vdt).astype(np.float64)
    wf = K.to_float(w, wtype, np.float64)
    res = xr @ wf.T
    if vdt == T.Q8_1:
        # llama.cpp adds each block's min times Q8_1's s, the block sum stored as F16
        n, k = x.shape
        q = quantize_act(x, T.Q8_1).reshape(n, k // 32, 36)
        s = np.ascontiguousarray(q[:, :, 2:4]).view(np.float16).astype(np.float64).reshape(n, -1)
        delta = s - xr.reshape(n, k // 32, 32).sum(axis=2)
        blk = np.ascontiguousarray(w).reshape(w.shape[0], k // 32, TYPE_TRAITS[wtype].type_size)
        mins = np.ascontiguousarray(blk[:, :, 2:4]).view(np.float16).astype(np.float64).reshape(w.shape[0], -1)
        res += delta @ mins.T
    out[...] = res


class ReferenceBackend(CPUBackend):
    name = "reference"
    acc = np.float64

    def __init__(self, device: str | None = None, n_threads: int | None = None):
        super().__init__(device or "reference", None)

    def _mul_mat_fn(self):
        return _mul_mat_f64

    def _bind_flash_attn(self, node, dst, srcs):
        q, k, v = node.src[:3]
        p = node.op_params
        qa, ka, va = srcs[:3]
        ma = srcs[3] if p["has_mask"] else None

        def run():
            qf = np.asarray(qa, np.float64)                                  # (ne3, n_head, n_q, d)
            n_q = qf.shape[2]
            few = n_q < 64 and k.type == T.F16 and v.type == T.F16
            if few:   # ggml's one_chunk path rounds Q to F16
                qf = qf.astype(np.float16).astype(np.float64)
            kf = K.to_float(ka, k.type, np.float64)
            vf = K.to_float(va, v.type, np.float64)
            n_head, n_head_kv = qf.shape[1], kf.shape[1]
            rk = n_head // n_head_kv
            kf = np.repeat(kf, rk, axis=1)
            vf = np.repeat(vf, rk, axis=1)
            s = np.einsum("ahqd,ahkd->ahqk", qf, kf) * p["scale"]
            if p["softcap"]:
                s = p["softcap"] * np.tanh(s / p["softcap"])
            if ma is not None:
                m = K.to_float(ma, node.src[3].type, np.float64)[:, :, :n_q, :]
                m = K.tile_to(m, (s.shape[0], s.shape[1]) + m.shape[2:])
                slopes = K.alibi_slopes(n_head, p["max_bias"], np.float64).reshape(1, -1, 1, 1)
                s = s + slopes * m
            mx = s.max(axis=-1, keepdims=True)
            with np.errstate(invalid="ignore"):
                e = np.nan_to_num(np.exp(s - mx), nan=0.0)
                den = e.sum(axis=-1, keepdims=True)
                o = np.einsum("ahqk,ahkd->ahqd", e, vf) / np.where(den == 0, 1, den)
            dst[...] = o.transpose(0, 2, 1, 3)
        return run


register_backend("reference", ReferenceBackend)
