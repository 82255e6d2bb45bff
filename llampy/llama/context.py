"""The inference context: ``decode(batch)`` over a KV cache, split into micro-batches, with graphs kept per shape.

Each micro-batch: find cache cells, pick (or build once) the graph for (n_tokens, n_outputs, n_kv), set its
inputs — token ids, positions, cache rows, masks, output rows — and let the scheduler run it. Logits (or
embeddings) of the positions that asked for them are kept until the next decode.
"""
from __future__ import annotations

import io
from collections import OrderedDict

import numpy as np

from .. import tuning
from ..ggml import ops
from ..ggml.backend import tensor_get, tensor_host_view, tensor_set
from ..ggml.graph import Graph
from ..ggml.sched import Scheduler
from ..ggml.tensor import Tensor
from ..ggml.types import GGMLType
from .batch import Batch
from .graph import build_graph
from .kv_cache import KV_PAD, CacheFull as _CacheFull, KVCache
from .memory import create_memory

POOLING = ("none", "mean", "last", "cls", "rank")
# the cache types llama.cpp offers (common/arg.cpp's kv_cache_types); each backend says which it can hold
KV_CACHE_TYPES = (GGMLType.F32, GGMLType.F16, GGMLType.BF16, GGMLType.Q8_0, GGMLType.Q4_0, GGMLType.Q4_1,
                  GGMLType.IQ4_NL, GGMLType.Q5_0, GGMLType.Q5_1)

# Padded micro-batches (Context's pad_ubatch): one of fewer tokens than PAD_BELOW (flash attention's query-by-query
# path, kv_cache.MIX_BELOW's shared micro-batches) that is not a decode step of single tokens is padded to a multiple
# of PAD_STEP tokens and a power of two of outputs, so that a server's prompt pieces reuse a few graphs instead of
# building one (~60-130 ms of CPU) per new (tokens, outputs) pair. The padding repeats the last token (same id,
# position, sequence and cell: it writes the cell's values again, bit for bit) and the last output row; neither is
# returned. That keeps every real row's bits only where each row is computed apart from the others: the products
# of the 32-value formats (dot_q32: every kernel form, at any row count, sums a row in ggml's vec_dot order; Q4_0's
# repacked rows, dot_blocks: one chain per pair at every batch size, as llama.cpp's gemv and gemm), and ops that work
# row by row. A graph with anything else (another weight format, an op outside this list) is not padded.
PAD_BELOW = 64
PAD_STEP = 8
_ROW_EXACT_TYPES = frozenset({GGMLType.Q4_0, GGMLType.Q4_1, GGMLType.Q5_0, GGMLType.Q5_1, GGMLType.Q8_0})
# IQ4_NL and MXFP4 where llama.cpp repacks the rows (a multiple of 8, dot_blocks.repacked_rows): their gemv's chain
# at every batch size; their other rows (vec_dot's) are not padded
_ROW_EXACT_REPACKED = frozenset({GGMLType.IQ4_NL, GGMLType.MXFP4})
_ROW_OPS = frozenset({"NONE", "ADD", "MUL", "SCALE", "RMS_NORM", "NORM", "ROPE", "SET_ROWS", "GET_ROWS", "CPY",
                      "CONT", "RESHAPE", "VIEW", "PERMUTE", "TRANSPOSE", "SWIGLU", "GEGLU", "SILU", "GELU",
                      "FLASH_ATTN_EXT", "MUL_MAT"})


def _whole(idx, n: int) -> bool:
    """Whether the index array ``idx`` is 0, 1, ..., n - 1."""
    return len(idx) == n and (n == 1 and idx[0] == 0 or n > 1 and np.array_equal(idx, np.arange(n)))


def _rows_apart(graph: Graph) -> bool:
    """Whether each token row of the graph is computed apart from the others (see PAD_BELOW)."""
    for node in graph.nodes:
        if node.op.name not in _ROW_OPS:
            return False
        if node.op.name == "MUL_MAT":
            w = node.src[0]
            t = GGMLType(w.type)
            if w.op.name != "NONE" or w.view_src is not None:
                return False
            if t not in _ROW_EXACT_TYPES and not (t in _ROW_EXACT_REPACKED and w.ne[1] % 8 == 0):
                return False
    return True


class ContextError(ValueError):
    pass


class CacheFull(ContextError, _CacheFull):
    """The KV cache has no room for the batch; the cache is left as it was."""


class Context:
    def __init__(self, model, n_ctx: int | None = None, n_batch: int = 2048, n_ubatch: int = 512,
                 n_seq_max: int = 1, type_k=GGMLType.F16, type_v=GGMLType.F16, embeddings: bool = False,
                 pooling: str = "mean", max_graphs: int = 8, kv_pad: int = KV_PAD, kv_pad_decode: int | None = None,
                 kv_unified: bool = True, pad_ubatch: bool = False):
        hp = model.hparams
        self.model = model
        self.n_ctx = int(n_ctx or min(hp.n_ctx_train, 4096))
        if self.n_ctx <= 0:
            raise ContextError(f"n_ctx must be positive, got {self.n_ctx}")
        self.n_batch = min(int(n_batch), self.n_ctx)
        self.n_ubatch = min(int(n_ubatch), self.n_batch)
        self.n_seq_max = int(n_seq_max)
        self.embeddings = embeddings
        if pooling not in POOLING:
            raise ContextError(f"pooling must be one of {POOLING}, got {pooling!r}")
        self.pooling = pooling
        # an encoder (bert) attends within the micro-batch and keeps no cache (llama.cpp creates no memory for it)
        self.uses_cache = getattr(model.arch, "USES_KV_CACHE", True)
        if not self.uses_cache and not embeddings:
            raise ContextError(f"{hp.arch} is an encoder without a language-model head: create its context with "
                               f"embeddings=True")
        if pooling == "rank" and not getattr(model.arch, "RANK_HEAD", False):
            raise ContextError(f"pooling 'rank' needs a classification head, which {hp.arch} models do not have")
        if embeddings and pooling != "none":
            self.n_ubatch = self.n_batch  # a pooled sequence must be in one micro-batch
        # kv_unified=False (llama-server's default): one stream of n_ctx / n_seq_max cells per sequence, so that a
        # sequence's cells stay in position order and its results do not depend on the other sequences' traffic
        for b in {id(b): b for b in model.layer_backend}.values():   # a cache type the layer's device can write
            ok = getattr(b, "supports_kv_type", None)
            for t in (type_k, type_v):
                if ok is not None and not ok(GGMLType(t)):
                    can = [c.name.lower() for c in KV_CACHE_TYPES if ok(c)]
                    raise ContextError(f"a {GGMLType(t).name} KV cache is not supported on {b.name}, where layers of "
                                       f"this model run: use {', '.join(can)}"
                                       + (", or fewer GPU layers" if b is not model.cpu else ""))
        try:
            self.kv = create_memory(model, self.n_ctx, self.n_seq_max, type_k, type_v,
                                    n_stream=1 if kv_unified else self.n_seq_max)
        except ValueError as e:         # a cache the model's shapes cannot take (cache types, head sizes)
            if type(e) is not ValueError:
                raise
            raise ContextError(str(e)) from None
        self.sched = Scheduler(model.backends)
        self._graphs: OrderedDict = OrderedDict()
        self.max_graphs = max_graphs
        # n_kv (the cells a graph's attention reads) is rounded up to kv_pad: a graph is built per shape, so a
        # larger pad means fewer builds. Micro-batches of at most n_seq_max tokens (a decode step of every
        # sequence) may use a pad of their own: their attention walks only the visible cells, so a pad as large as
        # the cache costs them little, and their graphs then never change with the cache's fill. Prompt batches
        # convert and scan their mask whole, so they keep the small pad.
        self.kv_pad = max(1, int(kv_pad))
        self.kv_pad_decode = max(1, int(kv_pad_decode)) if kv_pad_decode else self.kv_pad
        self.n_graph_builds = 0
        # pad micro-batches below PAD_BELOW tokens (see PAD_BELOW; n_kv then padded as a decode step's), where the
        # first graph built shows every row computed apart (None: no graph yet)
        self.pad_ubatch = bool(pad_ubatch)
        self._rows_apart: bool | None = None
        self._logits = np.zeros((0, hp.n_vocab), np.float32)
        self._embd = np.zeros((0, hp.n_embd), np.float32)
        self._out_rows: dict[int, int] = {}   # batch index -> row of _logits/_embd
        self._seq_embd: dict[int, np.ndarray] = {}
        self._shift_graph = None
        self._views: dict = {}                # id(input) -> (input, buffer, offset, flat host view): _put
        self.loras: list = []                 # (LoraAdapter, scale) pairs applied by every graph (set_loras)
        # False: a token also sees the later cells of its sequence (llama_set_causal_attn; gemma3's image chunks)
        self.causal_attn = True

    def set_causal_attn(self, causal: bool) -> None:
        self.causal_attn = bool(causal)

    def set_loras(self, loras) -> None:
        """The LoRA adapters applied from the next decode on, as (LoraAdapter, scale) pairs (llama.cpp's
        llama_set_adapters_lora). Graphs are cached per adapter set and scales too (a server alternating between
        requests of two sets keeps both); a cached graph holds its adapters, so their ids stay unique."""
        self.loras = [(ad, float(s)) for ad, s in loras]

    def _key(self, n_tokens: int, n_outputs: int, n_kv: int, embd_input: bool = False) -> tuple:
        return ((n_tokens, n_outputs, n_kv, self.kv.n_seqs()) + (("embd",) if embd_input else ())
                + tuple((id(a), s) for a, s in self.loras))

    @property
    def n_vocab(self) -> int:
        return self.model.hparams.n_vocab

    # ------------------------------------------------------------------ graphs
    def _graph(self, n_tokens: int, n_outputs: int, n_kv: int, embd_input: bool = False):
        key = self._key(n_tokens, n_outputs, n_kv, embd_input)
        gc = self._graphs.get(key)
        if gc is not None:
            self._graphs.move_to_end(key)
            return gc
        gc = build_graph(self.model, self.kv, n_tokens, n_outputs, n_kv, self.embeddings, self.pooling,
                         loras=self.loras, embd_input=embd_input)
        self.n_graph_builds += 1
        if self._rows_apart is None:
            self._rows_apart = _rows_apart(gc.graph)
        # Graphs live long and hold most of the process's Python objects (a server's ~15 graphs: every full
        # collection walked them, 70-140 ms in the middle of a decode step). With the process tuning installed they
        # move into the collector's permanent generation; reference counting still frees them when evicted.
        tuning.after_graph_built()
        self._graphs[key] = gc
        if len(self._graphs) > self.max_graphs:
            _, old = self._graphs.popitem(last=False)
            self.sched.forget(old.graph)
        return gc

    def reserve(self, n_tokens: int, n_outputs: int) -> bool:
        """Build and plan, ahead of use, the graph a micro-batch of this shape would take with the cache as it is
        now (llama.cpp's graph_reserve): True if it was not there yet. A caller with idle time (the server) spends
        it here so that a first batch of a new shape does not wait for its graph."""
        n_tokens = min(max(1, int(n_tokens)), self.n_ubatch)
        n_outputs = min(max(1, int(n_outputs)), n_tokens)
        n_kv = self._n_kv(n_tokens)
        if self._key(n_tokens, n_outputs, n_kv) in self._graphs:
            return False
        self.sched.alloc_graph(self._graph(n_tokens, n_outputs, n_kv).graph)
        return True

    def kept_shapes(self) -> list:
        """The keys of the graphs this context keeps (for ``place``), least recently used first."""
        return list(self._graphs)

    def place(self, key) -> None:
        """Put the kept graph of ``key`` (if still kept) in its allocators' buffers as they are now. A graph placed
        before another one made a buffer grow is moved, and its plans bound again, at its next use; a caller with
        idle time calls this for every kept graph after reserving, so that no decode step pays for it (a server's
        decode shapes, reserved before the larger padded shapes, each took 30-100 ms at its first step)."""
        gc = self._graphs.get(key)
        if gc is not None:
            self.sched.alloc_graph(gc.graph)

    def warm(self, key) -> bool:
        """Run the kept graph of ``key`` once on placeholder tokens, then forget their cells: True if it ran. A
        graph's first run is slower than the later ones: each kernel it calls for argument types this process has
        not called it with yet is loaded from Numba's cache (or compiled), its buffers' pages are touched for the
        first time, and its plan binds its fast run at its second run (CPUBackend.graph_plan_compute: 15-80 ms of
        typing every kernel call's arguments), which ``Scheduler.settle`` does here after the run. Quiet, SmolLM2:
        the first run of a decode step of 1 / 8 / 32 slots 42 / 54 / 250 ms, its second 55 / 112 / 166, then 9 / 31
        / 125; a padded prompt piece of 56 tokens 184, 168, then 135-146. A caller with idle
        time (the server, after reserving and placing its graphs: llama.cpp runs its graphs at start-up) calls
        this so that no request does. Only on an empty KV cache (the cells are then left as they were, so where
        later batches' cells land does not change), and only shapes a batch of new tokens takes there as they
        are: a decode step's or a padded piece's (n_tokens tokens of n_outputs sequences), no embeddings input,
        no LoRA."""
        gc = self._graphs.get(key)
        if (gc is None or len(key) != 4 or not self.uses_cache or not isinstance(self.kv, KVCache)
                or self.embeddings or not self.causal_attn or self.kv.n_used()):
            return False
        n, n_out = int(key[0]), int(key[1])
        if not 1 <= n_out <= min(n, self.n_seq_max) or n > self.n_ubatch:
            return False
        # n_out - 1 sequences of one token, the last of the rest; each sequence's last token an output
        seqs = np.minimum(np.arange(n), n_out - 1)
        pos = np.maximum(np.arange(n) - (n_out - 1), 0).astype(np.int32)
        want = np.ones(n, bool)
        want[n_out - 1:-1] = False
        ub = Batch(np.zeros(n, np.int32), pos, [(int(s),) for s in seqs], want)
        heads = self.kv.heads.copy()
        try:
            if self._decode_ubatch(ub, np.flatnonzero(want), only=key) is None:
                return False
            self.sched.settle(gc.graph)
            return True
        finally:
            self.kv.clear()
            self.kv.heads[:] = heads

    def pad_shapes(self, max_outputs: int) -> list:
        """The (tokens, outputs) shapes padded micro-batches of up to ``max_outputs`` outputs take, less decode steps'
        (n, n): for a caller to reserve while idle; none when this context does not pad (or has no graph yet)."""
        if not (self.pad_ubatch and self._rows_apart):
            return []
        o_max = 1 << (max(int(max_outputs), 1) - 1).bit_length()
        sizes = sorted({min(t, PAD_BELOW - 1, self.n_ubatch) for t in range(PAD_STEP, PAD_BELOW + PAD_STEP,
                                                                            PAD_STEP)})
        return [(t, 1 << b) for t in sizes for b in range(o_max.bit_length()) if 1 << b < t]

    def _n_kv(self, n_tokens: int) -> int:
        small = n_tokens <= self.n_seq_max or (self.pad_ubatch and self._rows_apart and n_tokens < PAD_BELOW)
        pad = self.kv_pad_decode if small else self.kv_pad
        return self.kv.n_kv_for(self.kv.used_max_p1(), pad)

    # ------------------------------------------------------------------ decode
    def decode(self, batch: Batch) -> None:
        """Run the batch through the model, appending it to the cache. Raises CacheFull (and leaves the cache as it
        was) when there is no room, ContextError for a malformed batch."""
        n = len(batch)
        if n == 0:
            raise ContextError("decode: the batch is empty")
        if n > self.n_batch:
            raise ContextError(f"decode: {n} tokens exceed n_batch={self.n_batch}")
        try:
            batch.validate(self.n_vocab, self.n_seq_max)
        except ValueError as e:
            raise ContextError(f"decode: {e}") from None
        if batch.embd is not None and batch.embd.shape != (n, self.model.hparams.n_embd):
            raise ContextError(f"decode: embeddings of shape {tuple(batch.embd.shape)} for {n} tokens of width "
                               f"{self.model.hparams.n_embd}")
        if not self.causal_attn and n > self.n_ubatch:
            # every token must see the whole batch: llama.cpp refuses the same
            raise ContextError(f"decode: non-causal attention needs the batch's {n} tokens in one micro-batch, "
                               f"but n_ubatch is {self.n_ubatch}")
        try:
            if self.uses_cache:
                self.kv.check_room(batch.seq_id)
        except _CacheFull as e:
            raise CacheFull(f"{e} (n_ctx={self.n_ctx})") from None
        except ValueError as e:
            raise ContextError(f"decode: {e}") from None
        want = batch.logits.copy()
        if self.embeddings:
            want[:] = True
        n_out_total = int(want.sum())
        logits = None
        if not self.embeddings:
            self._logits = np.zeros((0, self.n_vocab), np.float32)
        # with pooling 'rank' the graph's per-token output is the classifier's scores
        width = self.model.hparams.n_cls_out if self.pooling == "rank" else self.model.hparams.n_embd
        self._embd = np.zeros((n_out_total, width), np.float32)
        self._out_rows = {}
        self._seq_embd = {}
        try:
            ubatches = self._split(batch)
        except ValueError as e:
            raise ContextError(f"decode: {e}") from None
        if len(ubatches) == 1 and not self.embeddings and _whole(ubatches[0], n):
            # one micro-batch that is the batch in its order (a decode step): no slicing, the rows as they come
            out_idx = np.flatnonzero(want)
            self._logits = self._decode_ubatch(batch, out_idx)
            self._out_rows = dict(zip(out_idx.tolist(), range(len(out_idx))))
            return
        rank = np.cumsum(want) - 1          # outputs keep the batch's order, however it is split
        for idx in ubatches:
            ub = Batch(batch.tokens[idx], batch.pos[idx], [batch.seq_id[i] for i in idx], batch.logits[idx],
                       None if batch.embd is None else batch.embd[idx], None if batch.mpos is None else batch.mpos[idx])
            out_idx = np.flatnonzero(want[idx])
            res = self._decode_ubatch(ub, out_idx)
            rows = rank[idx[out_idx]]
            for bi, r in zip(idx[out_idx], rows):
                self._out_rows[int(bi)] = int(r)
            if self.embeddings:
                self._embd[rows] = res
                if self.pooling != "none":
                    self._pool(ub, res)
            elif len(ubatches) == 1 and np.array_equal(rows, np.arange(n_out_total)):
                logits = res        # one micro-batch with its rows in the batch's order (a decode step): as it is
            else:
                if logits is None:
                    logits = np.empty((n_out_total, self.n_vocab), np.float32)
                logits[rows] = res
        if not self.embeddings:
            self._logits = logits if logits is not None else np.zeros((0, self.n_vocab), np.float32)

    def _split(self, batch: Batch) -> list:
        """The micro-batches of a batch, as index arrays: the memory's to choose (KVCache.split)."""
        return self.kv.split(batch, self.n_ubatch)

    def _pad_shape(self, ub: Batch, n_outputs: int) -> tuple | None:
        """(tokens, outputs) of the padded micro-batch's graph, or None when it is not padded (see PAD_BELOW)."""
        n = len(ub)
        if (not self.pad_ubatch or n >= PAD_BELOW or n_outputs == n or not self._rows_apart or self.loras
                or ub.embd is not None or ub.mpos is not None or self.embeddings or not self.causal_attn
                or not isinstance(self.kv, KVCache) or self.model.devices):
            return None
        from ..ggml.backends.cpu.matmul import DECODE_MAX_ROWS
        exact = getattr(self.model.cpu, "exact_max_rows", None)
        if min(DECODE_MAX_ROWS, DECODE_MAX_ROWS if exact is None else exact) < PAD_BELOW:
            return None     # larger batches go to BLAS (not row by row)
        n_pad = min(-(-n // PAD_STEP) * PAD_STEP, PAD_BELOW - 1, self.n_ubatch)
        return n_pad, min(1 << (max(n_outputs, 1) - 1).bit_length(), n_pad)

    def _decode_ubatch(self, ub: Batch, out_idx: np.ndarray, only=None) -> np.ndarray | None:
        """The micro-batch's output rows; ``only``: a graph's key, where a micro-batch that would take another
        graph is not run (None returned; its cells are placed, for the caller to forget: ``warm``)."""
        n = len(ub)
        n_outputs = len(out_idx)
        out_ids = out_idx if n_outputs else np.array([n - 1])
        shape = self._pad_shape(ub, n_outputs) if self.pad_ubatch else None
        if self.uses_cache:
            try:
                idxs = self.kv.find_slot(n, ub.seq_id)
            except _CacheFull as e:
                raise CacheFull(str(e)) from None
            self.kv.apply(idxs, ub.pos, ub.seq_id)
            if ub.mpos is not None:      # an image's cells: their (x, y) order the M-RoPE causal mask
                self.kv.apply_2d(idxs, ub.mpos)
            n_kv = self._n_kv(n)
        else:
            n_kv = n
        if shape is not None:           # the last token and the last output row repeated (see PAD_BELOW)
            sel = np.minimum(np.arange(shape[0]), n - 1)
            ub = Batch(ub.tokens[sel], ub.pos[sel], [ub.seq_id[i] for i in sel], ub.logits[sel])
            idxs = idxs[sel]
            out_ids = out_ids[np.minimum(np.arange(shape[1]), len(out_ids) - 1)]
        if only is not None and self._key(len(ub), len(out_ids), n_kv, ub.embd is not None) != only:
            return None
        gc = self._graph(len(ub), len(out_ids), n_kv, ub.embd is not None)
        self.sched.alloc_graph(gc.graph)
        inp = gc.inputs
        put = self._put
        if ub.embd is not None:
            put(inp["embd"], ub.embd)
        else:
            put(inp["tokens"], ub.tokens)
        if "pos" in inp:
            if self.model.hparams.n_pos_per_embd == 4:     # rows t, h, w, e (text: p, p, p, 0)
                rows = ub.mpos.T if ub.mpos is not None else np.stack([ub.pos, ub.pos, ub.pos, np.zeros_like(ub.pos)])
                put(inp["pos"], np.ascontiguousarray(rows, dtype=np.int32).reshape(-1))
            else:
                put(inp["pos"], ub.pos)
        if "kv_idxs" in inp:
            put(inp["kv_idxs"], idxs)
        for key, fill in gc.input_fns.items():
            put(inp[key], fill(ub))
        for key, value in self.kv.input_values().items():
            put(inp[key], value)
        causal = {} if self.causal_attn else {"causal": False}
        if "kq_mask" in inp:
            put(inp["kq_mask"], self.kv.mask(n_kv, ub.pos, ub.seq_id, mpos=ub.mpos, **causal))
        if "kq_mask_swa" in inp:
            put(inp["kq_mask_swa"], self.kv.mask(n_kv, ub.pos, ub.seq_id, swa=self.model.hparams.n_swa,
                                                 chunked=self.model.hparams.swa_chunked, **causal))
        if "out_ids" in inp:
            put(inp["out_ids"], out_ids)
        self.sched.graph_compute(gc.graph)
        out = gc.t_embd if self.embeddings else gc.t_logits
        v = self._view(out)
        res = (tensor_get(out) if v is None else v.copy()).reshape(-1, out.ne[0])
        # with out_ids the rows asked for come first; without, every row (a padded batch's real outputs among them)
        if "out_ids" in inp:
            return res[:n_outputs]
        # out_idx is sorted: every row asked for (a decode step's one token) is res itself, not a copy
        return res if n_outputs == len(res) else res[out_idx]

    def _put(self, t: Tensor, value) -> None:
        """tensor_set of a graph input, through a NumPy view of its host memory kept while the input stays where it
        is (a decode step sets four or five inputs: the view is made once, not per token); cast as tensor_set does."""
        v = self._view(t)
        if v is None:
            tensor_set(t, value)
        else:
            np.copyto(v, np.asarray(value).reshape(-1), casting="unsafe")

    def _view(self, t: Tensor) -> np.ndarray | None:
        """A flat NumPy view of a graph input's or output's host memory, kept while the tensor stays where it is;
        None where it is not contiguous host memory (then tensor_set / tensor_get)."""
        v = self._views.get(id(t))
        if v is None or v[0] is not t or v[1] is not t.storage.buffer or v[2] != t.data_offs:
            view = tensor_host_view(t)
            if view is None:
                return None
            if len(self._views) > 64 * self.max_graphs:
                self._views.clear()
            v = self._views[id(t)] = (t, t.storage.buffer, t.data_offs, view)
        return v[3]

    def _pool(self, ub: Batch, embd: np.ndarray) -> None:
        seqs = np.array([s[0] for s in ub.seq_id])
        for s in np.unique(seqs):
            rows = embd[seqs == s]
            if self.pooling == "mean":
                self._seq_embd[int(s)] = rows.mean(axis=0)
            elif self.pooling == "last":
                self._seq_embd[int(s)] = rows[-1]
            elif self.pooling == "cls":
                self._seq_embd[int(s)] = rows[0]
            elif self.pooling == "rank":      # the classifier's scores of the first token, the last if causal
                causal = getattr(self.model.hparams, "causal_attn", True)
                self._seq_embd[int(s)] = rows[-1] if causal else rows[0]

    # ------------------------------------------------------------------ results
    def get_logits_ith(self, i: int) -> np.ndarray:
        """Logits of batch position i (negative: from the end of the outputs)."""
        if i < 0:
            i = len(self._logits) + i
            if not 0 <= i < len(self._logits):
                raise ContextError(f"no output row {i}")
            return self._logits[i]
        if i not in self._out_rows:
            raise ContextError(f"batch position {i} did not ask for logits")
        return self._logits[self._out_rows[i]]

    def get_logits(self) -> np.ndarray:
        return self._logits

    def get_embeddings_ith(self, i: int) -> np.ndarray:
        return self._embd[self._out_rows[i] if i >= 0 else len(self._embd) + i]

    def get_embeddings_seq(self, seq_id: int) -> np.ndarray:
        if seq_id not in self._seq_embd:
            raise ContextError(f"no pooled embedding for sequence {seq_id}")
        return self._seq_embd[seq_id]

    # ------------------------------------------------------------------ memory (llama_memory_seq_*)
    def seq_rm(self, seq_id: int, p0: int = -1, p1: int = -1) -> bool:
        return self.kv.seq_rm(seq_id, p0, p1)

    def seq_cp(self, src: int, dst: int, p0: int = -1, p1: int = -1) -> None:
        try:
            self.kv.seq_cp(src, dst, p0, p1)
        except ValueError as e:
            raise ContextError(str(e)) from None

    def seq_keep(self, seq_id: int) -> None:
        self.kv.seq_keep(seq_id)

    def seq_pos_max(self, seq_id: int) -> int:
        return self.kv.seq_pos_max(seq_id)

    def seq_add(self, seq_id: int, p0: int, p1: int, delta: int) -> None:
        """Shift positions [p0, p1) of a sequence by delta, re-rotating the cached K by delta (llama.cpp's K-shift)."""
        if delta == 0:
            return
        if self.model.hparams.n_pos_per_embd > 1:   # llama.cpp asserts: a shift would move t but not an image's rows
            raise ContextError("shifting positions (context shift, seq_add) is not supported with M-RoPE (qwen2-VL)")
        shift = self.kv.seq_add_cells(seq_id, p0, p1, delta)
        if not shift.any() or self.model.hparams.rope_type < 0:     # no RoPE (LLAMA_ROPE_TYPE_NONE): no K to turn
            return
        if self._shift_graph is None:
            self._shift_graph = self._build_shift_graph()
        g, pos_in = self._shift_graph
        self.sched.alloc_graph(g)
        tensor_set(pos_in, shift)
        self.sched.graph_compute(g)

    def _build_shift_graph(self):
        hp = self.model.hparams
        size = self.kv.size
        pos = Tensor(GGMLType.I32, (size,), name="inp_k_shift").set_input()
        g = Graph()
        from .graph import GraphContext
        gc = GraphContext(self.model, self.kv, size, size, size)
        for il in range(hp.n_layer):
            k = self.kv.k[il]
            if k is None:               # a recurrent layer of a hybrid
                continue
            kv_view = ops.permute(k, 0, 2, 1, 3)                          # [d, n_head_kv, size]
            if hp.k_rope_offset:        # MLA: only the roped values after the compressed KV turn
                kv_view = ops.view_3d(k, hp.n_rot, k.ne[2], size, k.nb[2], k.nb[1], hp.k_rope_offset * k.nb[0])
            kf = ops.cont(ops.cast(kv_view, GGMLType.F32))
            kr = gc.rope(kf, pos, il)
            g.expand(ops.cpy(kr, kv_view))
        return g, pos

    def kv_clear(self, data: bool = False) -> None:
        """Forget every cell (llama_memory_clear); with ``data``, also zero the cache's buffers."""
        self.kv.clear(data)

    # ------------------------------------------------------------------ state
    def state_save(self) -> bytes:
        """The memory's cells and rows, as bytes (llama_state_get_data)."""
        f = io.BytesIO()
        np.savez(f, **self.kv.state_write())
        return f.getvalue()

    def state_seq_get_partial(self, seq_id: int) -> dict | None:
        """A context checkpoint of ``seq_id``: the part of its memory that ``seq_rm`` cannot take back to an earlier
        position (llama_state_seq_get_data_ext with LLAMA_STATE_SEQ_FLAGS_PARTIAL_ONLY): a recurrent memory's
        state rows, a hybrid's recurrent rows. None when the memory can cut any suffix (a KV cache): it needs none."""
        get = getattr(self.kv, "seq_state_get_partial", None)
        return None if get is None else get(seq_id)

    def state_seq_set_partial(self, seq_id: int, state: dict) -> None:
        """Put back a checkpoint of state_seq_get_partial; then ``seq_rm(seq_id, n, -1)``, n the tokens it was taken
        after, cuts the KV cells a hybrid holds past it. A checkpoint of another model raises ContextError."""
        set_ = getattr(self.kv, "seq_state_set_partial", None)
        if set_ is None:
            raise ContextError("this model's memory can cut any suffix: it keeps no checkpoints")
        try:
            set_(seq_id, state)
        except (KeyError, ValueError) as e:
            raise ContextError(f"the checkpoint does not fit this model's state: {e}") from None

    def state_load(self, data: bytes) -> None:
        """Restore what state_save gave; a state of another model or memory size raises ContextError."""
        try:
            z = np.load(io.BytesIO(data), allow_pickle=False)
            self.kv.state_read(z)
        except (KeyError, ValueError, OSError) as e:
            raise ContextError(f"invalid state data: {e}") from None


__all__ = ["Context", "ContextError", "CacheFull", "Batch", "POOLING"]
