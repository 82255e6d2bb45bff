"""One table of op cases, run on the cpu backend and on the float64 reference backend, compared; plus checks of
the reference against direct NumPy formulas (the oracle must itself be right)."""
from __future__ import annotations

import math

import numpy as np
import pytest

from llampy.ggml import ops
from llampy.ggml.backend import backend_init
from llampy.ggml.graph import Graph
from llampy.ggml.tensor import Op
from llampy.ggml.backend import tensor_data
from llampy.ggml.types import GGMLType as T

from .helpers import leaf, run

CPU = backend_init("cpu")
REF = backend_init("reference")
F32, F16, I32 = T.F32, T.F16, T.I32


def _ids(shape, hi, seed=1):
    return np.random.default_rng(seed).integers(0, hi, shape).astype(np.int32)


def causal_mask(n_kv, n_q):
    m = np.full((n_q, n_kv), -np.inf, np.float32)
    for i in range(n_q):
        m[i, : n_kv - n_q + i + 1] = 0
    return m


# name -> (builder(B) returning the output tensor, tolerance). B(type, np_shape, value=None) places a leaf.
CASES = {
    "add_bcast": (lambda B: ops.add(B(F32, (3, 5, 7)), B(F32, (1, 1, 7))), 1e-6),
    "sub_rows": (lambda B: ops.sub(B(F32, (4, 9)), B(F32, (1, 9))), 1e-6),
    "mul_tile": (lambda B: ops.mul(B(F32, (4, 6)), B(F32, (2, 6))), 1e-6),
    "div": (lambda B: ops.div(B(F32, (3, 8)), B(F32, (3, 8), np.random.default_rng(2).uniform(1, 2, (3, 8)))), 1e-6),
    "scale": (lambda B: ops.scale(B(F32, (5, 11)), 0.37, 0.5), 1e-6),
    "clamp": (lambda B: ops.clamp(B(F32, (5, 11)), -0.3, 0.4), 0),
    "sqr": (lambda B: ops.sqr(B(F32, (7,))), 1e-6),
    "sqrt": (lambda B: ops.sqrt(B(F32, (7,), np.arange(1, 8, dtype=np.float32))), 1e-6),
    "exp": (lambda B: ops.exp(B(F32, (3, 9))), 1e-5),
    "tanh": (lambda B: ops.tanh(B(F32, (3, 9))), 1e-6),
    "silu": (lambda B: ops.silu(B(F32, (3, 40))), 1e-6),
    "gelu": (lambda B: ops.gelu(B(F32, (3, 40))), 1e-6),
    "gelu_erf": (lambda B: ops.gelu_erf(B(F32, (3, 40))), 1e-6),
    "relu": (lambda B: ops.relu(B(F32, (3, 9))), 0),
    "sigmoid": (lambda B: ops.sigmoid(B(F32, (3, 9))), 1e-6),
    "softcap": (lambda B: ops.softcap(B(F32, (3, 9)), 0.2, 30.0), 1e-5),
    "swiglu_split": (lambda B: ops.swiglu(B(F32, (4, 33)), B(F32, (4, 33))), 1e-6),
    "swiglu_fused": (lambda B: ops.swiglu(B(F32, (4, 32))), 1e-6),
    "geglu": (lambda B: ops.geglu(B(F32, (4, 33)), B(F32, (4, 33))), 1e-5),
    "rms_norm": (lambda B: ops.rms_norm(B(F32, (6, 64)), 1e-6), 1e-6),
    "rms_norm_mul": (lambda B: ops.rms_norm_mul(B(F32, (6, 64)), B(F32, (64,)), 1e-5), 1e-6),
    "norm": (lambda B: ops.norm(B(F32, (6, 48)), 1e-5), 1e-5),
    "l2_norm": (lambda B: ops.l2_norm(B(F32, (6, 48)), 1e-12), 1e-6),
    "mul_mat_f32": (lambda B: ops.mul_mat(B(F32, (7, 64)), B(F32, (5, 64))), 1e-5),
    "mul_mat_f16": (lambda B: ops.mul_mat(B(F16, (7, 64)), B(F32, (5, 64))), 1e-5),
    "mul_mat_q4_0": (lambda B: ops.mul_mat(B(T.Q4_0, (9, 64)), B(F32, (3, 64))), 1e-4),
    "mul_mat_q4_1": (lambda B: ops.mul_mat(B(T.Q4_1, (9, 64)), B(F32, (3, 64))), 1e-4),
    "mul_mat_q5_0": (lambda B: ops.mul_mat(B(T.Q5_0, (9, 64)), B(F32, (17, 64))), 1e-4),
    "mul_mat_q8_0": (lambda B: ops.mul_mat(B(T.Q8_0, (9, 64)), B(F32, (2, 64))), 1e-4),
    "mul_mat_q4_k": (lambda B: ops.mul_mat(B(T.Q4_K, (16, 256)), B(F32, (6, 256))), 1e-4),
    "mul_mat_q6_k": (lambda B: ops.mul_mat(B(T.Q6_K, (5, 256)), B(F32, (2, 256))), 1e-4),
    "mul_mat_bcast": (lambda B: ops.mul_mat(B(F32, (2, 1, 6, 32)), B(F32, (2, 3, 4, 32))), 1e-5),
    "mul_mat_transposed": (lambda B: ops.mul_mat(ops.transpose(B(F32, (32, 6))), B(F32, (4, 32))), 1e-5),
    "mul_mat_id": (lambda B: ops.mul_mat_id(B(F32, (4, 8, 32)), B(F32, (5, 1, 32)), B(I32, (5, 2), _ids((5, 2), 4))), 1e-5),
    "get_rows_f32": (lambda B: ops.get_rows(B(F32, (10, 8)), B(I32, (4,), _ids((4,), 10))), 0),
    "get_rows_q8_0": (lambda B: ops.get_rows(B(T.Q8_0, (10, 64)), B(I32, (3,), _ids((3,), 10))), 1e-6),
    "set_rows_f16": (lambda B: ops.set_rows(B(F16, (8, 16), np.zeros((8, 16))), B(F32, (3, 16)),
                                            B(T.I64, (3,), np.array([5, 0, 2]))), 1e-3),
    "soft_max": (lambda B: ops.soft_max(B(F32, (4, 10))), 1e-6),
    "soft_max_ext_mask": (lambda B: ops.soft_max_ext(B(F32, (2, 3, 6)), B(F16, (3, 6), causal_mask(6, 3)), 0.5), 1e-6),
    "soft_max_alibi": (lambda B: ops.soft_max_ext(B(F32, (4, 3, 6)), B(F32, (3, 6), causal_mask(6, 3)), 0.7, 8.0), 1e-6),
    "rope_norm": (lambda B: ops.rope(B(F32, (5, 3, 16)), B(I32, (5,), np.arange(5) * 7), 16, 0, 10000.0), 1e-5),
    "rope_neox_partial": (lambda B: ops.rope_ext(B(F32, (5, 3, 16)), B(I32, (5,), np.arange(5)), None, 8, 2, 4096,
                                                 1e6, 1.0, 0.0, 1.0, 32.0, 1.0), 1e-5),
    "rope_yarn": (lambda B: ops.rope_ext(B(F32, (4, 2, 16)), B(I32, (4,), np.arange(4) * 100), None, 16, 2, 64,
                                         10000.0, 0.25, 1.0, 1.0, 32.0, 1.0), 1e-4),
    "flash_attn_gqa": (lambda B: ops.flash_attn_ext(
        ops.permute(B(F32, (3, 4, 16)), 0, 2, 1, 3), B(F16, (2, 6, 16)), B(F16, (2, 6, 16)),
        B(F16, (3, 6), causal_mask(6, 3)), 0.25), 2e-3),
    "flash_attn_softcap": (lambda B: ops.flash_attn_ext(
        ops.permute(B(F32, (2, 2, 16)), 0, 2, 1, 3), B(F16, (2, 5, 16)), B(F16, (2, 5, 16)), None, 0.5, 0.0, 3.0), 2e-3),
    "cpy_f32_f16": (lambda B: ops.cpy(B(F32, (3, 8)), B(F16, (3, 8), np.zeros((3, 8)))), 1e-3),
    "cont_permuted": (lambda B: ops.cont(ops.permute(B(F32, (2, 3, 4)), 1, 0, 2, 3)), 0),
    "dup": (lambda B: ops.dup(B(F32, (3, 4))), 0),
    "view_strided": (lambda B: ops.cont(ops.view_2d(B(F32, (6, 8)), 4, 3, 64, 8)), 0),
    "reshape": (lambda B: ops.cont(ops.reshape(B(F32, (4, 6)), 8, 3)), 0),
    "concat": (lambda B: ops.concat(B(F32, (2, 3, 4)), B(F32, (2, 3, 5)), 0), 0),
    "repeat": (lambda B: ops.repeat(B(F32, (1, 4)), B(F32, (3, 4))), 0),
    "sum_rows": (lambda B: ops.sum_rows(B(F32, (4, 9))), 1e-5),
    "mean": (lambda B: ops.mean(B(F32, (4, 9))), 1e-6),
    "argmax": (lambda B: ops.argmax(B(F32, (4, 9))), 0),
    "argsort": (lambda B: ops.argsort(B(F32, (4, 9)), ops.SORT_DESC), 0),
    "top_k": (lambda B: ops.top_k(B(F32, (4, 9)), 3), 0),
    # ---- vision encoders: the patch convolution (pixels rounded to F16 by im2col), pooling, GELU_QUICK
    "conv_2d_patches": (lambda B: ops.conv_2d(B(F16, (5, 3, 4, 4)), B(F32, (1, 3, 12, 16)), 4, 4, 0, 0), 1e-5),
    "im2col_pad_dilate": (lambda B: ops.im2col(B(F16, (2, 2, 3, 3)), B(F32, (2, 2, 7, 6)), 2, 1, 1, 2, 2, 1), 0),
    "im2col_f32": (lambda B: ops.im2col(B(F16, (1, 1, 2, 3)), B(F32, (1, 1, 5, 5)), 1, 1, 0, 0, 1, 1, F32), 0),
    "pool_2d_avg": (lambda B: ops.pool_2d(B(F32, (2, 3, 8, 12)), ops.POOL_AVG, 4, 4, 4, 4), 1e-6),
    "pool_2d_avg_pad": (lambda B: ops.pool_2d(B(F32, (1, 2, 7, 9)), ops.POOL_AVG, 3, 2, 2, 2, 1, 1), 1e-6),
    "pool_2d_max": (lambda B: ops.pool_2d(B(F32, (1, 2, 7, 9)), ops.POOL_MAX, 2, 3, 2, 1, 1, 0), 0),
    "gelu_quick": (lambda B: ops.gelu_quick(B(F32, (3, 40), np.random.default_rng(6).uniform(-9, 9, (3, 40)))), 1e-6),
    # ---- broadcasting, odd sizes, non-contiguous sources, other types
    "add_4d_bcast_odd": (lambda B: ops.add(B(F32, (2, 3, 5, 37)), B(F32, (1, 3, 1, 37))), 1e-6),
    "mul_bcast_ne0": (lambda B: ops.mul(B(F32, (3, 4, 12)), B(F32, (3, 1, 4))), 1e-6),
    "add_permuted_src": (lambda B: ops.add(ops.permute(B(F32, (3, 4, 5)), 2, 1, 0, 3), B(F32, (5, 4, 3))), 1e-6),
    "sub_transposed_b": (lambda B: ops.sub(B(F32, (6, 5)), ops.transpose(B(F32, (5, 6)))), 1e-6),
    "mul_f16_src": (lambda B: ops.mul(B(F16, (3, 17)), B(F32, (1, 17))), 1e-6),
    "div_f16_b": (lambda B: ops.div(B(F32, (3, 17)), B(F16, (3, 17), np.random.default_rng(4).uniform(1, 3, (3, 17)))), 1e-6),
    "scale_no_bias_view": (lambda B: ops.scale(ops.view_2d(B(F32, (6, 8)), 5, 3, 64, 12), 1.5), 1e-6),
    "silu_transposed": (lambda B: ops.silu(ops.transpose(B(F32, (37, 5)))), 1e-6),
    "gelu_odd": (lambda B: ops.gelu(B(F32, (2, 3, 19), np.random.default_rng(5).uniform(-12, 12, (2, 3, 19)))), 1e-6),
    "swiglu_fused_swapped": (lambda B: ops.swiglu(B(F32, (3, 34)), None, True), 1e-6),
    "geglu_fused": (lambda B: ops.geglu(B(F32, (3, 50))), 1e-5),
    "rms_norm_odd_permuted": (lambda B: ops.rms_norm(ops.permute(B(F32, (3, 5, 37)), 0, 2, 1, 3), 1e-5), 1e-6),
    "rms_norm_mul_bcast": (lambda B: ops.rms_norm_mul(B(F32, (2, 3, 40)), B(F32, (2, 1, 40)), 1e-6), 1e-6),
    "rms_norm_mul_add": (lambda B: ops.rms_norm_mul(B(F32, (20, 64)), B(F32, (64,)), 1e-6, B(F32, (20, 64))), 1e-6),
    "norm_odd": (lambda B: ops.norm(B(F32, (2, 3, 23)), 1e-5), 1e-5),
    "soft_max_long_f32_mask_bcast": (lambda B: ops.soft_max_ext(B(F32, (3, 2, 100)), B(F32, (1, 4, 100), _soft_mask(4, 100)), 0.125), 1e-6),
    "soft_max_f16_mask_alibi_odd": (lambda B: ops.soft_max_ext(B(F32, (5, 3, 33)), B(F16, (3, 33), causal_mask(33, 3)), 1.0, 4.0), 1e-6),
    "soft_max_transposed": (lambda B: ops.soft_max(ops.transpose(B(F32, (20, 3)))), 1e-6),
    "rope_freq_factors": (lambda B: ops.rope_ext(B(F32, (3, 2, 32)), B(I32, (3,), np.array([0, 5, 1000])),
                                                 B(F32, (16,), np.random.default_rng(6).uniform(1, 4, 16)), 32, 2, 8192,
                                                 500000.0, 1.0, 0.0, 1.0, 32.0, 1.0), 1e-5),
    "rope_norm_permuted_src": (lambda B: ops.rope(ops.permute(B(F32, (4, 6, 16)), 0, 2, 1, 3), B(I32, (6,), np.arange(6) * 3), 12), 1e-5),
    "rope_yarn_norm_4d": (lambda B: ops.rope_ext(B(F32, (2, 3, 2, 24)), B(I32, (3,), np.array([7, 70, 700])), None, 24, 0,
                                                 128, 10000.0, 0.5, 1.0, 1.2, 32.0, 1.0), 1e-4),
    "get_rows_f16_3d": (lambda B: ops.get_rows(B(F16, (2, 10, 8)), B(I32, (2, 4), _ids((2, 4), 10))), 0),
    "get_rows_i32": (lambda B: ops.get_rows(B(I32, (10, 3), _ids((10, 3), 99)), B(I32, (5,), _ids((5,), 10))), 0),
    "get_rows_q4_1": (lambda B: ops.get_rows(B(T.Q4_1, (7, 64)), B(I32, (3,), _ids((3,), 7))), 1e-6),
    "get_rows_q4_k": (lambda B: ops.get_rows(B(T.Q4_K, (5, 256)), B(I32, (4,), _ids((4,), 5))), 1e-6),
    "get_rows_q6_k": (lambda B: ops.get_rows(B(T.Q6_K, (5, 256)), B(I32, (2,), _ids((2,), 5))), 1e-6),
    "get_rows_iq4_nl": (lambda B: ops.get_rows(B(T.IQ4_NL, (5, 64)), B(I32, (2,), _ids((2,), 5))), 1e-6),
    "get_rows_q5_k_3d": (lambda B: ops.get_rows(B(T.Q5_K, (2, 5, 256)), B(I32, (2, 3), _ids((2, 3), 5))), 1e-6),
    "get_rows_iq2_xxs": (lambda B: ops.get_rows(B(T.IQ2_XXS, (4, 256)), B(I32, (2,), _ids((2,), 4))), 1e-6),
    "get_rows_bf16": (lambda B: ops.get_rows(B(T.BF16, (6, 32)), B(I32, (3,), _ids((3,), 6))), 0),
    "set_rows_f32_i32": (lambda B: ops.set_rows(B(F32, (6, 9), np.zeros((6, 9))), B(F32, (2, 9)), B(I32, (2,), np.array([4, 1]))), 0),
    "set_rows_f16_3d_bcast": (lambda B: ops.set_rows(B(F16, (3, 8, 16), np.zeros((3, 8, 16))), B(F32, (3, 2, 16)),
                                                      B(T.I64, (1, 2), np.array([[7, 3]]))), 1e-3),
    "set_rows_q8_0": (lambda B: ops.set_rows(B(T.Q8_0, (8, 64), np.zeros((8, 64))), B(F32, (3, 64)),
                                             B(T.I64, (3,), np.array([6, 2, 0]))), 1e-6),
    "mul_mat_q5_1": (lambda B: ops.mul_mat(B(T.Q5_1, (9, 64)), B(F32, (2, 64))), 1e-4),
    "mul_mat_q5_k": (lambda B: ops.mul_mat(B(T.Q5_K, (4, 256)), B(F32, (3, 256))), 1e-4),
    "mul_mat_q2_k": (lambda B: ops.mul_mat(B(T.Q2_K, (4, 256)), B(F32, (2, 256))), 1e-4),
    "mul_mat_q3_k": (lambda B: ops.mul_mat(B(T.Q3_K, (4, 256)), B(F32, (2, 256))), 1e-4),
    "mul_mat_iq4_nl": (lambda B: ops.mul_mat(B(T.IQ4_NL, (4, 64)), B(F32, (2, 64))), 1e-4),
    "mul_mat_nvfp4": (lambda B: ops.mul_mat(B(T.NVFP4, (5, 128)), B(F32, (2, 128))), 1e-4),
    "mul_mat_q1_0": (lambda B: ops.mul_mat(B(T.Q1_0, (4, 256)), B(F32, (3, 256))), 1e-4),
    "mul_mat_q2_0_prompt": (lambda B: ops.mul_mat(B(T.Q2_0, (6, 128)), B(F32, (17, 128))), 1e-4),
    "mul_mat_f32_odd_k": (lambda B: ops.mul_mat(B(F32, (5, 37)), B(F32, (3, 37))), 1e-5),
    "mul_mat_permuted_b": (lambda B: ops.mul_mat(B(F16, (2, 5, 32)), ops.permute(B(F32, (3, 2, 32)), 0, 2, 1, 3)), 1e-5),
    "mul_mat_glu_decode": (lambda B: ops.mul_mat_glu(B(T.Q5_0, (3, 64)), B(T.Q5_0, (3, 64)), B(F32, (2, 64)), "geglu"),
                           1e-4),
    "mul_mat_glu_prompt": (lambda B: ops.mul_mat_glu(B(T.Q4_1, (32, 64)), B(T.Q4_1, (32, 64)), B(F32, (19, 64)),
                                                     "swiglu"), 1e-4),
    "mul_mat_id_per_used": (lambda B: ops.mul_mat_id(B(T.Q8_0, (6, 8, 64)), B(F32, (4, 3, 64)), B(I32, (4, 3), _perm_ids(4, 3, 6))), 1e-4),
    # gpt-oss: the clamped SwiGLU (values past both limits), and attention sinks on each path (decode one_chunk,
    # the 16-lane kernel at d 64, the tiled prompt path); sinks above and below the rows' maxima
    "swiglu_oai": (lambda B: ops.swiglu_oai(B(F32, (4, 33), np.linspace(-12, 12, 132).reshape(4, 33)),
                                            B(F32, (4, 33), np.linspace(9, -9, 132).reshape(4, 33)), 1.702, 7.0), 1e-6),
    "flash_attn_sinks": (lambda B: ops.flash_attn_ext(
        ops.permute(B(F32, (3, 4, 16)), 0, 2, 1, 3), B(F16, (2, 6, 16)), B(F16, (2, 6, 16)),
        B(F16, (3, 6), causal_mask(6, 3)), 0.25, sinks=B(F32, (4,), np.array([-2.0, 0.5, 3.0, 12.0]))), 2e-3),
    "flash_attn_sinks_vec16": (lambda B: ops.flash_attn_ext(
        ops.permute(B(F32, (1, 4, 64)), 0, 2, 1, 3), B(F16, (2, 9, 64)), B(F16, (2, 9, 64)), None, 0.125,
        sinks=B(F32, (4,), np.array([4.0, -1.0, 0.0, 9.0]))), 2e-3),
    "flash_attn_sinks_tiled": (lambda B: ops.flash_attn_ext(
        ops.permute(B(F32, (64, 2, 32)), 0, 2, 1, 3), B(F16, (1, 70, 32)), B(F16, (1, 70, 32)),
        B(F16, (64, 70), causal_mask(70, 64)), 0.2, sinks=B(F32, (2,), np.array([0.3, 6.0]))), 2e-3),
    "flash_attn_tiled_f16": (lambda B: ops.flash_attn_ext(
        ops.permute(B(F32, (64, 2, 32)), 0, 2, 1, 3), B(F16, (1, 70, 32)), B(F16, (1, 70, 32)),
        B(F16, (64, 70), causal_mask(70, 64)), 0.2), 2e-3),
    "flash_attn_f32_kv_alibi": (lambda B: ops.flash_attn_ext(
        ops.permute(B(F32, (2, 4, 16)), 0, 2, 1, 3), B(F32, (2, 7, 16)), B(F32, (2, 7, 16)),
        B(F32, (2, 7), causal_mask(7, 2)), 0.25, 8.0), 1e-5),
    "flash_attn_q8_0_kv": (lambda B: ops.flash_attn_ext(
        ops.permute(B(F32, (1, 2, 32)), 0, 2, 1, 3), B(T.Q8_0, (1, 9, 32)), B(T.Q8_0, (1, 9, 32)), None, 0.2), 2e-3),
    "flash_attn_decode_long": (lambda B: ops.flash_attn_ext(
        ops.permute(B(F32, (1, 4, 64)), 0, 2, 1, 3), B(F16, (2, 300, 64)), B(F16, (2, 300, 64)),
        B(F16, (1, 300), np.where(np.arange(300) < 290, 0, -np.inf)[None, :]), 0.125), 2e-3),
    "cpy_f16_f32": (lambda B: ops.cpy(B(F16, (3, 8)), B(F32, (3, 8), np.zeros((3, 8)))), 0),
    "cpy_f32_q8_0": (lambda B: ops.cpy(B(F32, (2, 64)), B(T.Q8_0, (2, 64), np.zeros((2, 64)))), 1e-6),
    "cpy_permuted_to_f16": (lambda B: ops.cpy(ops.permute(B(F32, (4, 5)), 1, 0, 2, 3), B(F16, (4, 5), np.zeros((4, 5)))), 1e-3),
    "cont_reshape": (lambda B: ops.cont(ops.transpose(B(F32, (3, 8))), 4, 6), 0),
    "concat_dim1_odd": (lambda B: ops.concat(B(F32, (2, 3, 7)), B(F32, (2, 5, 7)), 1), 0),
    "concat_dim2": (lambda B: ops.concat(B(F32, (3, 4)), B(F32, (1, 3, 4)), 2), 0),
    # the recurrent layers' convolution window: the rolling rows, then the new tokens' transposed inputs
    "concat_dim0_transposed": (lambda B: ops.concat(B(F32, (2, 5, 3)), ops.transpose(B(F32, (2, 4, 5))), 0), 0),
    # from numba_ops.PAR_MIN_ELEMENTS values the kernels split the work over threads (a prompt's window, 300 rows:
    # four full blocks of 64 and a part; one plane or several; many rows of SiLU)
    "concat_dim0_transposed_par": (lambda B: ops.concat(B(F32, (300, 3)), ops.transpose(B(F32, (220, 300))), 0), 0),
    "cont_transposed_par": (lambda B: ops.cont(ops.transpose(B(F32, (260, 256)))), 0),
    "cont_permuted_par": (lambda B: ops.cont(ops.permute(B(F32, (4, 130, 128)), 1, 0, 2, 3)), 0),
    "cast_permuted_f16_par": (lambda B: ops.cast(ops.permute(B(F32, (72, 16, 60)), 0, 2, 1, 3), F16), 0),
    "silu_par": (lambda B: ops.silu(B(F32, (17, 4096))), 1e-6),
    "repeat_3d": (lambda B: ops.repeat(B(F32, (1, 3, 1)), B(F32, (2, 3, 5))), 0),
    "sum_rows_permuted": (lambda B: ops.sum_rows(ops.permute(B(F32, (3, 4, 33)), 1, 0, 2, 3)), 1e-5),
    "argsort_asc_odd": (lambda B: ops.argsort(B(F32, (3, 2, 17))), 0),
    "top_k_large": (lambda B: ops.top_k(B(F32, (2, 100)), 17), 0),
    "argmax_long": (lambda B: ops.argmax(B(F32, (3, 300))), 0),
    # ---- state-space models (Mamba): one token and many, several sequences, states below and above 64 lanes
    "neg": (lambda B: ops.neg(B(F32, (3, 40))), 0),
    "softplus": (lambda B: ops.softplus(B(F32, (3, 40), np.linspace(-30, 30, 120).reshape(3, 40))), 1e-6),
    "ssm_conv_one_token": (lambda B: ops.ssm_conv(B(F32, (2, 10, 4)), B(F32, (10, 4))), 1e-6),
    "ssm_conv_many": (lambda B: ops.ssm_conv(B(F32, (3, 24, 3 + 7)), B(F32, (24, 4))), 1e-6),
    # the rolling rows' convolution in one node: decode of two sequences (one moving to another row, bias + silu),
    # and a prompt of 5 tokens with the sequence starting from another row than it writes
    "ssm_conv_state_decode": (lambda B: ops.ssm_conv_state(
        B(F32, (2, 1, 24)), B(F32, (24, 4)), B(F32, (3, 3 * 24)), B(I32, (2,), np.array([0, 2])),
        B(I32, (2,), np.array([1, 2])), B(F32, (24,)), silu=True), 1e-6),
    "ssm_conv_state_prompt": (lambda B: ops.ssm_conv_state(
        B(F32, (1, 5, 16)), B(F32, (16, 3)), B(F32, (2, 2 * 16)), B(I32, (1,), np.array([1])),
        B(I32, (1,), np.array([0]))), 1e-6),
    # Mamba-2's gate after the scan: z and x views into one row per token, y + x * D per head, then swiglu
    "ssm_gate": (lambda B: _gate(B), 1e-5),
    "ssm_scan_mamba1_one_token": (lambda B: _scan(B, d_state=16, head_dim=1, n_head=12, n_group=1, n_tok=1,
                                                  ids=[2, 0], a_per_elem=True), 1e-5),
    "ssm_scan_mamba1_many": (lambda B: _scan(B, d_state=16, head_dim=1, n_head=20, n_group=1, n_tok=5,
                                             ids=[1, 2, 0], a_per_elem=True), 1e-4),
    "ssm_scan_mamba1_state80": (lambda B: _scan(B, d_state=80, head_dim=1, n_head=6, n_group=1, n_tok=3,
                                                ids=[0], a_per_elem=True), 1e-4),
    "ssm_scan_mamba2_state128": (lambda B: _scan(B, d_state=128, head_dim=8, n_head=4, n_group=2, n_tok=6,
                                                 ids=[1, 0], a_per_elem=False), 1e-4),
    "ssm_scan_mamba2_state48_one_token": (lambda B: _scan(B, d_state=48, head_dim=4, n_head=3, n_group=1, n_tok=1,
                                                          ids=[3, 1, 0], a_per_elem=False), 1e-5),
    "ssm_scan_mamba2_x_view": (lambda B: _scan(B, d_state=64, head_dim=4, n_head=4, n_group=1, n_tok=4,
                                               ids=[0, 1], a_per_elem=False, x_view=True), 1e-4),
    # ---- RWKV: several sequences from gathered state rows, heads below and at 64 lanes
    "rwkv_wkv6_one_token": (lambda B: _wkv(B, 6, S=16, H=3, n_seqs=2, n_seq_tokens=1), 1e-5),
    "rwkv_wkv6_many": (lambda B: _wkv(B, 6, S=64, H=2, n_seqs=3, n_seq_tokens=4), 1e-4),
    "rwkv_wkv7_one_token": (lambda B: _wkv(B, 7, S=16, H=3, n_seqs=2, n_seq_tokens=1), 1e-5),
    "rwkv_wkv7_many": (lambda B: _wkv(B, 7, S=64, H=2, n_seqs=2, n_seq_tokens=5), 1e-4),
    "gated_linear_attn_one_token": (lambda B: _wkv(B, "gla", S=16, H=3, n_seqs=2, n_seq_tokens=1), 1e-5),
    "gated_linear_attn_many": (lambda B: _wkv(B, "gla", S=64, H=2, n_seqs=2, n_seq_tokens=4), 1e-4),
    # ---- gated DeltaNet: state rows below, at and above 64 floats, q/k broadcast over heads, strided q/k/v
    "gated_delta_net_one_token": (lambda B: _gdn(B, S=16, H=4, H_k=2, n_seqs=2, n_tok=1, kda=False), 1e-5),
    "gated_delta_net_many_strided": (lambda B: _gdn(B, S=128, H=2, H_k=2, n_seqs=2, n_tok=5, kda=False,
                                                    strided=True), 1e-4),
    "gated_delta_net_kda": (lambda B: _gdn(B, S=40, H=2, H_k=1, n_seqs=1, n_tok=4, kda=True), 1e-4),
}


def _scan(B, d_state, head_dim, n_head, n_group, n_tok, ids, a_per_elem, x_view=False):
    """An ssm_scan of len(ids) sequences from a pool of max(ids) + 1 state rows, A < 0 as Mamba's -exp(A_log)."""
    rng = np.random.default_rng(d_state + n_tok)
    n_seqs, n_rs = len(ids), max(ids) + 1
    s = B(F32, (n_rs, n_head, head_dim, d_state))
    if x_view:      # x inside a wider row, as Mamba-2 takes it from the convolution's output
        xw = B(F32, (n_seqs, n_tok, head_dim * n_head + 5))
        x = ops.view_4d(xw, head_dim, n_head, n_tok, n_seqs, head_dim * 4, xw.nb[1], xw.nb[2], 0)
    else:
        x = B(F32, (n_seqs, n_tok, n_head, head_dim))
    dt = B(F32, (n_seqs, n_tok, n_head), rng.uniform(-4, 3, (n_seqs, n_tok, n_head)))
    A = B(F32, (n_head, d_state if a_per_elem else 1), -np.exp(rng.uniform(-1, 1.5, (n_head, d_state if a_per_elem else 1))))
    Bm = B(F32, (n_seqs, n_tok, n_group, d_state))
    Cm = B(F32, (n_seqs, n_tok, n_group, d_state))
    return ops.ssm_scan(s, x, dt, A, Bm, Cm, B(I32, (n_seqs,), np.array(ids)))


def _wkv(B, version, S, H, n_seqs, n_seq_tokens):
    """rwkv_wkv6/7 inputs shaped as the RWKV graphs make them: decays in (0, 1); RWKV-7's a = -kk and b = kk * iclr
    with kk of unit length per head (its state stays bounded)."""
    rng = np.random.default_rng(S * 10 + (8 if version == "gla" else version))
    T_ = n_seqs * n_seq_tokens
    shape = (T_, H, S)
    state = B(F32, (n_seqs, S * S * H), rng.normal(0, 0.5, (n_seqs, S * S * H)))
    decay = B(F32, shape, rng.uniform(0.3, 1.0, shape))
    if version == "gla":        # RWKV-6 Qwen2's: q scaled by 1/sqrt(S)
        return ops.gated_linear_attn(B(F32, shape), B(F32, shape), B(F32, shape), decay, state, S ** -0.5)
    if version == 6:
        return ops.rwkv_wkv6(B(F32, shape), B(F32, shape), B(F32, shape), B(F32, (H, S)), decay, state)
    kk = rng.standard_normal(shape)
    kk /= np.linalg.norm(kk, axis=-1, keepdims=True)
    iclr = rng.uniform(0, 1, shape)
    return ops.rwkv_wkv7(B(F32, shape), decay, B(F32, shape), B(F32, shape), B(F32, shape, -kk),
                         B(F32, shape, kk * iclr), state)


def _gdn(B, S, H, H_k, n_seqs, n_tok, kda, strided=False):
    """gated_delta_net inputs as Qwen3-Next's graph makes them: q and k of unit length per head, log-decays g < 0,
    beta in (0, 1); with ``strided`` q, k and v are views into one wider row per token (the convolution's output)."""
    rng = np.random.default_rng(S + n_tok)

    def unit(shape):
        x = rng.standard_normal(shape)
        return x / np.linalg.norm(x, axis=-1, keepdims=True)
    if strided:
        vals = np.concatenate([unit((n_seqs, n_tok, 2 * H_k, S)).reshape(n_seqs, n_tok, -1),
                               rng.standard_normal((n_seqs, n_tok, S * H + 3))], axis=-1)
        w = B(F32, vals.shape, vals)
        view = lambda ne1, off: ops.view_4d(w, S, ne1, n_tok, n_seqs, S * 4, w.nb[1], w.nb[2], off * 4)
        q, k, v = view(H_k, 0), view(H_k, S * H_k), view(H, 2 * S * H_k)
    else:
        q = B(F32, (n_seqs, n_tok, H_k, S), unit((n_seqs, n_tok, H_k, S)))
        k = B(F32, (n_seqs, n_tok, H_k, S), unit((n_seqs, n_tok, H_k, S)))
        v = B(F32, (n_seqs, n_tok, H, S))
    gs = (n_seqs, n_tok, H, S if kda else 1)
    g = B(F32, gs, -rng.uniform(0.01, 2.0, gs))
    beta = B(F32, (n_seqs, n_tok, H, 1), rng.uniform(0, 1, (n_seqs, n_tok, H, 1)))
    state = B(F32, (n_seqs, H, S, S), rng.normal(0, 0.3, (n_seqs, H, S, S)))
    return ops.gated_delta_net(q, k, v, g, beta, state)


def _soft_mask(rows, n):
    m = np.random.default_rng(9).uniform(-2, 0, (rows, n)).astype(np.float32)
    m[:, ::7] = -np.inf
    return m


def _perm_ids(n_tok, n_used, n_expert):
    rng = np.random.default_rng(11)
    return np.stack([rng.permutation(n_expert)[:n_used] for _ in range(n_tok)]).astype(np.int32)


def _gate(B):
    zx = B(F32, (2, 3, 2 * 120 + 9))                    # n_s 2, n_t 3, a row holding z (3 heads of 40), then x
    z = ops.view_4d(zx, 40, 3, 3, 2, 160, zx.nb[1], zx.nb[2], 0)
    x = ops.view_4d(zx, 40, 3, 3, 2, 160, zx.nb[1], zx.nb[2], 129 * 4)
    return ops.ssm_gate(z, B(F32, (2, 3, 3, 40)), x, B(F32, (3, 1)))

def test_every_op_has_a_case():
    covered = set()
    for name, (build, _) in CASES.items():
        t = build(lambda ty, shape, value=None: leaf(CPU, ty, shape, value))
        stack = [t]
        while stack:
            x = stack.pop()
            covered.add(x.op)
            stack.extend(s for s in x.src if s is not None)
    missing = set(Op) - covered - {Op.NONE}
    assert not missing, f"ops without a test case: {sorted(o.value for o in missing)}"


@pytest.mark.parametrize("name", sorted(CASES))
def test_cpu_matches_reference(name):
    build, tol = CASES[name]
    outs = []
    for be in (CPU, REF):
        rng = np.random.default_rng(7)
        B = lambda ty, shape, value=None, be=be, rng=rng: leaf(be, ty, shape, value, rng)
        out = build(B)
        for n in Graph.build(out).nodes:
            assert be.supports_op(n), f"{be} refuses {n!r}"
        outs.append(run(be, out)[0].astype(np.float64))
    a, b = outs
    scale = max(1.0, float(np.nanmax(np.abs(b)))) if b.size else 1.0
    np.testing.assert_allclose(a, b, rtol=0, atol=tol * scale)


def test_reference_softmax_rope_attention_against_numpy():
    rng = np.random.default_rng(3)
    x = rng.standard_normal((2, 5)).astype(np.float32)
    sm = run(REF, ops.soft_max(leaf(CPU, F32, (2, 5), x)))[0].reshape(2, 5)
    e = np.exp(x - x.max(1, keepdims=True))
    np.testing.assert_allclose(sm, e / e.sum(1, keepdims=True), atol=1e-6)

    # NEOX rope of one head at position p: pairs (i, i + d/2) rotated by p * base^(-2i/d)
    d, p = 8, 3
    v = rng.standard_normal((1, 1, d)).astype(np.float32)
    (r,) = run(REF, ops.rope_ext(leaf(CPU, F32, (1, 1, d), v), leaf(CPU, I32, (1,), np.array([p])), None, d, 2,
                                 4096, 10000.0, 1.0, 0.0, 1.0, 32.0, 1.0))
    th = p * 10000.0 ** (-2 * np.arange(d // 2) / d)
    x0, x1 = v[0, 0, : d // 2], v[0, 0, d // 2:]
    want = np.concatenate([x0 * np.cos(th) - x1 * np.sin(th), x0 * np.sin(th) + x1 * np.cos(th)])
    np.testing.assert_allclose(r.reshape(-1), want, atol=1e-5)

    # attention: softmax(q k^T * scale + mask) v with F16-rounded inputs, in float64
    q = rng.standard_normal((4, 2, 16)).astype(np.float32)      # (n_q, n_head, d)
    k = rng.standard_normal((1, 6, 16)).astype(np.float32)      # (n_head_kv, n_kv, d)
    v2 = rng.standard_normal((1, 6, 16)).astype(np.float32)
    mask = causal_mask(6, 4)
    (o,) = run(REF, ops.flash_attn_ext(ops.permute(leaf(CPU, F32, (4, 2, 16), q), 0, 2, 1, 3), leaf(CPU, F16, (1, 6, 16), k),
                                       leaf(CPU, F16, (1, 6, 16), v2), leaf(CPU, F16, (4, 6), mask), 0.25))
    qf = q.astype(np.float16).astype(np.float64)
    kf, vf = k.astype(np.float16).astype(np.float64)[0], v2.astype(np.float16).astype(np.float64)[0]
    for h in range(2):
        s = qf[:, h] @ kf.T * 0.25 + mask
        w = np.exp(s - s.max(1, keepdims=True))
        w /= w.sum(1, keepdims=True)
        np.testing.assert_allclose(o[0, :, h], w @ vf, atol=1e-3)


def test_gelu_matches_ggml_table_definition():
    x = np.linspace(-12, 12, 1001).astype(np.float32)
    g = run(CPU, ops.gelu(leaf(CPU, F32, x.shape, x)))[0].reshape(-1)
    exact = 0.5 * x * (1 + np.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * x ** 3)))
    np.testing.assert_allclose(g, exact, atol=2e-2 * np.maximum(1, np.abs(x)).max())
    assert (g[x <= -10] == 0).all() and (g[x >= 10] == x[x >= 10]).all()


def test_gelu_kernel_is_the_table_lookup():
    """The CPU backend's Numba GELU (act.gelu_rows_par) gives gelu_f32's numbers (ggml_vec_gelu_f32 with
    GGML_GELU_FP16) at every F16 value, values that round to an F16 neighbour, past +-10, and inf/nan."""
    from llampy.ggml.backends.cpu.act import gelu_f32
    h = np.arange(65536, dtype=np.uint16).view(np.float16).astype(np.float32)
    mid = np.random.default_rng(3).uniform(-11, 11, 30000).astype(np.float32)
    x = np.concatenate([h, mid, np.float32([-10, 10, -9.99, 9.99, np.inf, -np.inf, np.nan])])
    x = np.concatenate([x, np.zeros((-len(x)) % 97, np.float32)]).reshape(-1, 97)
    g = run(CPU, ops.gelu(leaf(CPU, F32, x.shape, x)))[0].reshape(x.shape)
    assert np.array_equal(g.view(np.uint32), gelu_f32(x).view(np.uint32))


def test_every_op_supported_by_both_backends():
    """The op list each backend runs: every op of the graph layer, on both."""
    for be in (CPU, REF):
        seen = {}
        for build, _ in CASES.values():
            for n in Graph.build(build(lambda ty, shape, value=None, be=be: leaf(be, ty, shape, value))).nodes:
                seen.setdefault(n.op, []).append(be.supports_op(n))
        assert all(all(v) for v in seen.values())
        assert set(seen) >= set(Op) - {Op.NONE}


@pytest.mark.parametrize("be", [CPU, REF], ids=["cpu", "reference"])
def test_plan_reads_current_inputs(be):
    """A plan binds views once; new input values set between runs are seen without re-planning."""
    from llampy.ggml import backend as gb
    rng = np.random.default_rng(5)
    x = leaf(be, F32, (3, 32), rng.standard_normal((3, 32)))
    w = leaf(be, F16, (8, 32), rng.standard_normal((8, 32)))
    pos = leaf(be, I32, (3,), np.array([0, 1, 2]))
    y = ops.rope(ops.reshape(ops.mul_mat(w, x), 4, 2, 3), pos, 4)
    out = ops.soft_max(ops.rms_norm(ops.add(ops.reshape(y, 8, 3), ops.scale(ops.reshape(y, 8, 3), 0.5)), 1e-6))
    nodes = Graph.build(out).nodes
    for n in nodes:
        if n.view_src is None and n.op not in (Op.NONE,):
            gb.tensor_alloc(be.alloc_buffer(n.nbytes), n, 0)
    plan = be.graph_plan_create(nodes)
    results = []
    for p in ([0, 1, 2], [5, 9, 40]):
        tensor_data(pos)[...] = p
        tensor_data(x)[...] = rng.standard_normal((3, 32))
        be.graph_plan_compute(plan)
        got = np.array(tensor_data(out))
        be.graph_compute(nodes)                    # a fresh plan over the same values agrees
        np.testing.assert_array_equal(got, tensor_data(out))
        results.append(got)
    assert not np.array_equal(results[0], results[1])


def test_reference_ssm_against_direct_loops():
    """The oracle's convolution and scan against the formulas written out element by element."""
    rng = np.random.default_rng(21)
    sx, c = rng.standard_normal((2, 3, 6)), rng.standard_normal((3, 4))
    (r,) = run(REF, ops.ssm_conv(leaf(REF, F32, sx.shape, sx), leaf(REF, F32, c.shape, c)))
    r = r.reshape(2, 3, 3)                                            # (n_s, n_t, d_inner)
    sx32, c32 = sx.astype(np.float32), c.astype(np.float32)
    for s_ in range(2):
        for t in range(3):
            for i in range(3):
                assert abs(r[s_, t, i] - sum(float(sx32[s_, i, t + k]) * float(c32[i, k]) for k in range(4))) < 1e-5
    d_state, n_head, n_tok = 5, 3, 2
    st0 = rng.standard_normal((2, n_head, 1, d_state)).astype(np.float32)
    x = rng.standard_normal((1, n_tok, n_head, 1)).astype(np.float32)
    dt = np.array([[[-1.0, 0.5, 25.0], [2.0, -3.0, 0.1]]], np.float32)
    A = -rng.uniform(0.5, 2, (n_head, d_state)).astype(np.float32)
    Bm = rng.standard_normal((1, n_tok, 1, d_state)).astype(np.float32)
    Cm = rng.standard_normal((1, n_tok, 1, d_state)).astype(np.float32)
    L = lambda a, t=F32: leaf(REF, t, a.shape, a)
    (o,) = run(REF, ops.ssm_scan(L(st0), L(x), L(dt), L(A), L(Bm), L(Cm), L(np.array([1], np.int32), I32)))
    o = o.reshape(-1)
    st = st0[1, :, 0].astype(np.float64)
    for t in range(n_tok):
        for h in range(n_head):
            d = float(dt[0, t, h])
            dsp = d if d > 20 else math.log1p(math.exp(d))
            st[h] = st[h] * np.exp(dsp * A[h]) + Bm[0, t, 0] * x[0, t, h, 0] * dsp
            assert abs(o[t * n_head + h] - (st[h] * Cm[0, t, 0]).sum()) < 1e-5
    np.testing.assert_allclose(o[n_tok * n_head:], st.reshape(-1), atol=1e-5)


def test_reference_norms_and_masked_softmax_against_numpy():
    rng = np.random.default_rng(8)
    x = rng.standard_normal((3, 37)).astype(np.float32)
    (r,) = run(REF, ops.rms_norm(leaf(REF, F32, x.shape, x), 1e-6))
    np.testing.assert_allclose(r.reshape(x.shape), x / np.sqrt((x.astype(np.float64) ** 2).mean(1, keepdims=True) + 1e-6), rtol=1e-6)
    (nm,) = run(REF, ops.norm(leaf(REF, F32, x.shape, x), 1e-5))
    np.testing.assert_allclose(nm.reshape(x.shape), (x - x.mean(1, keepdims=True)) / np.sqrt(x.var(1, keepdims=True) + 1e-5), rtol=1e-5, atol=1e-6)
    # ALiBi: head h of 4 with max_bias 8 gets slope 2^(-8(h+1)/4) on the mask
    a = rng.standard_normal((4, 2, 5)).astype(np.float32)
    m = rng.uniform(-3, 0, (2, 5)).astype(np.float32)
    (sm,) = run(REF, ops.soft_max_ext(leaf(REF, F32, a.shape, a), leaf(REF, F32, m.shape, m), 0.5, 8.0))
    z = a * 0.5 + (2.0 ** (-8.0 * (np.arange(4) + 1) / 4))[:, None, None] * m
    e = np.exp(z - z.max(-1, keepdims=True))
    np.testing.assert_allclose(sm.reshape(a.shape), e / e.sum(-1, keepdims=True), atol=1e-6)


def test_flash_attn_walks_only_the_visible_cells():
    """Eight sequences interleaved in one cache, as a server's decode batch has them: each query sees every eighth
    cell. The decode kernel must give, bit for bit, what it gives over only those cells (compacted, no mask), for a
    float32 mask and for F16 mask bits, and with a few of the visible cells scattered as a hole-filled cache has."""
    from llampy.ggml.backends.cpu.attention import _fa_vec16
    from llampy.ggml.backends.cpu.numpy_ops import alibi_slopes
    rng = np.random.default_rng(3)
    n_seq, n_kv, n_head, n_head_kv, d = 8, 403, 6, 2, 64
    q = rng.standard_normal((1, n_head, n_seq, d)).astype(np.float32)
    k = rng.standard_normal((1, n_head_kv, n_kv, d)).astype(np.float16).view(np.uint16)
    v = rng.standard_normal((1, n_head_kv, n_kv, d)).astype(np.float16).view(np.uint16)
    owner = np.arange(n_kv) % n_seq
    owner[[5, 77, 300]] = 2
    mask = np.where(owner[None, :] == np.arange(n_seq)[:, None], 0.0, -np.inf).astype(np.float32)
    mask[:, 10] = np.where(owner[10] == np.arange(n_seq), -1.5, -np.inf)   # a finite bias on one visible cell
    slopes = alibi_slopes(n_head, 0.0, np.float32)
    sc, cap = np.float32(0.125), np.float32(0.0)
    got32 = np.empty((1, n_seq, n_head, d), np.float32)
    _fa_vec16(q, k, v, mask[None, None], got32, sc, cap, slopes)
    got16 = np.empty_like(got32)
    _fa_vec16(q, k, v, mask.astype(np.float16).view(np.uint16)[None, None], got16, sc, cap, slopes)
    assert np.array_equal(got32, got16)
    for s in range(n_seq):
        cells = np.flatnonzero(owner == s)
        want = np.empty((1, 1, n_head, d), np.float32)
        _fa_vec16(np.ascontiguousarray(q[:, :, s:s + 1]), np.ascontiguousarray(k[:, :, cells]),
                  np.ascontiguousarray(v[:, :, cells]), mask[None, None, s:s + 1, cells].copy(), want, sc, cap, slopes)
        assert np.array_equal(got32[:, s:s + 1], want), s
        nomask = np.empty_like(want)
        if not (mask[s, cells] != 0).any():
            _fa_vec16(np.ascontiguousarray(q[:, :, s:s + 1]), np.ascontiguousarray(k[:, :, cells]),
                      np.ascontiguousarray(v[:, :, cells]), np.zeros((1, 1, 1, 0), np.float32), nomask, sc, cap,
                      slopes)
            assert np.array_equal(nomask, want), s


def test_products_share_a_quantized_input_until_it_is_written():
    """Products reading one x (q, k, v) quantize it once per run; a node that writes into x's memory in between
    (SET_ROWS into it) makes the next product quantize it again, or it would read the old values."""
    rng = np.random.default_rng(12)
    xv = rng.standard_normal((2, 64)).astype(np.float32)
    x = leaf(CPU, F32, (2, 64), xv)
    w1, w2, w3 = (leaf(CPU, T.Q8_0, (8, 64), rng.standard_normal((8, 64))) for _ in range(3))
    new_row = rng.standard_normal((1, 64)).astype(np.float32)
    y1 = ops.mul_mat(w1, x)
    y2 = ops.mul_mat(w2, x)
    s = ops.set_rows(x, leaf(CPU, F32, (1, 64), new_row), leaf(CPU, I32, (1,), np.array([1])))
    y3 = ops.mul_mat(w3, x)
    got = run(CPU, y1, y2, s, y3)
    written = xv.copy()
    written[1] = new_row[0]
    for w, x_val, res in ((w1, xv, got[0]), (w2, xv, got[1]), (w3, written, got[3])):
        (want,) = run(CPU, ops.mul_mat(w, leaf(CPU, F32, (2, 64), x_val)))
        np.testing.assert_array_equal(res, want)


def test_attention_layers_sharing_a_mask_list_its_cells_once_per_run(monkeypatch):
    """Decode attention in two layers reading one mask input: the cells it leaves visible are listed once per run
    (the plan's memo; from the second run, the plan's fast calls: one Prepare step into buffers both kernels
    read), and listed again in the next run, after the mask changed, as the reference backend says."""
    from llampy.ggml.backends.cpu import attention
    from llampy.ggml.sched import Scheduler
    listed = []
    real = attention.visible_cells
    monkeypatch.setattr(attention, "visible_cells", lambda *a: listed.append(1) or real(*a))
    rng = np.random.default_rng(5)
    vals = {name: rng.standard_normal(shape) for name, shape in
            (("q1", (1, 4, 64)), ("q2", (1, 4, 64)), ("k1", (2, 9, 64)), ("v1", (2, 9, 64)), ("k2", (2, 9, 64)),
             ("v2", (2, 9, 64)))}
    masks = [np.where(np.arange(9) < 5, 0.0, -np.inf)[None], np.where(np.arange(9) % 3 == 1, 0.0, -np.inf)[None],
             np.where(np.arange(9) >= 7, 0.0, -np.inf)[None]]

    def build(be):
        mask = leaf(be, F16, (1, 9), masks[0]).set_input()
        outs = [ops.flash_attn_ext(ops.permute(leaf(be, F32, (1, 4, 64), vals["q" + i]), 0, 2, 1, 3),
                                   leaf(be, F16, (2, 9, 64), vals["k" + i]), leaf(be, F16, (2, 9, 64), vals["v" + i]),
                                   mask, 0.125) for i in "12"]
        for o in outs:
            o.set_output()
        return mask, outs, Graph.build(*outs)

    mask, outs, g = build(CPU)
    sched = Scheduler([CPU])
    for m in masks:
        tensor_data(mask)[...] = np.asarray(m, np.float32).astype(np.float16)
        listed.clear()
        sched.graph_compute(g)
        assert len(listed) == 1
        rmask, routs, rg = build(REF)
        tensor_data(rmask)[...] = np.asarray(m, np.float32).astype(np.float16)
        Scheduler([REF]).graph_compute(rg)
        for o, r in zip(outs, routs):
            np.testing.assert_allclose(tensor_data(o), tensor_data(r), rtol=0, atol=2e-3)
    fast = [getattr(getattr(c, "func", None), "__qualname__", "") for c in sched._last.splits[0].plan.fast]
    assert sum(q.endswith("_fa_vec16_kernel") for q in fast) == 2


def test_decode_pairs_bind_as_one_call(monkeypatch):
    """A decoded token's residual ADD and the RMS_NORM_MUL reading it, and a ROPE and its SET_ROWS into an F16
    cache (through a view), each bind as one call (numba_ops.PAIR_BINDERS); every tensor gets the bits of the calls
    bound one by one, over two runs with new inputs (NEOX rope at new positions), and a row index out of range
    still raises. The second run takes the plan's resolved calls: with the positions and the cell indices graph
    inputs, the rope's table refill and the two stores' index test are made once (``direct.Prepare``)."""
    from llampy.ggml.backend import tensor_alloc
    from llampy.ggml.backends.cpu import numba_ops
    rng = np.random.default_rng(9)
    x, r, w = (leaf(CPU, F32, (1, 64), rng.standard_normal((1, 64))) for _ in range(3))
    pos = leaf(CPU, I32, (1,), np.array([3])).set_input()
    idx = leaf(CPU, T.I64, (1,), np.array([2])).set_input()
    cache, cache_v = (leaf(CPU, F16, (6, 64), np.zeros((6, 64))) for _ in range(2))
    s = ops.add(x, r)
    h = ops.rms_norm_mul(s, w, 1e-5)
    k = ops.rope_ext(ops.reshape(h, 16, 4, 1), pos, None, 16, 2, 4096, 1e4, 1.0, 0.0, 1.0, 32.0, 1.0)
    q = ops.rope_ext(ops.reshape(s, 16, 4, 1), pos, None, 16, 2, 4096, 1e4, 1.0, 0.0, 1.0, 32.0, 1.0)
    st = ops.set_rows(cache, ops.reshape(k, 64, 1), idx)
    sv = ops.set_rows(cache_v, h, idx)
    outs = (s, h, k, st, q, sv)
    nodes = Graph.build(*outs).nodes
    for n in nodes:
        if n.view_src is None and n.op is not Op.NONE:
            tensor_alloc(CPU.alloc_buffer(n.nbytes), n, 0)
    fused = CPU.graph_plan_create(nodes)
    with monkeypatch.context() as mp:
        mp.setattr(numba_ops, "PAIR_BINDERS", {})
        mp.setattr("llampy.ggml.backends.cpu.backend.PAIR_BINDERS", {})
        apart = CPU.graph_plan_create(nodes)
    assert len(apart.calls) == 6 and len(fused.calls) == 4
    for p, i in ((3, 2), (41, 5)):
        tensor_data(pos)[...] = p
        tensor_data(idx)[...] = i
        tensor_data(x)[...] = rng.standard_normal((1, 64))
        got = []
        for plan in (fused, apart):
            tensor_data(cache)[...] = 0
            tensor_data(cache_v)[...] = 0
            CPU.graph_plan_compute(plan)
            got.append([np.array(tensor_data(t)) for t in outs])
        for a, b in zip(*got):
            np.testing.assert_array_equal(a, b)
        assert np.any(got[0][3].reshape(-1, 64)[i] != 0) and np.any(got[0][5].reshape(-1, 64)[i] != 0)
    steps = [getattr(c, "__qualname__", "") for c in fused.fast]
    assert len(fused.fast) == 6 and steps.count("bind.<locals>.refill") == 1 and \
        steps.count("index_prepare.<locals>.<lambda>") == 1
    tensor_data(idx)[...] = 6
    for plan in (fused, apart):
        with pytest.raises(IndexError, match="set_rows"):
            CPU.graph_plan_compute(plan)
