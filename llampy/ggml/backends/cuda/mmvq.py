"""Integer decode kernels of the CUDA backend (ggml-cuda's mmvq): one activation row times a block-format matrix.

The activation row is quantized once per product (``quantize_act``) to int8 in the weight's dot type — blocks of
32 with an F16-rounded scale (Q8_0/Q8_1) or of 256 with a float32 scale (Q8_K), as llama.cpp's CPU quantizers
round — with the integer sums of every 16 values beside it. The products then run on whole 32-bit words: a word
of weight nibbles masked with 0x0F0F0F0F is four int8 lanes, multiplied with four int8 activations and summed by
one ``dp4a`` instruction; the integer sums of a block meet the float scales once per block (the minimums and the
formats' offsets through the activation sums). This is the arithmetic of ggml's vec_dot_<type>_q8 on the CPU:
integer sums per block are exact, so the GPU's products are the CPU's up to the float32 order of the block sums.

Each program takes BN rows and walks K in chunks of SB blocks, loading a [BN, SB, words] tile per step (enough
bytes in flight to fill the memory system without splitting K, so a product is two launches: quantize, multiply).
Formats whose blocks are not 4-byte aligned (Q6_K: 210 bytes, Q4_0: 18, Q8_0: 34) read their words as two 16-bit
halves. Under ``TRITON_INTERPRET=1`` (CI, no GPU) ``dp4a`` is spelled out in shifts (``ASM=False``).
"""
from __future__ import annotations

import triton
import triton.language as tl

from ...types import GGMLType as T
from .kernels import _quantize_act_blocks

Q4_0: tl.constexpr = tl.constexpr(int(T.Q4_0))
Q4_1: tl.constexpr = tl.constexpr(int(T.Q4_1))
Q8_0: tl.constexpr = tl.constexpr(int(T.Q8_0))


@triton.jit
def _dp4a(a, b, c, ASM: tl.constexpr):
    """c + the sum over the four bytes of a * b (int32 words read as four signed int8 lanes)."""
    if ASM:
        return tl.inline_asm_elementwise("dp4a.s32.s32 $0, $1, $2, $3;", "=r,r,r,r", [a, b, c], dtype=tl.int32,
                                         is_pure=True, pack=1)
    else:
        s = c
        for i in tl.static_range(4):
            s += ((a << (24 - 8 * i)) >> 24) * ((b << (24 - 8 * i)) >> 24)
        return s




@triton.jit
def quantize_act(x, xq, xd, xs, K, G: tl.constexpr):
    """Block b of the row x (float32, K values; G = 32: Q8_0/Q8_1, G = 256: Q8_K) to int8 xq, its scale xd[b]
    (float32), and the integer sums of its groups of 16 in xs[b * G / 16 + i] (kernels._quantize_act_blocks)."""
    b = tl.program_id(0)
    ks = b * G + tl.arange(0, G)
    v = tl.load(x + ks, mask=ks < K, other=0.0)
    _quantize_act_blocks(tl.reshape(v, [1, G]), 1, xq + b * G, xd + b, xs + b * (G // 16), G)


@triton.jit
def _word16(p):
    """The 32-bit words at the 2-byte aligned uint8 pointers p, from two 16-bit loads."""
    p16 = p.to(tl.pointer_type(tl.int16))
    lo = tl.load(p16).to(tl.int32) & 0xFFFF
    hi = tl.load(p16 + 1).to(tl.int32)
    return lo | (hi << 16)


@triton.jit
def _f16(p):
    return tl.load(p.to(tl.pointer_type(tl.float16))).to(tl.float32)


@triton.jit
def _q4k_scale(p, g):
    """Q4_K's 6-bit scale of groups g (0..7) of the 12 bytes at p + 4 (p uint8 pointers, g broadcast with p)."""
    lo = g < 4
    a = tl.load(p + 4 + tl.where(lo, g, g - 4)).to(tl.int32)
    b = tl.load(p + 8 + g).to(tl.int32)                  # s[g + 4]
    return tl.where(lo, a & 63, (b & 15) | ((a >> 6) << 4))


@triton.jit
def _q4k_min(p, g):
    lo = g < 4
    b = tl.load(p + 8 + g).to(tl.int32)                  # s[g + 4]
    c = tl.load(p + 4 + g).to(tl.int32)                  # s[g] (its top bits hold min g's for g >= 4)
    return tl.where(lo, b & 63, (b >> 4) | ((c >> 6) << 4))


@triton.jit
def mmvq_q4_k(w, xq, xd, xs, y, N, K, sw, BN: tl.constexpr, SB: tl.constexpr, ASM: tl.constexpr):
    """y[r] = Q4_K row r . x (x as Q8_K): per superblock 32 words of nibbles (word 8c + j: bytes 4(8c + j).. of
    qs; its low nibbles the values 64c + 4j + 0..3, of group 2c; high nibbles + 32, group 2c + 1), summed per
    group, then d * sum(scale * isum) - dmin * sum(min * xsum), times the activation's scale. Tiles are
    [BN, SB, 4, 8] from the start (pointers cast to words before the offsets: 16-byte loads, no reshapes)."""
    rows = tl.program_id(0) * BN + tl.arange(0, BN)
    rowp = w + tl.minimum(rows, N - 1).to(tl.int64) * sw                  # [BN]
    nsb = K // 256
    si = tl.arange(0, SB)
    ci = tl.arange(0, 4)
    ji = tl.arange(0, 8)
    wo = (8 * ci[:, None] + ji[None, :])[None, None, :, :]                 # [1, 1, 4, 8] word of qs
    xw = (16 * ci[:, None] + ji[None, :])[None, :, :]                      # [1, 4, 8] word of the x superblock
    x32 = xq.to(tl.pointer_type(tl.int32))
    acc = tl.zeros([BN, SB], tl.float32)
    for s0 in range(0, nsb, SB):
        sb = s0 + si
        ok = sb < nsb
        sbc = tl.minimum(sb, nsb - 1)
        base = rowp[:, None] + sbc[None, :] * 144                            # [BN, SB]
        wq = tl.load((base + 16).to(tl.pointer_type(tl.int32))[:, :, None, None] + wo)
        xp = x32 + sbc[:, None, None] * 64 + xw                              # [SB, 4, 8]
        gl = tl.sum(_dp4a(wq & 0x0F0F0F0F, tl.load(xp)[None], tl.zeros_like(wq), ASM), axis=3)   # groups 2c
        gh = tl.sum(_dp4a((wq >> 4) & 0x0F0F0F0F, tl.load(xp + 8)[None], tl.zeros_like(wq), ASM), axis=3)
        b3 = base[:, :, None]
        g_even = 2 * ci[None, None, :]
        isum = tl.sum(_q4k_scale(b3, g_even) * gl + _q4k_scale(b3, g_even + 1) * gh, axis=2)
        xso = sbc[:, None] * 16 + 4 * ci[None, :]                           # [SB, 4]: sums of 16 of group 2c
        xe = tl.load(xs + xso) + tl.load(xs + xso + 1)
        xo_ = tl.load(xs + xso + 2) + tl.load(xs + xso + 3)
        msum = tl.sum(_q4k_min(b3, g_even) * xe[None, :, :] + _q4k_min(b3, g_even + 1) * xo_[None, :, :], axis=2)
        dx = tl.load(xd + sbc)[None, :]
        part = dx * (_f16(base) * isum.to(tl.float32)) - dx * (_f16(base + 2) * msum.to(tl.float32))
        acc += tl.where(ok[None, :], part, 0.0)
    tl.store(y + rows, tl.sum(acc, axis=1), mask=rows < N)


@triton.jit
def _q6k_quarter(wa, wb, wh, i: tl.constexpr):
    """Quarter i (0..3) of a Q6_K word slot as four 6-bit lanes: low or high nibbles of ql word A (quarters 0, 2)
    or B (1, 3), with bits 2i, 2i + 1 of each qh byte on top."""
    if i == 0:
        return (wa & 0x0F0F0F0F) | ((wh & 0x03030303) << 4)
    elif i == 1:
        return (wb & 0x0F0F0F0F) | (((wh >> 2) & 0x03030303) << 4)
    elif i == 2:
        return ((wa >> 4) & 0x0F0F0F0F) | (((wh >> 4) & 0x03030303) << 4)
    else:
        return ((wb >> 4) & 0x0F0F0F0F) | (((wh >> 6) & 0x03030303) << 4)


@triton.jit
def mmvq_q6_k(w, xq, xd, xs, y, N, K, sw, BN: tl.constexpr, SB: tl.constexpr, ASM: tl.constexpr):
    """y[r] = Q6_K row r . x (x as Q8_K). Word slot j (0..15) of a superblock: half n = j // 8, l = 4 (j % 8);
    A = ql[64n + l..], B = ql[64n + 32 + l..], H = qh[32n + l..]; their four 6-bit quarters are the values
    128n + 32i + l (i = 0..3). Group 8n + 2i + h (16 values) meets scale[8n + 2i + h]; the offset 32 leaves
    through the activation sums of 16."""
    rows = tl.program_id(0) * BN + tl.arange(0, BN)
    rowp = w + tl.minimum(rows, N - 1).to(tl.int64) * sw
    nsb = K // 256
    ji = tl.arange(0, 16)
    si = tl.arange(0, SB)
    gi = tl.arange(0, 4)                                   # (n, h) = (g // 2, g % 2)
    x32 = xq.to(tl.pointer_type(tl.int32))
    acc = tl.zeros([BN, SB], tl.float32)
    off_a = 64 * (ji // 8) + 4 * (ji % 8)                  # [16] byte offsets in ql
    off_h = 128 + 32 * (ji // 8) + 4 * (ji % 8)
    for s0 in range(0, nsb, SB):
        sb = s0 + si
        ok = sb < nsb
        sbc = tl.minimum(sb, nsb - 1)
        base = rowp[:, None] + sbc[None, :] * 210
        b3 = base[:, :, None]
        wa = _word16(b3 + off_a[None, None, :])
        wb = _word16(b3 + off_a[None, None, :] + 32)
        wh = _word16(b3 + off_h[None, None, :])
        xbase = sbc[:, None] * 64 + 32 * (ji // 8)[None, :] + (ji % 8)[None, :]   # [SB, 16], + 8i for quarter i
        isum = tl.zeros([BN, SB], tl.int32)
        for i in tl.static_range(4):
            q = _q6k_quarter(wa, wb, wh, i)
            xw = tl.load(x32 + xbase + 8 * i)[None, :, :]
            p = _dp4a(q, xw, tl.zeros_like(q), ASM)
            g = tl.sum(tl.reshape(p, [BN, SB, 4, 4]), axis=3)                   # [BN, SB, 4]: group (n, h)
            gidx = 8 * (gi // 2) + 2 * i + (gi % 2)                             # [4]
            sc = tl.load((b3 + 192 + gidx[None, None, :]).to(tl.pointer_type(tl.int8))).to(tl.int32)
            xsum = tl.load(xs + sbc[:, None] * 16 + gidx[None, :])[None, :, :]
            isum += tl.sum(sc * (g - 32 * xsum), axis=2)
        part = tl.load(xd + sbc)[None, :] * (_f16(base + 208) * isum.to(tl.float32))
        acc += tl.where(ok[None, :], part, 0.0)
    tl.store(y + rows, tl.sum(acc, axis=1), mask=rows < N)


@triton.jit
def mmvq_q32(w, xq, xd, xs, y, N, K, sw, TYPE: tl.constexpr, BN: tl.constexpr, SB: tl.constexpr,
             ASM: tl.constexpr):
    """y[r] = row r . x for the 32-value formats (x as Q8_0 / Q8_1): Q4_0 (18 bytes: d, 16 nibble bytes; value
    q - 8), Q4_1 (20 bytes: d, m, nibbles; value d q + m) and Q8_0 (34 bytes: d, 32 int8). Nibble word j (0..3):
    low nibbles the values 4j..4j+3, high nibbles 16 + 4j..; Q8_0 word j the values 4j..4j+3."""
    rows = tl.program_id(0) * BN + tl.arange(0, BN)
    rowp = w + tl.minimum(rows, N - 1).to(tl.int64) * sw
    nb = K // 32
    si = tl.arange(0, SB)
    x32 = xq.to(tl.pointer_type(tl.int32))
    acc = tl.zeros([BN, SB], tl.float32)
    for s0 in range(0, nb, SB):
        sb = s0 + si
        ok = sb < nb
        sbc = tl.minimum(sb, nb - 1)
        dx = tl.load(xd + sbc)[None, :]
        if TYPE == Q8_0:
            j = tl.arange(0, 8)
            base = rowp[:, None] + sbc[None, :] * 34
            wq = _word16(base[:, :, None] + 2 + 4 * j[None, None, :])
            xw = tl.load(x32 + sbc[:, None] * 8 + j[None, :])[None, :, :]
            isum = tl.sum(_dp4a(wq, xw, tl.zeros_like(wq), ASM), axis=2)
            part = dx * (_f16(base) * isum.to(tl.float32))
        else:
            j = tl.arange(0, 4)
            if TYPE == Q4_1:
                base = rowp[:, None] + sbc[None, :] * 20
                wq = tl.load((base[:, :, None] + 4 + 4 * j[None, None, :]).to(tl.pointer_type(tl.int32)))
            else:
                base = rowp[:, None] + sbc[None, :] * 18
                wq = _word16(base[:, :, None] + 2 + 4 * j[None, None, :])
            xl = tl.load(x32 + sbc[:, None] * 8 + j[None, :])[None, :, :]
            xh = tl.load(x32 + sbc[:, None] * 8 + 4 + j[None, :])[None, :, :]
            isum = tl.sum(_dp4a(wq & 0x0F0F0F0F, xl, tl.zeros_like(wq), ASM)
                          + _dp4a((wq >> 4) & 0x0F0F0F0F, xh, tl.zeros_like(wq), ASM), axis=2)
            xsum = tl.load(xs + 2 * sbc) + tl.load(xs + 2 * sbc + 1)            # [SB]
            if TYPE == Q4_1:    # ggml's Q8_1 keeps s = d * sum(q) as F16
                s = (tl.load(xd + sbc) * xsum.to(tl.float32)).to(tl.float16).to(tl.float32)
                part = dx * (_f16(base) * isum.to(tl.float32)) + _f16(base + 2) * s[None, :]
            else:
                part = dx * (_f16(base) * (isum - 8 * xsum[None, :]).to(tl.float32))
        acc += tl.where(ok[None, :], part, 0.0)
    tl.store(y + rows, tl.sum(acc, axis=1), mask=rows < N)


# The same products with the accumulation kept per tile element: every (row, block, word) of the tile adds its
# own float partial to an accumulator of the tile's shape, and the tile is reduced once, after the last step.
# The kernels above reduce inside the loop (sums over words and groups), which costs warp shuffles, shared memory
# and barriers on every step (ggml's mmvq reduces once per row too). The offsets and minimums need no sums of 16:
# dp4a against a word of repeated bytes sums a word's four activations.

@triton.jit
def mmvq_q4_k_e(w, xq, xd, xs, y, N, K, sw, BN: tl.constexpr, SB: tl.constexpr, ASM: tl.constexpr):
    """mmvq_q4_k with a per-element accumulator (tile [BN, SB, 4, 8] as there)."""
    rows = tl.program_id(0) * BN + tl.arange(0, BN)
    rowp = w + tl.minimum(rows, N - 1).to(tl.int64) * sw
    nsb = K // 256
    si = tl.arange(0, SB)
    ci = tl.arange(0, 4)
    ji = (tl.arange(0, 8) * 5) % 8      # words in an order Triton cannot prove contiguous: 4-byte loads, one layout
    wo = (8 * ci[:, None] + ji[None, :])[None, None, :, :]
    xw = (16 * ci[:, None] + ji[None, :])[None, None, :, :]                # [1, 1, 4, 8]
    g = 2 * ci[None, None, :, None] + 0 * ji[None, None, None, :]          # [1, 1, 4, 8]: scale loads of the
    # tile's own shape (threads of one superblock read the same bytes), so the loop keeps one layout
    x32 = xq.to(tl.pointer_type(tl.int32))
    ones = tl.full([1, 1, 1, 1], 0x01010101, tl.int32)
    acc = tl.zeros([BN, SB, 4, 8], tl.float32)
    for s0 in range(0, nsb, SB):
        sb = s0 + si
        ok = sb < nsb
        sbc = tl.minimum(sb, nsb - 1)
        base = rowp[:, None] + sbc[None, :] * 144                            # [BN, SB]
        wq = tl.load((base + 16).to(tl.pointer_type(tl.int32))[:, :, None, None] + wo)
        xp = x32 + sbc[None, :, None, None] * 64 + xw                        # [1, SB, 4, 8]
        xl = tl.load(xp)
        xh = tl.load(xp + 8)
        lo = _dp4a(wq & 0x0F0F0F0F, xl, tl.zeros_like(wq), ASM)
        hi = _dp4a((wq >> 4) & 0x0F0F0F0F, xh, tl.zeros_like(wq), ASM)
        sl = _dp4a(ones, xl, tl.zeros_like(xl), ASM)
        sh = _dp4a(ones, xh, tl.zeros_like(xh), ASM)
        b4 = base[:, :, None, None]
        isum = _q4k_scale(b4, g) * lo + _q4k_scale(b4, g + 1) * hi
        msum = _q4k_min(b4, g) * sl + _q4k_min(b4, g + 1) * sh
        dx = tl.load(xd + sbc)[None, :]
        dd = tl.where(ok[None, :], dx * _f16(base), 0.0)[:, :, None, None]
        dm = tl.where(ok[None, :], dx * _f16(base + 2), 0.0)[:, :, None, None]
        acc += dd * isum.to(tl.float32) - dm * msum.to(tl.float32)
    tl.store(y + rows, tl.sum(tl.sum(tl.sum(acc, axis=3), axis=2), axis=1), mask=rows < N)


@triton.jit
def mmvq_q6_k_e(w, xq, xd, xs, y, N, K, sw, BN: tl.constexpr, SB: tl.constexpr, ASM: tl.constexpr):
    """mmvq_q6_k with a per-element accumulator: tile [BN, SB, 16] of word slots, the four quarters of a slot
    summed in integers (scale x (q - 32) . x, the offset through dp4a of 0x20202020). Every index is built at the
    tile's full shape, so that the loop runs in one register layout (no conversions through shared memory)."""
    r3 = tl.arange(0, BN)[:, None, None]
    s3 = tl.arange(0, SB)[None, :, None]
    j3 = tl.arange(0, 16)[None, None, :]
    z3 = r3 * 0 + s3 * 0 + j3 * 0
    rows3 = tl.program_id(0) * BN + r3 + z3
    rowp = w + tl.minimum(rows3, N - 1).to(tl.int64) * sw
    nsb = K // 256
    x32 = xq.to(tl.pointer_type(tl.int32))
    off_a = 64 * (j3 // 8) + 4 * (j3 % 8)                  # byte offsets in ql
    off_h = 128 + 32 * (j3 // 8) + 4 * (j3 % 8)
    gbase = 8 * (j3 // 8) + (j3 % 8) // 4                  # group of quarter i: gbase + 2i
    xoff = 32 * (j3 // 8) + (j3 % 8)
    c32 = tl.full([BN, SB, 16], 0x20202020, tl.int32)
    acc = tl.zeros([BN, SB, 16], tl.float32)
    for s0 in range(0, nsb, SB):
        sb = s0 + s3 + z3
        ok = sb < nsb
        sbc = tl.minimum(sb, nsb - 1)
        base = rowp + sbc * 210
        wa = _word16(base + off_a)
        wb = _word16(base + off_a + 32)
        wh = _word16(base + off_h)
        xbase = sbc * 64 + xoff                             # + 8i for quarter i
        isum = tl.zeros([BN, SB, 16], tl.int32)
        for i in tl.static_range(4):
            q = _q6k_quarter(wa, wb, wh, i)
            xw = tl.load(x32 + xbase + 8 * i)
            p = _dp4a(q, xw, tl.zeros_like(q), ASM) - _dp4a(c32, xw, tl.zeros_like(xw), ASM)
            sc = tl.load((base + 192 + gbase + 2 * i).to(tl.pointer_type(tl.int8))).to(tl.int32)
            isum += sc * p
        dd = tl.load(xd + sbc) * _f16(base + 208)
        acc += tl.where(ok, dd, 0.0) * isum.to(tl.float32)
    tl.store(y + tl.program_id(0) * BN + tl.arange(0, BN), tl.sum(tl.sum(acc, axis=2), axis=1),
             mask=tl.program_id(0) * BN + tl.arange(0, BN) < N)


@triton.jit
def mmvq_q32_e(w, xq, xd, xs, y, N, K, sw, TYPE: tl.constexpr, BN: tl.constexpr, SB: tl.constexpr,
               ASM: tl.constexpr):
    """mmvq_q32 with a per-element accumulator (tile [BN, SB, words], every index at the full shape as in
    mmvq_q6_k_e); Q4_0's offset 8 through dp4a of 0x08080808, Q4_1's m * s term on word 0 of each block."""
    NW: tl.constexpr = 8 if TYPE == Q8_0 else 4
    r3 = tl.arange(0, BN)[:, None, None]
    s3 = tl.arange(0, SB)[None, :, None]
    j3 = (tl.arange(0, NW)[None, None, :] * 3) % NW       # an order Triton cannot prove contiguous: 4-byte loads
    z3 = r3 * 0 + s3 * 0 + j3 * 0
    rows3 = tl.program_id(0) * BN + r3 + z3
    rowp = w + tl.minimum(rows3, N - 1).to(tl.int64) * sw
    nb = K // 32
    x32 = xq.to(tl.pointer_type(tl.int32))
    acc = tl.zeros([BN, SB, NW], tl.float32)
    for s0 in range(0, nb, SB):
        sb = s0 + s3 + z3
        ok = sb < nb
        sbc = tl.minimum(sb, nb - 1)
        dx = tl.load(xd + sbc)
        xo = sbc * 8 + j3
        if TYPE == Q8_0:
            base = rowp + sbc * 34
            wq = _word16(base + 2 + 4 * j3)
            isum = _dp4a(wq, tl.load(x32 + xo), tl.zeros_like(wq), ASM)
            acc += tl.where(ok, dx * _f16(base), 0.0) * isum.to(tl.float32)
        else:
            xl = tl.load(x32 + xo)
            xh = tl.load(x32 + xo + 4)
            if TYPE == Q4_1:
                base = rowp + sbc * 20
                wq = tl.load((base + 4 + 4 * j3).to(tl.pointer_type(tl.int32)))
            else:
                base = rowp + sbc * 18
                wq = _word16(base + 2 + 4 * j3)
            isum = _dp4a(wq & 0x0F0F0F0F, xl, tl.zeros_like(wq), ASM)
            isum = _dp4a((wq >> 4) & 0x0F0F0F0F, xh, isum, ASM)
            dd = tl.where(ok, dx * _f16(base), 0.0)
            if TYPE == Q4_1:    # ggml's Q8_1 keeps s = d * sum(q) as F16; m * s joins on word 0
                xsum = tl.load(xs + 2 * sbc) + tl.load(xs + 2 * sbc + 1)
                s = (dx * xsum.to(tl.float32)).to(tl.float16).to(tl.float32)
                ms = tl.where(ok & (j3 == 0), _f16(base + 2) * s, 0.0)
                acc += dd * isum.to(tl.float32) + ms
            else:
                c8 = tl.full([BN, SB, NW], 0x08080808, tl.int32)
                off = _dp4a(c8, xl, tl.zeros_like(xl), ASM)
                off = _dp4a(c8, xh, off, ASM)
                acc += dd * (isum - off).to(tl.float32)
    tl.store(y + tl.program_id(0) * BN + tl.arange(0, BN), tl.sum(tl.sum(acc, axis=2), axis=1),
             mask=tl.program_id(0) * BN + tl.arange(0, BN) < N)


# the kernel of each format, the activation's block size, and the launch shape (rows, blocks per step, warps):
# chosen on an H200 by gpu_matvec.py --small-grid's timings summed over a 7B layer's shapes (.devcarry-style
# runs; gpu_bench.py --mmvq-shapes). Small programs won everywhere: 1-2 rows and one or two warps each, so that
# many programs keep loads in flight on every multiprocessor (7B decode, tok/s: Q4_K_M 185 -> 224, Q4_0 195 ->
# 243, Q8_0 154 -> 226 against 4-8 rows of 4 warps). Q4_1 takes Q4_0's.
KERNELS = {T.Q4_K: (mmvq_q4_k, 256), T.Q6_K: (mmvq_q6_k, 256), T.Q4_0: (mmvq_q32_e, 32), T.Q4_1: (mmvq_q32_e, 32),
           T.Q8_0: (mmvq_q32, 32)}
TYPE_ARG = frozenset({T.Q4_0, T.Q4_1, T.Q8_0})
SHAPES = {T.Q4_K: (2, 8, 1), T.Q6_K: (2, 8, 1), T.Q4_0: (1, 16, 2), T.Q4_1: (1, 16, 2), T.Q8_0: (1, 16, 1)}
# each format's two kernels: "r" reduces in the loop, "e" keeps a per-element accumulator (gpu_matvec.py times
# both; gpu_bench.py --mmvq-shapes takes a choice as the fourth entry of a shape)
VARIANTS = {T.Q4_K: {"r": mmvq_q4_k, "e": mmvq_q4_k_e}, T.Q6_K: {"r": mmvq_q6_k, "e": mmvq_q6_k_e},
            T.Q4_0: {"r": mmvq_q32, "e": mmvq_q32_e}, T.Q4_1: {"r": mmvq_q32, "e": mmvq_q32_e},
            T.Q8_0: {"r": mmvq_q32, "e": mmvq_q32_e}}


def choose(t: T, shape) -> None:
    """Set format t's launch shape (rows, blocks per step, warps[, variant]) and with a variant its kernel."""
    SHAPES[t] = tuple(shape[:3])
    if len(shape) > 3:
        KERNELS[t] = (VARIANTS[t][shape[3]], KERNELS[t][1])
