"""Five decode steps of four sequences (prompt pieces of 5-30 tokens beside single generated tokens), run by a
Context with and without pad_ubatch: the tests of padded prompt pieces compare the two bit for bit."""
from __future__ import annotations

import numpy as np

from llampy.llama.batch import Batch
from llampy.llama.context import Context

# the padded (tokens, outputs) shapes the steps run on: 36 tokens and 3 outputs -> (40, 4); 16 and 4; 33 and 4 ->
# (40, 4); 10 and 2 -> (16, 2); the last step decodes one token of each sequence, (4, 4)
PADDED_SHAPES = {(4, 4), (40, 4), (16, 4), (16, 2)}


def steps():
    rng = np.random.default_rng(0)
    p = [rng.integers(100, 40000, n).tolist() for n in (11, 5, 20, 13, 30, 9)]
    return [[(0, p[0], 0), (1, p[1], 0), (2, p[2], 0)],
            [(0, [5], 11), (1, [6], 5), (2, [7], 20), (3, p[3], 0)],
            [(0, [8], 12), (1, [9], 6), (3, [10], 13), (2, p[4], 21)],
            [(1, p[5], 7), (0, [11], 13)],
            [(0, [12], 14), (1, [13], 16), (2, [14], 51), (3, [15], 14)]]


def run_steps(model, pad: bool, n_ctx: int, warm: bool = False):
    """Each step's logits (copied) and the context; the steps' (seq, tokens, first position) as one batch each,
    the last token of each piece an output. ``warm``: every graph the steps take reserved and run once first
    (Context.warm, as the server does while idle)."""
    ctx = Context(model, n_ctx=n_ctx, n_batch=n_ctx // 2, n_ubatch=96, n_seq_max=4, kv_pad_decode=n_ctx,
                  kv_unified=False, pad_ubatch=pad, max_graphs=16)
    ctx.reserve(4, 4)           # a first graph (it shows whether rows are computed apart)
    if warm:
        for t, o in sorted(PADDED_SHAPES):
            ctx.reserve(t, o)
        assert all(ctx.warm(key) for key in ctx.kept_shapes())
    outs = []
    for step in steps():
        toks, pos, seq, want = [], [], [], []
        for s, ts, p0 in step:
            toks += ts
            pos += range(p0, p0 + len(ts))
            seq += [(s,)] * len(ts)
            want += [False] * (len(ts) - 1) + [True]
        ctx.decode(Batch(np.array(toks, np.int32), np.array(pos, np.int32), seq, np.array(want)))
        outs.append(ctx.get_logits().copy())
    return outs, ctx


def assert_same_bits(plain, padded):
    for a, b in zip(plain, padded):
        assert a.shape == b.shape and np.array_equal(a.view(np.uint32), b.view(np.uint32))
