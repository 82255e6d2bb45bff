"""Samplers with the semantics of llama.cpp's sampler API (src/llama-sampler.cpp), composed in a Chain.

A sampler transforms a candidate array (``Candidates``: the C ``llama_token_data_array``): token ids (int32),
logits (float32), probabilities (float32, None until a sampler computes them; like the C ``p`` field they go stale
when a later sampler changes the logits), a ``sorted`` flag (logits descending) and ``selected``. Work over the
vocabulary is vectorised NumPy or a small Numba loop; no Python loop runs over it.

Fidelity: on the same logits and seed, every sampler leaves the same ids in the same order, the same logits and
the same ``p`` bit for bit as llama.cpp (checked step by step against libllama.so in the tests), and a chain picks
the same token:
- The C code's float32 arithmetic is kept: sums are sequential, float32 or float64 as in C, and expf/logf/log2f/
  powf are the C library's (Numba calls them).
- Ties: where C sorts with ``std::sort``/``std::partial_sort`` the order of equal logits is unspecified; here it is
  always by position (stable), so results are deterministic.
- Randomness: ``Dist``, ``Mirostat`` and ``MirostatV2`` draw from ``std::mt19937`` seeded as C++ does, through
  libstdc++'s ``generate_canonical<double>`` (two 32-bit draws per number) and ``std::discrete_distribution``
  (so: llama.cpp built with GCC's libstdc++). Seed ``None`` (or 0xFFFFFFFF, LLAMA_DEFAULT_SEED) draws a random
  seed.
- Deliberate differences: ``Typical`` treats 0·log 0 as 0 (C gets NaN when a probability underflows, which scrambles
  its ordering); ``LogitBias`` clears ``sorted`` when it changes a sorted array (C leaves the flag set);
  ``Penalties`` with last_n < 0 keeps the whole history (C clamps it to 0, off; its common layer maps -1 to the
  context size); ``Chain.from_params`` at temperature <= 0 ends in ``Greedy`` (the same token as C's temp-0 +
  dist, without the random draw); ``Chain.sample`` does not call ``accept`` (llama_sampler_sample does): call
  ``Chain.accept(token)`` yourself.
"""
from __future__ import annotations

import math
import secrets
from collections import Counter, deque

import numpy as np
from numba import njit

LLAMA_DEFAULT_SEED = 0xFFFFFFFF
_F32 = np.float32
_INT32_MIN = -(1 << 31)


# ---------------------------------------------------------------------------------------------- float kernels
# Numba's float32 math.exp/log/log2/pow call the C library's expf/logf/log2f/powf, so these loops round exactly as
# llama.cpp's do (NumPy's float32 exp differs in the last bit for ~40% of inputs; float64-then-round for ~0.1%).
# No fastmath: the running sums stay sequential, in C's order and precision.
@njit(cache=True, error_model="numpy")
def _logf(x):
    out = np.empty_like(x)
    for i in range(x.size):
        out[i] = math.log(x[i])
    return out


@njit(cache=True, error_model="numpy")
def _scalar_logf(x):
    return math.log(np.float32(x))


@njit(cache=True, error_model="numpy")
def _scalar_log2f(x):
    return math.log2(np.float32(x))


@njit(cache=True, error_model="numpy")
def _scalar_powf(x, y):
    return np.float32(x) ** np.float32(y)


@njit(cache=True, error_model="numpy")
def _softmax_f32(logits, max_l):
    """llama_sampler_softmax_impl: p = expf(l - max), float sum, p /= sum."""
    p = np.empty_like(logits)
    s = np.float32(0)
    for i in range(logits.size):
        p[i] = math.exp(logits[i] - max_l)
        s += p[i]
    for i in range(logits.size):
        p[i] = p[i] / s
    return p


@njit(cache=True, error_model="numpy")
def _dist_f32(logits, max_l, u):
    """llama_sampler_dist_apply: expf weights, double running sum; the first index reaching u * total."""
    p = np.empty_like(logits)
    total = 0.0
    for i in range(logits.size):
        p[i] = math.exp(logits[i] - max_l)
        total += np.float64(p[i])
    target, run, sel = total * u, 0.0, -1
    for i in range(logits.size):
        if sel < 0:
            run += np.float64(p[i])
            if run >= target:
                sel = i
        p[i] = np.float32(np.float64(p[i]) / total)
    return (sel if sel >= 0 else logits.size - 1), p


@njit(cache=True, error_model="numpy")
def _softmax_f64(logits):
    """temp_ext's second softmax, in double from the first (largest) logit."""
    e = np.empty(logits.size, np.float64)
    s = 0.0
    for i in range(logits.size):
        e[i] = math.exp(np.float64(logits[i]) - np.float64(logits[0]))
        s += e[i]
    p = np.empty_like(logits)
    for i in range(logits.size):
        p[i] = np.float32(np.float64(np.float32(e[i])) / s)
    return p


@njit(cache=True, error_model="numpy")
def _entropy_f32(p):
    """Sum of -p logf(p) in float, skipping p == 0 (temp_ext skips it; typical would get NaN: see module doc)."""
    h = np.float32(0)
    for i in range(p.size):
        if p[i] > 0:
            h -= p[i] * np.float32(math.log(p[i]))
    return h


@njit(cache=True, error_model="numpy")
def _mirostat_k(p, m, mu, n_vocab):
    """Mirostat 1.0: s_hat from the top m (sorted p), then k, all in float as the C code."""
    sum_tb, sum_tt = np.float32(0), np.float32(0)
    for i in range(min(m - 1, p.size - 1)):
        t = np.float32(math.log(np.float32(i + 2) / np.float32(i + 1)))
        b = np.float32(math.log(p[i] / p[i + 1]))
        sum_tb += t * b
        sum_tt += t * t
    s_hat = sum_tb / sum_tt
    eps = s_hat - np.float32(1)
    num = eps * np.float32(2) ** mu
    return (num / (np.float32(1) - np.float32(n_vocab) ** -eps)) ** (np.float32(1) / s_hat)


@njit(cache=True, error_model="numpy")
def _first_surprise_over(p, mu):
    """Mirostat 2.0: the first index whose surprise -log2f(p) exceeds mu (p sorted descending), else the size."""
    for i in range(p.size):
        if -math.log2(p[i]) > mu:
            return i
    return p.size


@njit(cache=True, error_model="numpy")
def _top_n_sigma_bound(logits, n):
    """top-n-sigma's threshold, max - n * std over the finite logits, in C's precision: a float sum for the mean,
    each squared deviation added in double (C++'s pow(float, int) is double) to a float accumulator."""
    mx = logits[0]
    s = np.float32(0)
    cnt = 0
    for i in range(logits.size):
        if logits[i] != -np.inf:
            mx = max(mx, logits[i])
            s += logits[i]
            cnt += 1
    mean = s / np.float32(cnt) if cnt > 0 else np.float32(0)
    acc = np.float32(0)
    for i in range(logits.size):
        if logits[i] != -np.inf:
            d = np.float64(logits[i] - mean)
            acc = np.float32(np.float64(acc) + d * d)
    std = np.float32(math.sqrt(acc / np.float32(cnt))) if cnt > 0 else np.float32(0)
    return mx - np.float32(n) * std


def _order_desc(keys: np.ndarray, k: int | None = None) -> np.ndarray:
    """Positions of the k largest float32 keys (all if k is None), largest first, ties by position.

    One sort of uint64 composite keys (order-preserving bits of the float, then the position): as fast as NumPy's
    SIMD sort and, unlike a stable argsort of floats, a few times quicker on a 262k vocabulary."""
    n = len(keys)
    u = np.ascontiguousarray(keys, dtype=_F32).view(np.uint32)
    if k is not None and k < n:
        return _select_desc(u, max(int(k), 0))
    asc = np.where(u >> 31, ~u, u | np.uint32(0x80000000))   # unsigned order == float order
    comp = ((~asc).astype(np.uint64) << np.uint64(32)) | np.arange(n, dtype=np.uint64)
    return (np.sort(comp) & np.uint64(0xFFFFFFFF)).astype(np.intp)


# chunks of this many keys each give _select_desc one maximum (a lower bound for the k-th largest key)
_SELECT_CHUNK = 64


@njit(cache=True, inline="always")
def _f32_key(x):
    """A float32's bits (as int32) mapped to an int32 in the same order as _order_desc's keys (+0 above -0, NaNs by
    their bits)."""
    return np.int32(x ^ ((x >> 31) & 0x7FFFFFFF))


@njit(cache=True, inline="always")
def _composite(key, i):
    """The full sort's composite key of order key ``key`` at position i: the key's complement above, i below."""
    return (np.uint64(0x7FFFFFFF - np.int64(key)) << np.uint64(32)) | np.uint64(i)


@njit(cache=True, inline="always")
def _keep_smallest(heap, m, k, c):
    """Offer composite key c to a max-heap holding the k smallest keys offered so far (m of them now): the new m."""
    if m < k:                           # sift up
        j = m
        while j > 0:
            parent = (j - 1) // 2
            if heap[parent] >= c:
                break
            heap[j] = heap[parent]
            j = parent
        heap[j] = c
        return m + 1
    if c < heap[0]:                     # replace the largest kept, sift down
        j = 0
        while True:
            a = 2 * j + 1
            if a >= k:
                break
            if a + 1 < k and heap[a + 1] > heap[a]:
                a += 1
            if heap[a] <= c:
                break
            heap[j] = heap[a]
            j = a
        heap[j] = c
    return m


@njit(cache=True)
def _select_desc(u, k):
    """``_order_desc`` for k < len(u) (u: the keys' float32 bits): the k smallest composite keys (the full
    sort's: the order key's complement, then the position) kept in a max-heap. The maximum of each chunk of
    _SELECT_CHUNK keys comes first (a vectorised pass): the k-th largest of them is a lower bound for the k-th
    largest key, so only the elements of the chunks reaching it are offered to the heap (~k chunks of a 49k
    vocabulary: ~15 us where one heap pass over every key took ~50, and np.partition ~250)."""
    if k <= 0:
        return np.empty(0, np.intp)
    s = u.view(np.int32)
    n = s.size
    heap = np.empty(k, np.uint64)
    m = 0
    n_chunks = (n + _SELECT_CHUNK - 1) // _SELECT_CHUNK
    bound = np.int32(-2147483648)
    if n_chunks > k:
        top = np.empty(n_chunks, np.int32)
        for ch in range(n_chunks):
            mx = np.int32(-2147483648)
            for i in range(ch * _SELECT_CHUNK, min(ch * _SELECT_CHUNK + _SELECT_CHUNK, n)):
                key = _f32_key(s[i])
                mx = key if key > mx else mx
            top[ch] = mx
        bound = np.partition(top, n_chunks - k)[n_chunks - k]     # k elements (chunk maxima) reach it
        for ch in range(n_chunks):
            if top[ch] >= bound:
                for i in range(ch * _SELECT_CHUNK, min(ch * _SELECT_CHUNK + _SELECT_CHUNK, n)):
                    key = _f32_key(s[i])
                    if key >= bound:
                        m = _keep_smallest(heap, m, k, _composite(key, i))
    else:
        for i in range(n):
            m = _keep_smallest(heap, m, k, _composite(_f32_key(s[i]), i))
    heap = np.sort(heap)
    out = np.empty(k, np.intp)
    for j in range(k):
        out[j] = np.intp(heap[j] & np.uint64(0xFFFFFFFF))
    return out


@njit(cache=True)
def _select_desc_rows(u, rows, k):
    """_select_desc of the given rows of a 2-D array of float32 bits (one thread: ~6 us a row of a 49k vocabulary;
    a parallel loop would save ~0.3 ms at 32 rows, for seconds of compilation)."""
    out = np.empty((rows.size, k), np.intp)
    for r in range(rows.size):
        out[r] = _select_desc(u[rows[r]], k)
    return out


def _c_int(x: np.float32) -> int:
    """C's float -> int conversion on x86 (cvttss2si): NaN and out-of-range values become INT_MIN."""
    if not math.isfinite(float(x)) or not (-2.0 ** 31 <= float(x) < 2.0 ** 31):
        return _INT32_MIN
    return int(float(x))


# ------------------------------------------------------------------------------------------------ randomness
class _Unseeded(np.random.bit_generator.ISeedSequence):
    """The words NumPy's MT19937 starts from before _legacy_seeding replaces its whole state: zeros. A seed given
    as an int goes through SeedSequence's hashing (~0.1 ms, most of a request's sampler chain)."""

    def generate_state(self, n_words, dtype=np.uint32):
        return np.zeros(n_words, dtype)


_UNSEEDED = _Unseeded()


class MT19937:
    """std::mt19937 with C++'s seeding, and the uniform doubles of libstdc++'s uniform_real_distribution<double>.

    NumPy's legacy RandomState seeds MT19937 with init_genrand, exactly as std::mt19937(seed) does; its raw 32-bit
    outputs are therefore the C++ stream."""

    def __init__(self, seed: int):
        # seeded here, not from the OS's entropy (MT19937() gathers some: ~0.3 ms a request's chain paid twice)
        try:
            self.bitgen = np.random.MT19937(_UNSEEDED)
            self.bitgen._legacy_seeding(seed & 0xFFFFFFFF)      # RandomState(seed)'s own seeding, the whole state
        except AttributeError:          # a NumPy without it: the state of a RandomState so seeded
            self.bitgen = np.random.MT19937(0)
            self.bitgen.state = np.random.RandomState(seed & 0xFFFFFFFF).get_state(legacy=False)

    def uniform(self) -> float:
        """generate_canonical<double, 53>: (a + b * 2^32) / 2^64 from two draws, kept below 1."""
        a, b = self.bitgen.random_raw(2)
        r = (float(a) + float(b) * 4294967296.0) / 18446744073709551616.0
        return r if r < 1.0 else math.nextafter(1.0, 0.0)

    def uniform_float(self) -> float:
        """uniform_real_distribution<float>(0, 1): generate_canonical<float, 24> from one draw, in float, kept
        below 1 (XTC's chance)."""
        r = _F32(_F32(self.bitgen.random_raw()) / _F32(4294967296.0))
        return float(r) if r < 1 else float(np.nextafter(_F32(1), _F32(0)))

    def discrete(self, p: np.ndarray) -> int:
        """std::discrete_distribution<int>(p)(rng) as libstdc++ implements it."""
        if len(p) < 2:                     # a single weight: index 0, and no draw
            return 0
        w = p.astype(np.float64)
        cp = np.cumsum(w / np.cumsum(w)[-1])
        cp[-1] = 1.0
        return int(np.searchsorted(cp, self.uniform(), side="left"))


def _rng_seed(seed: int | None) -> int:
    """get_rng_seed: the default seed (None or 0xFFFFFFFF) means a random one."""
    if seed is None or (seed & 0xFFFFFFFF) == LLAMA_DEFAULT_SEED:
        return secrets.randbits(32)
    return seed & 0xFFFFFFFF


# ------------------------------------------------------------------------------------------------ candidates
class Candidates:
    """llama_token_data_array. `identity` records that ids[i] == i for every i (the fresh full-vocabulary array, or
    a prefix of it), which lets id-addressed samplers (penalties, logit bias) index directly."""

    __slots__ = ("ids", "logits", "p", "sorted", "selected", "identity")

    def __init__(self, logits, ids=None, p=None, sorted: bool = False):
        self.logits = np.array(logits, dtype=_F32, copy=True).reshape(-1)
        self.identity = ids is None
        self.ids = np.arange(len(self.logits), dtype=np.int32) if ids is None else np.array(ids, dtype=np.int32)
        self.p = None if p is None else np.array(p, dtype=_F32)
        self.sorted = sorted
        self.selected = -1

    @property
    def size(self) -> int:
        return len(self.logits)

    def take(self, pos: np.ndarray) -> None:
        """Keep the candidates at positions `pos`, in that order."""
        self.ids, self.logits = self.ids[pos], self.logits[pos]
        if self.p is not None:
            self.p = self.p[pos]
        self.identity = False

    def truncate(self, n: int) -> None:
        """cur_p->size = n: keep the first n (order, and so `identity` and `sorted`, unchanged)."""
        self.ids, self.logits = self.ids[:n], self.logits[:n]
        if self.p is not None:
            self.p = self.p[:n]

    def sort_top(self, k: int | None = None) -> None:
        """llama_token_data_array_partial_sort_inplace: keep the k best (all if None), sorted descending."""
        self.take(_order_desc(self.logits, k))
        self.sorted = True

    def softmax(self, do_sort: bool) -> None:
        """llama_sampler_softmax_impl: p = softmax(logits) in float32, sequential sum, sorting first if asked."""
        assert self.size > 0, "softmax of an empty candidate array"
        if do_sort and not self.sorted:
            self.sort_top()
        max_l = self.logits[0] if self.sorted else self.logits.max()
        self.p = _softmax_f32(self.logits, _F32(max_l))

    def positions_of(self, tokens: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """For distinct token ids, (positions in this array, index into `tokens`) of those present."""
        tokens = np.asarray(tokens, dtype=np.int64)
        if self.identity:
            ok = np.flatnonzero((tokens >= 0) & (tokens < self.size))
            return tokens[ok], ok
        hi = int(max(int(self.ids.max(initial=-1)), int(tokens.max(initial=-1)))) + 1
        slot = np.full(hi, -1, dtype=np.int64)          # dense id -> index-into-tokens table
        valid = tokens >= 0
        slot[tokens[valid]] = np.flatnonzero(valid)
        which = slot[self.ids]
        pos = np.flatnonzero(which >= 0)
        return pos, which[pos]


class Sampler:
    """The llama_sampler interface: apply() transforms candidates; accept() sees each chosen token."""

    def apply(self, c: Candidates) -> None:
        raise NotImplementedError

    def accept(self, token: int) -> None:
        pass

    def reset(self) -> None:
        pass

    def __repr__(self) -> str:
        args = ", ".join(f"{k}={v!r}" for k, v in vars(self).items() if not k.startswith("_") and k != "rng")
        return f"{type(self).__name__}({args})"


# -------------------------------------------------------------------------------------------------- samplers
def _temp_impl(c: Candidates, temp) -> None:
    if c.size == 0:
        return
    if temp <= 0:                     # keep the (first) largest logit, every other one becomes -inf
        i = int(np.argmax(c.logits))
        keep = c.logits[i]
        c.logits = np.full(c.size, -np.inf, dtype=_F32)
        c.logits[i] = keep
        return
    c.logits = c.logits / _F32(temp)


class Greedy(Sampler):
    def apply(self, c):
        c.selected = int(np.argmax(c.logits)) if c.size else -1


class Dist(Sampler):
    """Sample from softmax(logits) in the current order (no sort): the first index whose running float64 sum of
    expf(logit - max) reaches u * total; leaves p normalised."""

    def __init__(self, seed: int | None = None):
        self.seed = seed
        self.seed_cur = _rng_seed(seed)
        self.rng = MT19937(self.seed_cur)

    def apply(self, c):
        n = c.size
        if n == 0:
            c.selected = -1
            return
        c.selected = 0
        if n == 1:
            self.rng.uniform()           # C draws once per output even here (keeps streams aligned)
            c.p = np.ones(1, dtype=_F32)
            return
        max_l = c.logits[0] if c.sorted else c.logits.max()
        sel, c.p = _dist_f32(c.logits, _F32(max_l), self.rng.uniform())
        c.selected = int(sel)

    def reset(self):
        self.seed_cur = _rng_seed(self.seed)
        self.rng = MT19937(self.seed_cur)


class Temp(Sampler):
    """logits /= t; t <= 0 keeps only the largest logit (the rest become -inf), as llama.cpp."""

    def __init__(self, t: float):
        self.t = t

    def apply(self, c):
        _temp_impl(c, _F32(self.t))


class TempExt(Sampler):
    """Dynamic temperature (arXiv 2309.02772): t in [t - delta, t + delta] by normalised entropy ** exponent;
    delta <= 0 is plain Temp(t)."""

    def __init__(self, t: float, delta: float = 0.0, exponent: float = 1.0):
        self.t, self.delta, self.exponent = t, delta, exponent

    def apply(self, c):
        t, delta = _F32(self.t), _F32(self.delta)
        if not delta > 0:
            return _temp_impl(c, t)
        min_t, max_t = max(_F32(0), _F32(t - delta)), _F32(t + delta)
        if c.size <= 1:
            return
        max_entropy = -_F32(_scalar_logf(_F32(1) / _F32(c.size)))
        c.softmax(do_sort=True)
        norm = _F32(_F32(_entropy_f32(c.p)) / max_entropy)
        dyn = _F32(min_t + _F32((max_t - min_t) * _F32(_scalar_powf(norm, self.exponent))))
        _temp_impl(c, dyn)
        c.p = _softmax_f64(c.logits)          # C redoes the softmax in double here


class TopK(Sampler):
    """Keep the k largest logits, sorted; k <= 0 is a no-op; k >= size sorts everything (as C does)."""

    def __init__(self, k: int):
        self.k = k

    def apply(self, c):
        if self.k <= 0:
            return
        k = min(self.k, c.size)
        if not c.sorted:
            c.sort_top(k)
        c.truncate(k)


class TopP(Sampler):
    """Nucleus: softmax over the current candidates, then keep the shortest sorted prefix whose float32 running
    sum reaches p (and at least min_keep). p is left as computed before the cut (not renormalised)."""

    def __init__(self, p: float, min_keep: int = 1):
        self.p, self.min_keep = p, min_keep

    def apply(self, c):
        if self.p >= 1.0:
            return
        c.softmax(do_sort=False)
        p = _F32(self.p)
        if not c.sorted and c.size > 1024:
            # C's adaptive path: the best 256 usually hold the nucleus; sort everything only if they don't
            head = _order_desc(c.logits, 256)
            last = self._cut(np.cumsum(c.p[head], dtype=_F32), p)
            if last is not None:
                c.take(head[:last])
                c.sorted = True
                return
        if not c.sorted:
            c.sort_top()
        last = self._cut(np.cumsum(c.p, dtype=_F32), p)
        c.truncate(c.size if last is None else last)

    def _cut(self, cum: np.ndarray, p) -> int | None:
        i = max(int(np.searchsorted(cum, p, side="left")), self.min_keep - 1)   # first cum >= p, i + 1 >= min_keep
        return i + 1 if i < len(cum) else None


class MinP(Sampler):
    """Keep tokens with logit >= max + log(p) (p_i >= p * p_max), at least min_keep. Unsorted input keeps its
    order when that leaves enough tokens; otherwise the sorted prefix rule applies."""

    def __init__(self, p: float, min_keep: int = 1):
        self.p, self.min_keep = p, min_keep

    def apply(self, c):
        if self.p <= 0 or c.size == 0:
            return
        log_p = _F32(_scalar_logf(self.p))
        if not c.sorted:
            keep = c.logits >= _F32(c.logits.max() + log_p)
            n = int(np.count_nonzero(keep))
            if n > 0 and n >= self.min_keep:
                if n < c.size:
                    c.take(np.flatnonzero(keep))
                return
            c.sort_top()
        min_logit = _F32(c.logits[0] + log_p)
        first_out = 1 + int(np.count_nonzero(c.logits[1:] >= min_logit))    # the first token always stays
        c.truncate(min(c.size, max(first_out, self.min_keep)))


class Typical(Sampler):
    """Locally typical sampling (arXiv 2202.00666): order by |-log p - H|, keep the prefix whose float32 running
    sum of p exceeds p (strictly), at least min_keep. Leaves the candidates unsorted, p not renormalised."""

    def __init__(self, p: float, min_keep: int = 1):
        self.p, self.min_keep = p, min_keep

    def apply(self, c):
        if self.p >= 1.0:
            return
        c.softmax(do_sort=True)
        entropy = _F32(_entropy_f32(c.p))
        shifted = np.abs(-_logf(c.p) - entropy)
        order = _order_desc(-shifted)                       # ascending shifted score, ties by position
        cum = np.cumsum(c.p[order], dtype=_F32)
        i = max(int(np.searchsorted(cum, _F32(self.p), side="right")), self.min_keep - 1, 0)
        c.take(order[:i + 1] if i < len(cum) else order)
        c.sorted = False


class TopNSigma(Sampler):
    """Top-n-sigma (arXiv 2411.07641): logits below max - n * std (over the finite ones) become -inf; the
    candidates keep their order and size. n <= 0 is a no-op."""

    def __init__(self, n: float):
        self.n = n

    def apply(self, c):
        if self.n <= 0 or c.size <= 1:
            return
        bound = _F32(_top_n_sigma_bound(c.logits, _F32(self.n)))
        c.logits[c.logits < bound] = -np.inf


class XTC(Sampler):
    """Exclude Top Choices: with chance ``probability`` (one float draw per step), drop every candidate whose
    probability reaches ``threshold`` except the least likely of them, if that leaves at least min_keep. A
    threshold above 0.5 or a probability <= 0 disables it (and then it draws nothing)."""

    def __init__(self, probability: float, threshold: float, min_keep: int = 1, seed: int | None = None):
        self.probability, self.threshold, self.min_keep, self.seed = probability, threshold, min_keep, seed
        self.reset()

    @property
    def disabled(self) -> bool:
        return self.off(self.probability, self.threshold)

    @staticmethod
    def off(probability: float, threshold: float) -> bool:
        return probability <= 0 or threshold > 0.5

    def reset(self):
        self.seed_cur = _rng_seed(self.seed)
        self.rng = MT19937(self.seed_cur)

    def apply(self, c):
        if self.disabled or c.size < 2:
            return
        if self.rng.uniform_float() > _F32(self.probability):
            return
        c.softmax(do_sort=True)
        over = c.p >= _F32(self.threshold)
        pos_last = int(np.argmin(over)) - 1 if not over.all() else c.size - 1   # the last of the leading run
        pos_last = max(pos_last, 0)
        if c.size - pos_last >= self.min_keep and pos_last > 0:
            c.take(np.arange(pos_last, c.size))
            c.sorted = True


class Penalties(Sampler):
    """Repetition (divide a positive logit, multiply a non-positive one), frequency (× count) and presence
    penalties over the last `last_n` accepted tokens. last_n == 0 disables; last_n < 0 keeps the whole history
    (llama.cpp's common layer maps -1 to the context size)."""

    def __init__(self, last_n: int = 64, repeat: float = 1.0, freq: float = 0.0, present: float = 0.0):
        self.last_n, self.repeat, self.freq, self.present = last_n, repeat, freq, present
        self._prev: deque = deque(maxlen=None if last_n < 0 else last_n)
        self._count: Counter = Counter()

    @property
    def disabled(self) -> bool:
        return self.last_n == 0 or (self.repeat == 1.0 and self.freq == 0.0 and self.present == 0.0)

    def accept(self, token):
        if self.last_n == 0:
            return
        token = int(token)
        if self._prev.maxlen is not None and len(self._prev) >= self._prev.maxlen:
            old = self._prev[0]
            self._count[old] -= 1
            if self._count[old] == 0:
                del self._count[old]
        self._prev.append(token)
        self._count[token] += 1

    def reset(self):
        self._prev.clear()
        self._count.clear()

    def apply(self, c):
        if self.disabled:
            return
        if self._count:
            toks = np.fromiter(self._count.keys(), dtype=np.int64, count=len(self._count))
            counts = np.fromiter(self._count.values(), dtype=np.int64, count=len(self._count))
            pos, which = c.positions_of(toks)
            n = counts[which]
            lg = c.logits[pos]
            lg = np.where(lg <= 0, lg * _F32(self.repeat), lg / _F32(self.repeat)).astype(_F32)
            lg = lg - (n.astype(_F32) * _F32(self.freq) + (n > 0).astype(_F32) * _F32(self.present))
            c.logits[pos] = lg
        c.sorted = False


class LogitBias(Sampler):
    """Add a bias to the logits of given token ids (-inf bans a token)."""

    def __init__(self, n_vocab: int, bias: dict | None):
        self.n_vocab = n_vocab
        self.bias = {int(k): float(v) for k, v in (bias or {}).items()}
        self._toks = np.fromiter(self.bias.keys(), dtype=np.int64, count=len(self.bias))
        self._vals = np.fromiter(self.bias.values(), dtype=np.float64, count=len(self.bias)).astype(_F32)
        order = np.argsort(self._toks, kind="stable")
        self._stoks, self._svals = self._toks[order], self._vals[order]     # by id: at()'s and the rows' lookups
        self._lowers = not (self._vals > 0).any()

    def apply(self, c):
        if not self.bias:
            return
        pos, which = c.positions_of(self._toks)
        if len(pos):
            c.logits[pos] = c.logits[pos] + self._vals[which]
            c.sorted = False

    @property
    def lowers_only(self) -> bool:
        """No bias above 0 (bans, ignore_eos): a biased row's k largest are then among the row's k + len(bias)."""
        return self._lowers

    def row(self, x: np.ndarray) -> np.ndarray:
        """A copy of a whole float32 row with the biases added (apply's values on a fresh array)."""
        y = x.copy()
        ok = (self._toks >= 0) & (self._toks < y.size)
        y[self._toks[ok]] = y[self._toks[ok]] + self._vals[ok]
        return y

    def at(self, x: np.ndarray, pos: np.ndarray) -> np.ndarray:
        """The biased values of a whole row x at positions (token ids) pos: row(x)[pos] without the copy."""
        v = x[pos]
        toks = self._stoks
        j = np.minimum(np.searchsorted(toks, pos), max(len(toks) - 1, 0))
        hit = np.flatnonzero(toks[j] == pos) if len(toks) else np.empty(0, np.intp)
        v[hit] = v[hit] + self._svals[j[hit]]
        return v


class Mirostat(Sampler):
    """Mirostat 1.0 (arXiv 2007.14966): estimate the Zipf exponent s_hat from the top m, choose k from it and mu,
    sample from the top k, then mu -= eta * (surprise - tau). mu starts at 2 * tau."""

    def __init__(self, n_vocab: int, seed: int | None = None, tau: float = 5.0, eta: float = 0.1, m: int = 100):
        self.n_vocab, self.seed, self.tau, self.eta, self.m = n_vocab, seed, tau, eta, m
        self.reset()

    def reset(self):
        self.mu = _F32(2.0) * _F32(self.tau)
        self.seed_cur = _rng_seed(self.seed)
        self.rng = MT19937(self.seed_cur)

    def apply(self, c):
        c.softmax(do_sort=True)
        k = _F32(_mirostat_k(c.p, self.m, self.mu, self.n_vocab))
        c.truncate(min(max(_c_int(k), 1), c.size))       # top_k_impl on the sorted array
        c.softmax(do_sort=True)
        c.selected = self.rng.discrete(c.p)
        self._update(c.p[c.selected])

    def _update(self, p_sel) -> None:
        surprise = -_F32(_scalar_log2f(p_sel))
        self.mu = _F32(self.mu - _F32(_F32(self.eta) * _F32(surprise - _F32(self.tau))))


class MirostatV2(Mirostat):
    """Mirostat 2.0: drop tokens whose surprise -log2 p exceeds mu (keep at least one), sample, update mu."""

    def __init__(self, seed: int | None = None, tau: float = 5.0, eta: float = 0.1):
        self.seed, self.tau, self.eta = seed, tau, eta
        self.reset()

    def apply(self, c):
        c.softmax(do_sort=True)
        c.truncate(max(int(_first_surprise_over(c.p, self.mu)), 1))
        c.softmax(do_sort=True)
        c.selected = self.rng.discrete(c.p)
        self._update(c.p[c.selected])


# ------------------------------------------------------------------------------------------------------ chain
class Chain(Sampler):
    """Samplers applied in order to one candidate array; the last must select (Greedy, Dist, Mirostat...)."""

    def __init__(self, samplers: list):
        self.samplers = list(samplers)

    def add(self, s: Sampler) -> "Chain":
        self.samplers.append(s)
        return self

    def apply(self, c):
        for s in self.samplers:
            s.apply(c)

    def lead(self) -> tuple:
        """(a leading LogitBias that holds biases, or None; the sampler after it, or the first, or None): what
        ``sample``'s and ``top_positions``' shortcuts start from."""
        ss = self.samplers
        bias = ss[0] if len(ss) > 1 and type(ss[0]) is LogitBias and ss[0].bias else None
        return bias, (ss[1 if bias else 0] if ss else None)

    def sample(self, logits: np.ndarray, top: np.ndarray | None = None) -> int:
        """The token this chain picks from a row of logits (over the whole vocabulary). Does not accept it.

        A chain that starts with TopK (k below the vocabulary) starts from the candidates that TopK leaves, the k
        largest sorted (``top``: their positions, as top_positions gives them for many rows at once), without
        copying the whole row; a chain that is only Greedy takes the row's argmax. Either way the candidates, and
        the token, are the ones the samplers pick one by one."""
        x = np.asarray(logits, dtype=_F32).reshape(-1)
        rest = self.samplers
        bias, first = self.lead()
        if type(first) is Greedy and len(rest) == 1 + (bias is not None) and x.size:
            return int(np.argmax(x if bias is None else bias.row(x)))
        if type(first) is TopK and 0 < first.k < x.size:
            if bias is None:
                pos = _order_desc(x, first.k) if top is None else top
                c = Candidates(x[pos], ids=pos, sorted=True)
            else:       # a leading logit bias (ignore_eos's bans, a request's logit_bias), then the TopK
                pos = _order_desc(bias.row(x), first.k) if top is None else top
                c = Candidates(bias.at(x, pos), ids=pos, sorted=True)
            rest = rest[2 if bias else 1:]
        else:
            c = Candidates(x)
        for s in rest:
            s.apply(c)
        if not 0 <= c.selected < c.size:
            raise ValueError(f"sampler chain selected no token (selected={c.selected}, {c.size} candidates); "
                             "end the chain with Greedy, Dist, Mirostat or MirostatV2")
        return int(c.ids[c.selected])

    def accept(self, token):
        for s in self.samplers:
            s.accept(token)

    def reset(self):
        for s in self.samplers:
            s.reset()

    def __repr__(self) -> str:
        return f"Chain({self.samplers!r})"

    @classmethod
    def from_params(cls, temperature=0.8, top_k=40, top_p=0.95, min_p=0.05, typical_p=1.0, repeat_penalty=1.0,
                    repeat_last_n=64, frequency_penalty=0.0, presence_penalty=0.0, mirostat=0, mirostat_tau=5.0,
                    mirostat_eta=0.1, logit_bias=None, seed=None, n_vocab=0, dynatemp_range=0.0,
                    dynatemp_exponent=1.0, min_keep=0, grammar=None, top_n_sigma=-1.0, xtc_probability=0.0,
                    xtc_threshold=0.1, dry_multiplier=0.0, dry_base=1.75, dry_allowed_length=2, dry_penalty_last_n=-1,
                    dry_sequence_breakers=None, vocab=None, samplers=None) -> "Chain":
        """llama.cpp's chain (common/sampling.cpp): logit bias, then the samplers in ``samplers`` order (names or
        letters, ``sampler_order``; default penalties, dry, top_n_sigma, top_k, typ_p, top_p, min_p, xtc,
        temperature), then dist; mirostat 1/2 replaces everything after the logit bias with temp + mirostat.
        Disabled penalties, DRY, XTC and top-n-sigma are left out (llama.cpp makes them empty samplers).
        Temperature <= 0 is greedy: the argmax after the samplers before the temperature (the filters that cannot
        change it dropped), which is the token llama.cpp's temp-0 chain picks, without the RNG draw. DRY's
        sequence breakers (default newline, colon, quote, asterisk) are read against ``vocab``. ``grammar``, a
        grammar sampler (llampy.llama.grammar.Grammar), goes first: every later sampler sees only the tokens it
        allows."""
        head: list = [] if grammar is None else [grammar]
        if logit_bias:
            head.append(LogitBias(n_vocab, logit_bias))
        greedy = temperature is not None and temperature <= 0
        if mirostat in (1, 2) and greedy:
            return cls(head + [Greedy()])
        if mirostat == 1:
            return cls(head + [Temp(temperature), Mirostat(n_vocab, seed, mirostat_tau, mirostat_eta, 100)])
        if mirostat == 2:
            return cls(head + [Temp(temperature), MirostatV2(seed, mirostat_tau, mirostat_eta)])
        if mirostat not in (0, None):
            raise ValueError(f"unknown mirostat version {mirostat!r} (0, 1 or 2)")
        order = DEFAULT_ORDER if samplers is None else sampler_order(samplers)

        def make(name):
            if name == "penalties":
                s = Penalties(repeat_last_n, repeat_penalty, frequency_penalty, presence_penalty)
            elif name == "dry":
                from .sampling_dry import DEFAULT_BREAKERS, DRY, dry_breakers
                s = DRY(dry_multiplier, dry_base, dry_allowed_length, dry_penalty_last_n)
                brk = DEFAULT_BREAKERS if dry_sequence_breakers is None else dry_sequence_breakers
                if not s.disabled and brk:
                    if vocab is None:
                        raise ValueError("DRY's sequence breakers need the vocabulary (vocab=)")
                    s = DRY(dry_multiplier, dry_base, dry_allowed_length, dry_penalty_last_n,
                            dry_breakers(vocab, brk))
            elif name == "top_n_sigma":
                s = TopNSigma(top_n_sigma)
                return s if s.n > 0 else None
            elif name == "top_k":
                return TopK(top_k)
            elif name == "typ_p":
                return Typical(typical_p, min_keep)
            elif name == "top_p":
                return TopP(top_p, min_keep)
            elif name == "min_p":
                return MinP(min_p, min_keep)
            elif name == "xtc":
                if XTC.off(xtc_probability, xtc_threshold):     # left out before seeding its generator
                    return None
                s = XTC(xtc_probability, xtc_threshold, min_keep, seed)
            else:
                return TempExt(temperature, dynatemp_range, dynatemp_exponent)
            return None if s.disabled else s

        if greedy and "temperature" in order:
            before = [(n, make(n)) for n in order[:order.index("temperature")]]
            before = [(n, s) for n, s in before if s is not None]
            # a filter keeps the largest logit: it matters only where a later sampler changes the logits or drops
            # the top (penalties, DRY, typical, XTC)
            changers = [k for k, (n, s) in enumerate(before) if n in ("penalties", "dry", "xtc")
                        or (n == "typ_p" and typical_p < 1.0)]
            last = changers[-1] if changers else -1
            return cls(head + [s for k, (n, s) in enumerate(before) if k < last or n not in FILTERS] + [Greedy()])
        return cls(head + [s for s in map(make, order) if s is not None] + [Dist(seed)])


def top_positions(chains: list, logits: np.ndarray, rows: list) -> list:
    """For chain i sampling row rows[i] of the 2-D float32 ``logits``: the positions its leading TopK keeps (the
    ``top`` of Chain.sample), or None where it does not start with one. The rows of each k in one call (the server
    samples a row per generating stream every step), and so the rows behind a bias of at most 0 of each k."""
    out: list = [None] * len(chains)
    by_k: dict = {}
    biased: dict = {}                   # chain index -> (its leading LogitBias, k) where one comes first
    n = logits.shape[1]
    for i, ch in enumerate(chains):
        bias, first = ch.lead() if isinstance(ch, Chain) else (None, None)
        if type(first) is not TopK or not 0 < first.k < n:
            continue
        if bias is None:
            by_k.setdefault(int(first.k), []).append(i)
            continue
        biased[i] = (bias, int(first.k))
        # biases of at most 0 move nothing up: the biased row's k largest are among the row's k + len(bias)
        wide = int(first.k) + len(bias.bias)
        if bias.lowers_only and wide < n:
            by_k.setdefault(wide, []).append(i)
    x = np.ascontiguousarray(logits, dtype=_F32)
    if by_k:
        u = x.view(np.uint32)
        for k, idx in by_k.items():
            pos = _select_desc_rows(u, np.array([rows[i] for i in idx], np.intp), k)
            for j, i in enumerate(idx):
                out[i] = pos[j]
    narrow: dict = {}                   # (k, wide) -> the biased chains whose wide top is known
    for i, (bias, k) in biased.items():
        if out[i] is None:              # a bias above 0 (or as wide as the row): the biased row's own top-k
            out[i] = _order_desc(bias.row(x[rows[i]]), k)
        else:
            narrow.setdefault((k, len(out[i])), []).append(i)
    for (k, _), idx in narrow.items():
        btok, bval, boff = _bias_table([biased[i][0] for i in idx])
        pos = _biased_top_rows(x, np.array([rows[i] for i in idx], np.intp), np.stack([out[i] for i in idx]), k,
                               btok, bval, boff)
        for j, i in enumerate(idx):
            out[i] = pos[j]
    return out


def _bias_table(biases: list) -> tuple:
    """The ids (sorted) and values of each LogitBias (or None: no bias), one after another, and where each
    starts: the compiled loops' form of a bias per row."""
    boff = np.zeros(len(biases) + 1, np.int64)
    for j, b in enumerate(biases):
        boff[j + 1] = boff[j] + (len(b._stoks) if b is not None else 0)
    have = [b for b in biases if b is not None]
    return (np.concatenate([b._stoks for b in have]) if have else np.zeros(0, np.int64),
            np.concatenate([b._svals for b in have]) if have else np.zeros(0, _F32), boff)


@njit(cache=True, inline="always")
def _biased(x, r, t, btok, bval, b0, b1):
    """Row r's logit of token t with its bias (the sorted ids btok[b0:b1], values bval) added, as LogitBias.at."""
    v = x[r, t]
    lo, hi = b0, b1
    while lo < hi:
        mid = (lo + hi) // 2
        if btok[mid] < t:
            lo = mid + 1
        else:
            hi = mid
    if lo < b1 and btok[lo] == t:
        v = np.float32(v + bval[lo])
    return v


@njit(cache=True)
def _biased_top_rows(x, rows, wide, k, btok, bval, boff):
    """For each row r of x[rows]: the k largest biased logits among the positions wide[r] (the row's own largest),
    largest first, ties by token id: top_positions' ``wide[_order_desc(bias.at(row, wide), k)]`` with wide in id
    order, as _select_desc orders its composite keys (with the id for the position)."""
    m, w = wide.shape
    out = np.empty((m, k), np.intp)
    v = np.empty(w, np.float32)
    comp = np.empty(w, np.uint64)
    for r in range(m):
        for j in range(w):
            v[j] = _biased(x, rows[r], wide[r, j], btok, bval, boff[r], boff[r + 1])
        s = v.view(np.int32)
        for j in range(w):
            comp[j] = _composite(_f32_key(s[j]), wide[r, j])
        comp.sort()
        for j in range(k):
            out[r, j] = np.intp(comp[j] & np.uint64(0xFFFFFFFF))
    return out


@njit(cache=True, error_model="numpy")
def _sample_top_rows(x, rows, top, kk, btok, bval, boff, tp, tp_keep, log_mp, mp_keep, temp, u):
    """The tokens of ``sample_rows``' chains, one row each: from a row's top-k positions (kk[r] of top[r], the
    largest logits first), its bias (the sorted ids btok[boff[r]:boff[r + 1]], values bval) added, then top-p
    (tp[r] >= 1: off), min-p (log_mp[r] NaN: off), the temperature and the draw u[r]; each the samplers' own
    arithmetic on a sorted candidate array (TopP.apply, MinP.apply, _temp_impl, Dist.apply)."""
    out = np.empty(rows.size, np.int64)
    for r in range(rows.size):
        n = kk[r]
        lg = np.empty(n, np.float32)
        b0, b1 = boff[r], boff[r + 1]
        for j in range(n):
            lg[j] = _biased(x, rows[r], top[r, j], btok, bval, b0, b1)
        if tp[r] < 1:                                   # TopP: softmax from the first logit, float32 running sum
            p = _softmax_f32(lg, lg[0])
            cum = np.float32(0)
            cut = n
            for j in range(n):
                cum += p[j]
                if cum >= tp[r]:
                    cut = j
                    break
            cut = max(cut, tp_keep[r] - 1)
            if cut < n:
                n = cut + 1
        if not np.isnan(log_mp[r]):                     # MinP on sorted candidates: the first always stays
            min_logit = np.float32(lg[0] + log_mp[r])
            first_out = 1
            for j in range(1, n):
                if lg[j] >= min_logit:
                    first_out += 1
            n = min(n, max(first_out, mp_keep[r]))
        for j in range(n):
            lg[j] = np.float32(lg[j] / temp[r])
        sel = 0
        if n > 1:
            sel, _ = _dist_f32(lg[:n], lg[0], u[r])
        out[r] = top[r, sel]
    return out


def _top_plan(ch) -> tuple | None:
    """(k, top-p, its min_keep, log min-p or NaN, its min_keep, temperature, the Dist) of a chain that
    ``_sample_top_rows`` computes: [LogitBias], TopK(k), then in this order an optional TopP, an optional MinP and a
    temperature above 0 (Temp, or TempExt without a range), no-op Typical / TopP / MinP anywhere between, and
    Dist last; None for any other chain."""
    if not isinstance(ch, Chain):
        return None
    bias, first = ch.lead()
    ss = ch.samplers
    if type(first) is not TopK or len(ss) < 2 or type(ss[-1]) is not Dist:
        return None
    if bias is None and ss[0] is not first:
        return None
    tp, tp_keep, log_mp, mp_keep, temp = _F32(1), 1, _F32(np.nan), 1, None
    stage = 0                                   # 1: after a TopP, 2: after a MinP, 3: after the temperature
    for s in ss[2 if bias is not None else 1:-1]:
        t = type(s)
        if t in (TopP, MinP) and not math.isfinite(s.p):
            return None
        if t is Typical and s.p >= 1.0 or t is TopP and s.p >= 1.0 or t is MinP and s.p <= 0:
            continue
        if t is TopP and stage < 1:
            tp, tp_keep, stage = _F32(s.p), int(s.min_keep), 1
        elif t is MinP and stage < 2:
            log_mp, mp_keep, stage = _F32(_scalar_logf(s.p)), int(s.min_keep), 2
        elif (t is Temp or t is TempExt and not _F32(s.delta) > 0) and stage < 3:
            temp, stage = _F32(s.t), 3
        else:
            return None
    if temp is None or not (temp > 0 and math.isfinite(temp)):
        return None
    return int(first.k), tp, tp_keep, log_mp, mp_keep, temp, ss[-1]


def sample_rows(chains: list, logits: np.ndarray, rows: list, tops: list) -> list:
    """The token of each chain whose work one compiled call does for every row at once, None for the others (their
    Chain.sample): chain i samples row rows[i] of the 2-D float32 ``logits`` from ``tops[i]`` (top_positions'),
    as _top_plan's chains: the common ones (llama.cpp's default order at a temperature above 0, with or without
    a leading logit bias). Each such chain's Dist draws its number here, as Chain.sample would; the token is the
    one Chain.sample picks (the server sampled ~100 us a row in the samplers' Python at 32 streams)."""
    out: list = [None] * len(chains)
    plans = []
    for i, ch in enumerate(chains):
        plan = _top_plan(ch) if tops[i] is not None else None
        if plan is not None and len(tops[i]) == plan[0]:
            plans.append((i, plan))
    if not plans:
        return out
    m = len(plans)
    kk = np.array([p[0] for _, p in plans], np.int64)
    top = np.zeros((m, int(kk.max())), np.intp)
    for r, (i, p) in enumerate(plans):
        top[r, :p[0]] = tops[i]
    btok, bval, boff = _bias_table([chains[i].lead()[0] for i, _ in plans])
    u = np.array([p[6].rng.uniform() for _, p in plans], np.float64)       # each chain's one draw, as Dist's
    sel = _sample_top_rows(
        np.ascontiguousarray(logits, dtype=_F32), np.array([rows[i] for i, _ in plans], np.intp), top, kk,
        btok, bval, boff,
        np.array([p[1] for _, p in plans], _F32), np.array([p[2] for _, p in plans], np.int64),
        np.array([p[3] for _, p in plans], _F32), np.array([p[4] for _, p in plans], np.int64),
        np.array([p[5] for _, p in plans], _F32), u)
    for r, (i, _) in enumerate(plans):
        out[i] = int(sel[r])
    return out


# common_sampler_type names (common/sampling.cpp), in llama.cpp's default order, and their letters
DEFAULT_ORDER = ("penalties", "dry", "top_n_sigma", "top_k", "typ_p", "top_p", "min_p", "xtc", "temperature")
SAMPLER_CHARS = {"d": "dry", "k": "top_k", "y": "typ_p", "p": "top_p", "s": "top_n_sigma", "m": "min_p",
                 "t": "temperature", "x": "xtc", "i": "infill", "e": "penalties", "a": "adaptive_p"}
FILTERS = ("top_k", "top_p", "min_p", "top_n_sigma")
UNSUPPORTED = ("infill", "adaptive_p")


def _sampler_names() -> dict:
    names = {}
    for canon in set(SAMPLER_CHARS.values()):
        names[canon] = canon
        if "_" in canon:
            names[canon.replace("_", "-")] = canon
            names[canon.replace("_", "")] = canon
    names.update(nucleus="top_p", temp="temperature", typ="typ_p")
    return names


SAMPLER_NAMES = _sampler_names()


def sampler_order(samplers) -> tuple:
    """llama.cpp's ``samplers`` setting as canonical names: a list of names (any case; top_k, top-k and topk
    alike; nucleus, temp, typ) or a string of letters (``"dkyptsmxe"``...). Unknown names raise ValueError (llama.cpp
    skips them with a warning), as do infill and adaptive_p, which llampy does not have."""
    if isinstance(samplers, str):
        bad = [ch for ch in samplers if ch not in SAMPLER_CHARS]
        if bad:
            raise ValueError(f"unknown sampler letter {bad[0]!r} (known: {''.join(SAMPLER_CHARS)})")
        names = [SAMPLER_CHARS[ch] for ch in samplers]
    elif isinstance(samplers, (list, tuple)) and all(isinstance(x, str) for x in samplers):
        names = []
        for x in samplers:
            canon = SAMPLER_NAMES.get(x.lower())
            if canon is None:
                raise ValueError(f"unknown sampler {x!r} (known: {', '.join(DEFAULT_ORDER)})")
            names.append(canon)
    else:
        raise ValueError("samplers must be a list of sampler names or a string of sampler letters")
    for n in names:
        if n in UNSUPPORTED:
            raise ValueError(f"the {n} sampler is not supported")
    return tuple(names)


def top_logprobs(logits: np.ndarray, k: int) -> list:
    """The k most likely tokens with their log-probabilities under softmax of the raw logits over the whole
    vocabulary (float64), most likely first, ties by id."""
    x = np.asarray(logits, dtype=np.float64).reshape(-1)
    k = min(int(k), len(x))
    if k <= 0:
        return []
    m = x.max()
    lse = m + math.log(np.exp(x - m).sum())
    idx = _order_desc(x.astype(_F32), k)          # logits are float32 in practice; order exactly in float64 below
    idx = idx[np.lexsort((idx, -x[idx]))]
    return [(int(i), float(x[i] - lse)) for i in idx]
