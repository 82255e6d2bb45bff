"""The attention's BLAS tiles (attention._attend_tiles: products called from Numba, the causal diagonal in
sub-blocks; the one_chunk path's for K/V types other than F16) against a float64 statement of softmax attention and
against the numpy path they replace."""
import numpy as np
import pytest

from llampy.ggml.backends.cpu import attention as A
from llampy.ggml.backends.cpu import blas
from llampy.ggml.backends.cpu.numpy_ops import alibi_slopes

pytestmark = pytest.mark.skipif(not blas.sgemm_address(), reason="numpy's bundled OpenBLAS (cblas_sgemm64_) not found")


def _case(rng, n_head, n_head_kv, d, n_q, n_kv, ne3=1, kind="causal", m2=1):
    # q as the graph hands it over: token-major memory, (ne3, n_head, n_q, d) through a transpose
    q = rng.standard_normal((ne3, n_q, n_head, d)).astype(np.float32).transpose(0, 2, 1, 3)
    k = rng.standard_normal((ne3, n_head_kv, n_kv, d)).astype(np.float16)
    v = rng.standard_normal((ne3, n_head_kv, n_kv, d)).astype(np.float16)
    if kind == "none":
        return q, k, v, None
    i = np.arange(n_q)[:, None] + (n_kv - n_q)
    j = np.arange(n_kv)[None, :]
    vis = j <= i
    if kind == "window":
        vis &= j > i - 100
    if kind == "holes":                                 # rows 40..79 see nothing: their output is 0
        vis &= ~((i >= 40 + n_kv - n_q) & (i < 80 + n_kv - n_q))
    mask = np.where(vis, 0.0, -np.inf).astype(np.float32)
    mask = np.broadcast_to(mask, (m2, n_q, n_kv)).copy()
    if m2 > 1:                                          # per-head masks with finite biases in the visible cells
        mask += np.where(vis, rng.standard_normal((m2, n_q, n_kv)), 0).astype(np.float32)
    return q, k, v, mask[None]


U32 = 2.0 ** -24          # float32's unit roundoff


def _reference(q, k, v, mask, scale, max_bias, softcap):
    """Softmax attention in float64, and for each output a bound on the error of any float32 evaluation of it,
    from the arithmetic: a score sums d products in some order, so it is off by at most (d + 2) u times the sum of
    their magnitudes (Higham's gamma_d), and the softcap and bias add a rounding each; the exponentials' relative
    errors are the score errors (against the row's maximum, so twice) plus a few u; the weighted sum of values adds
    (n_kv + 2) u of the sum of |p v|, and the normalisation a few u more. No order of summation can exceed it."""
    ne3, n_head, n_q, d = q.shape
    n_kv = k.shape[2]
    rk = n_head // k.shape[1]
    slopes = alibi_slopes(n_head, max_bias, np.float32).astype(np.float64)
    out = np.zeros((ne3, n_q, n_head, v.shape[3]))
    bound = np.zeros_like(out)
    for i3 in range(ne3):
        for h in range(n_head):
            qf, kf = q[i3, h].astype(np.float64), k[i3, h // rk].astype(np.float64)
            vf = v[i3, h // rk].astype(np.float64)
            s = qf @ kf.T * scale
            ds = (d + 2) * U32 * (np.abs(qf) @ np.abs(kf).T) * scale
            if softcap:
                s = softcap * np.tanh(s / softcap)
                ds = ds + 4 * U32 * softcap
            if mask is not None:
                b = slopes[h] * mask[i3 % mask.shape[0], h % mask.shape[1]]
                s = s + b
                ds = ds + 2 * U32 * np.abs(np.where(np.isfinite(b), b, 0)) + 2 * U32 * np.abs(np.where(np.isfinite(s), s, 0))
            mx = s.max(axis=1, keepdims=True)
            e = np.where(np.isneginf(mx), 0, np.exp(s - np.where(np.isneginf(mx), 0, mx)))
            den = e.sum(axis=1, keepdims=True)
            den1 = np.where(den == 0, 1, den)
            out[i3, :, h] = e @ vf / den1
            vis = e > 0
            rel_p = 2 * np.where(vis, ds, 0).max(axis=1, keepdims=True) + 8 * U32   # each weight's relative error
            mag = e @ np.abs(vf) / den1                                             # sum of |p v| / sum of p
            bound[i3, :, h] = (2 * rel_p + (n_kv + 8) * U32) * mag
    return out, bound


def _attend(q, k, v, mask, scale, max_bias, softcap, tiles):
    saved = A.USE_TILES
    A.USE_TILES = tiles
    try:
        out = np.full((q.shape[0], q.shape[2], q.shape[1], v.shape[3]), np.nan, np.float32)
        sc = np.float32(scale / softcap) if softcap else np.float32(scale)
        A._attend_blas(q, k.astype(np.float32), v.astype(np.float32), mask, out, sc, softcap,
                       alibi_slopes(q.shape[1], max_bias, np.float32), A._NO_SINKS)
        return out
    finally:
        A.USE_TILES = saved


@pytest.mark.parametrize("shape", [
    (4, 1, 256, 512, 512),                  # Gemma 3's heads: q read in place (one KV head)
    (9, 3, 64, 512, 512),                   # SmolLM2's: each chunk's rows gathered
    (4, 1, 64, 200, 300),                   # a prompt after 100 cached cells, a last chunk of 72 queries
    (6, 2, 32, 130, 130, 1, "window"),      # a sliding window: spans that start after cell 0
    (4, 2, 64, 100, 100, 2, "holes"),       # two sequences' batches, fully masked rows
    (4, 1, 64, 70, 70, 1, "none"),          # no mask
    (4, 4, 32, 96, 96, 1, "causal", 4),     # a mask per head
])
@pytest.mark.parametrize("max_bias,softcap", [(0.0, 0.0), (0.0, 3.0), (8.0, 0.0)])
def test_tiles_match_softmax_attention(shape, max_bias, softcap):
    rng = np.random.default_rng(sum(shape[:5]))
    q, k, v, mask = _case(rng, *shape)
    ref, bound = _reference(q, k, v, mask, 0.125, max_bias, softcap)
    # the tiles, and the numpy path they replace (the same products in other blockings): each within the bound of
    # float32 arithmetic of the float64 statement, whatever order the BLAS on this CPU sums in
    for tiles in (True, False):
        out = _attend(q, k, v, mask, 0.125, max_bias, softcap, tiles)
        assert not np.isnan(out).any()
        err = np.abs(out - ref)
        assert (err <= bound).all(), f"tiles={tiles}: error {err.max():.3g}, {(err / bound).max():.2f}x the bound"
        if len(shape) > 5 and shape[5] == "holes":
            assert not out[:, 40:80].any()


def test_sub_spans_follow_the_mask():
    i = np.arange(100)[:, None]
    j = np.arange(160)[None, :]
    vis = (j <= i + 60) & (j > i - 20)                  # a window of 80 cells, 60 cached
    vis[32:64] = False                                   # sub-block 1 sees nothing
    mask = np.where(vis, 0.0, -np.inf).astype(np.float32)[None, None]
    lo, hi = A._sub_spans(mask, 100, 160)
    assert lo.tolist() == [[0, 0, 45, 77]]
    assert hi.tolist() == [[92, 0, 156, 160]]


def test_sub_spans_on_random_masks():
    # the scans go sixteen cells per compare (simd.v16_mask_ne) and finish one by one: any sizes, any patterns
    rng = np.random.default_rng(5)
    for _ in range(200):
        n_q, n_kv = int(rng.integers(1, 90)), int(rng.integers(1, 200))
        vis = rng.random((2, 2, n_q, n_kv)) < rng.choice([0.0, 0.02, 0.3])
        mask = np.where(vis, rng.standard_normal(vis.shape), -np.inf).astype(np.float32)
        lo, hi = A._sub_spans(mask, n_q, n_kv)
        for a in range(2):
            for j in range((n_q + A.SUB - 1) // A.SUB):
                idx = np.flatnonzero(vis[a, :, j * A.SUB:(j + 1) * A.SUB].any(axis=(0, 1)))
                assert (lo[a, j], hi[a, j]) == ((idx[0], idx[-1] + 1) if idx.size else (0, 0))
