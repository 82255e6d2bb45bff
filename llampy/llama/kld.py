"""KL divergence between a model and a base model, with llama-perplexity's file and statistics
(tools/perplexity: ``--kl-divergence-base FILE`` alone saves the base's log-probabilities; with ``--kl-divergence``
it reads them and compares).

The file: ``_logits_``, n_ctx (u32), n_vocab (i32), n_chunk (i32), the n_chunk * n_ctx tokens (i32); then per chunk
and per scored position (n_ctx - 1 - n_ctx/2 of them) a row of nv = 2*ceil(n_vocab/2) + 4 uint16: two floats
(scale, min_log_prob), then each token's log-probability as min_log_prob + scale * q, q 16 bits over the 16 nats
below the top logit (0 below that).
"""
from __future__ import annotations

import math
import struct
from dataclasses import dataclass, field

import numpy as np

F32 = np.float32
MAGIC = b"_logits_"


def _nv(n_vocab: int) -> int:
    return 2 * ((n_vocab + 1) // 2) + 4


def _nearest_int(v: np.ndarray) -> np.ndarray:
    return np.rint(v.astype(F32)).astype(np.int64)


def base_rows(logits: np.ndarray, targets: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """log_softmax(n_vocab, logits, log_prob, tok) for each row: (uint16 [rows, nv], nll float64 [rows])."""
    x = np.ascontiguousarray(logits, F32)
    rows, n_vocab = x.shape
    mx = x.max(axis=1)
    mn = np.maximum(x.min(axis=1), mx - F32(16))
    sum_exp = np.exp(x - mx[:, None]).astype(np.float64).sum(axis=1)
    lse = np.log(sum_exp).astype(F32)
    min_log_prob = (mn - mx - lse).astype(F32)
    scale = ((mx - mn) / F32(65535)).astype(F32)
    out = np.zeros((rows, _nv(n_vocab)), np.uint16)
    out[:, 0:2] = scale.reshape(-1, 1).view(np.uint16)
    out[:, 2:4] = min_log_prob.reshape(-1, 1).view(np.uint16)
    with np.errstate(divide="ignore", invalid="ignore"):
        inv = np.where(scale != 0, F32(1) / np.where(scale != 0, scale, F32(1)), F32(0)).astype(F32)
    q = _nearest_int(inv[:, None] * (x - mn[:, None]))
    q = np.where((x > mn[:, None]) & (scale[:, None] != 0), q, 0)
    out[:, 4:4 + n_vocab] = q.astype(np.uint16)
    nll = (mx + lse).astype(np.float64) - x[np.arange(rows), targets].astype(np.float64)
    return out, nll


class BaseWriter:
    """Streams the base model's log-probabilities as perplexity runs (its ``on_logits``)."""

    def __init__(self, path, n_ctx: int, n_vocab: int, tokens: np.ndarray, n_chunk: int):
        self.f = open(path, "wb")
        self.f.write(MAGIC + struct.pack("<Iii", n_ctx, n_vocab, n_chunk))
        self.f.write(np.asarray(tokens[:n_chunk * n_ctx], "<i4").tobytes())

    def __call__(self, c, chunk, logits) -> None:
        first = len(chunk) // 2
        rows, _ = base_rows(logits, chunk[first + 1:])
        self.f.write(rows.astype("<u2").tobytes())

    def close(self) -> None:
        self.f.close()


@dataclass
class BaseFile:
    n_ctx: int
    n_vocab: int
    n_chunk: int
    tokens: np.ndarray
    rows: np.ndarray          # uint16 [n_chunk, n_ctx - 1 - n_ctx/2, nv]


def read_base(path) -> BaseFile:
    with open(path, "rb") as f:
        buf = f.read()
    if buf[:8] != MAGIC:
        raise ValueError(f"{path} does not look like a file containing log-probabilities")
    n_ctx, n_vocab, n_chunk = struct.unpack_from("<Iii", buf, 8)
    pos = 20
    tokens = np.frombuffer(buf, "<i4", n_ctx * n_chunk, pos).astype(np.int32)
    pos += 4 * n_ctx * n_chunk
    per = n_ctx - 1 - n_ctx // 2
    nv = _nv(n_vocab)
    have = (len(buf) - pos) // (2 * per * nv)
    if have < n_chunk:
        raise ValueError(f"{path}: log-probabilities for {have} of {n_chunk} chunks")
    rows = np.frombuffer(buf, "<u2", n_chunk * per * nv, pos).reshape(n_chunk, per, nv)
    return BaseFile(n_ctx, n_vocab, n_chunk, tokens, rows)


@dataclass
class KLDStats:
    """kl_divergence_result: running sums, and each position's KLD and Δp for the percentiles."""
    sum_nll: float = 0.0
    sum_nll2: float = 0.0
    sum_nll_base: float = 0.0
    sum_nll_base2: float = 0.0
    sum_nll_nll_base: float = 0.0
    sum_kld: float = 0.0
    sum_kld2: float = 0.0
    sum_p_diff: float = 0.0
    sum_p_diff2: float = 0.0
    sum_p_diff4: float = 0.0
    max_p_diff: float = 0.0
    n_same_top: int = 0
    count: int = 0
    kld_values: list = field(default_factory=list)
    p_diff_values: list = field(default_factory=list)

    def add(self, logits: np.ndarray, base: np.ndarray, targets: np.ndarray) -> None:
        """The rows of one chunk: logits float32 [rows, n_vocab], base uint16 [rows, nv], targets [rows]."""
        x = np.ascontiguousarray(logits, F32)
        rows, n_vocab = x.shape
        imax = x.argmax(axis=1)
        mx = x.max(axis=1)
        lse = np.log(np.exp(x - mx[:, None]).astype(np.float64).sum(axis=1)).astype(F32)
        hdr = np.ascontiguousarray(base[:, 0:4]).view(F32)
        scale, min_log_prob = hdr[:, 0], hdr[:, 1]
        q = base[:, 4:4 + n_vocab].astype(F32)
        r = np.arange(rows)
        nll = (mx + lse - x[r, targets]).astype(F32).astype(np.float64)
        nll_base = (-(scale * q[r, targets] + min_log_prob)).astype(F32).astype(np.float64)
        p_log_base = (scale[:, None] * q + min_log_prob[:, None]).astype(F32)
        imax_base = p_log_base.argmax(axis=1)
        top = (mx + lse).astype(F32)
        keep = p_log_base > F32(-16)
        with np.errstate(over="ignore", invalid="ignore"):
            terms = np.where(keep, np.exp(p_log_base) * (p_log_base - x + top[:, None]), F32(0))
        kld = terms.astype(np.float64).sum(axis=1)
        p_diff = (np.exp(-nll.astype(F32)) - np.exp(-nll_base.astype(F32))).astype(F32)
        pd = p_diff.astype(np.float64)
        self.sum_nll += nll.sum()
        self.sum_nll2 += (nll * nll).sum()
        self.sum_nll_base += nll_base.sum()
        self.sum_nll_base2 += (nll_base * nll_base).sum()
        self.sum_nll_nll_base += (nll * nll_base).sum()
        self.sum_kld += kld.sum()
        self.sum_kld2 += (kld * kld).sum()
        self.sum_p_diff += pd.sum()
        self.sum_p_diff2 += (pd * pd).sum()
        self.sum_p_diff4 += (pd ** 4).sum()
        self.max_p_diff = max(self.max_p_diff, float(np.abs(p_diff).max(initial=0)))
        self.n_same_top += int((imax == imax_base).sum())
        self.count += rows
        self.kld_values += kld.astype(F32).tolist()
        self.p_diff_values += p_diff.tolist()

    # ------------------------------------------------------------------ llama-perplexity's printout
    @staticmethod
    def _mean_unc(s, s2, n):
        if n < 1:
            return 0.0, 0.0
        f = s / n
        df = s2 / n - f * f
        return f, (math.sqrt(df / (n - 1)) if df > 0 and n > 10 else 0.0)

    def _cov(self):
        n = self.count
        if n < 10:
            return 0.0
        return (self.sum_nll_nll_base / n - (self.sum_nll / n) * (self.sum_nll_base / n)) / (n - 1)

    def chunk_line(self, i: int) -> str:
        lp, lpu = self._mean_unc(self.sum_nll, self.sum_nll2, self.count)
        lb, lbu = self._mean_unc(self.sum_nll_base, self.sum_nll_base2, self.count)
        ratio_unc = math.sqrt(max(0.0, lpu * lpu + lbu * lbu - 2 * self._cov()))
        kl, klu = self._mean_unc(self.sum_kld, self.sum_kld2, self.count)
        mse, mseu = self._mean_unc(self.sum_p_diff2, self.sum_p_diff4, self.count)
        rms = math.sqrt(mse)
        rms_unc = 0.5 / rms * mseu if rms else 0.0
        top = self.n_same_top / self.count
        top_unc = math.sqrt(top * (1 - top) / (self.count - 1)) if self.count > 1 else 0.0
        return (f"{i:4d}    {math.exp(lp):9.4f} ± {math.exp(lp) * lpu:9.4f}    {lp - lb:10.5f} ± {ratio_unc:10.5f}"
                f"    {kl:10.5f} ± {klu:10.5f}    {100 * rms:6.3f} ± {100 * rms_unc:6.3f} %"
                f"    {100 * top:6.3f} ± {100 * top_unc:6.3f} %")

    def summary(self) -> str:
        if self.count < 100:
            return ""
        kv = np.sort(np.array(self.kld_values, F32))
        pv = np.sort(np.array(self.p_diff_values, F32))

        def pct(v, frac):
            p = F32(frac) * F32(len(v) - 1)
            ip = int(p)
            p = F32(p - F32(ip))
            return float((F32(1) - p) * v[ip] + p * v[min(ip + 1, len(v) - 1)])

        def median(v):
            n = len(v)
            return float(F32(0.5) * (v[n // 2] + v[n // 2 - 1])) if n % 2 == 0 else float(v[n // 2])
        lp, lpu = self._mean_unc(self.sum_nll, self.sum_nll2, self.count)
        lb, lbu = self._mean_unc(self.sum_nll_base, self.sum_nll_base2, self.count)
        cov = self._cov()
        ppl, ppl_u = math.exp(lp), math.exp(lp) * lpu
        pb, pb_u = math.exp(lb), math.exp(lb) * lbu
        cor = cov / (lpu * lbu) if lpu * lbu else 0.0
        r, ru = lp - lb, math.sqrt(max(0.0, lpu * lpu + lbu * lbu - 2 * cov))
        pr, pru = math.exp(r), math.exp(r) * ru
        d, du = ppl - pb, math.sqrt(max(0.0, ppl_u * ppl_u + pb_u * pb_u - 2 * ppl * pb * cov))
        kl, klu = self._mean_unc(self.sum_kld, self.sum_kld2, self.count)
        pdm, pdu = self._mean_unc(self.sum_p_diff, self.sum_p_diff2, self.count)
        mse, mseu = self._mean_unc(self.sum_p_diff2, self.sum_p_diff4, self.count)
        rms = math.sqrt(mse)
        rms_u = 0.5 / rms * mseu if rms else 0.0
        top = self.n_same_top / self.count
        out = ["====== Perplexity statistics ======",
               f"Mean PPL(Q)                   : {ppl:10.6f} ± {ppl_u:10.6f}",
               f"Mean PPL(base)                : {pb:10.6f} ± {pb_u:10.6f}",
               f"Cor(ln(PPL(Q)), ln(PPL(base))): {100 * cor:6.2f}%",
               f"Mean ln(PPL(Q)/PPL(base))     : {r:10.6f} ± {ru:10.6f}",
               f"Mean PPL(Q)/PPL(base)         : {pr:10.6f} ± {pru:10.6f}",
               f"Mean PPL(Q)-PPL(base)         : {d:10.6f} ± {du:10.6f}", "",
               "====== KL divergence statistics ======",
               f"Mean    KLD: {kl:10.6f} ± {klu:10.6f}",
               f"Maximum KLD: {float(kv[-1]):10.6f}"]
        for lab, fr in (("99.9%", .999), ("99.0%", .99), ("95.0%", .95), ("90.0%", .9)):
            out.append(f"{lab}   KLD: {pct(kv, fr):10.6f}")
        out.append(f"Median  KLD: {median(kv):10.6f}")
        for lab, fr in (("10.0%", .1), (" 5.0%", .05), (" 1.0%", .01), (" 0.1%", .001)):
            out.append(f"{lab}   KLD: {pct(kv, fr):10.6f}")
        out += [f"Minimum KLD: {float(kv[0]):10.6f}", "", "====== Token probability statistics ======",
                f"Mean    Δp: {100 * pdm:6.3f} ± {100 * pdu:5.3f} %",
                f"Maximum Δp: {100 * float(pv[-1]):6.3f}%"]
        for lab, fr in (("99.9%", .999), ("99.0%", .99), ("95.0%", .95), ("90.0%", .9), ("75.0%", .75)):
            out.append(f"{lab}   Δp: {100 * pct(pv, fr):6.3f}%")
        out.append(f"Median  Δp: {100 * median(pv):6.3f}%")
        for lab, fr in (("25.0%", .25), ("10.0%", .1), (" 5.0%", .05), (" 1.0%", .01), (" 0.1%", .001)):
            out.append(f"{lab}   Δp: {100 * pct(pv, fr):6.3f}%")
        out += [f"Minimum Δp: {100 * float(pv[0]):6.3f}%",
                f"RMS Δp    : {100 * rms:6.3f} ± {100 * rms_u:5.3f} %",
                f"Same top p: {100 * top:6.3f} ± {100 * math.sqrt(top * (1 - top) / (self.count - 1)):5.3f} %"]
        return "\n".join(out)


CHUNK_HEADER = ("chunk             PPL               ln(PPL(Q)/PPL(base))          KL Divergence              "
                "Δp RMS            Same top p")


def kl_divergence(model, base: BaseFile, n_batch=None, max_chunks=None, fast=False, on_line=None,
                  loras=None) -> KLDStats:
    """Runs ``model`` over the base file's tokens and compares its log-probabilities with the stored ones."""
    from .perplexity import perplexity
    n_vocab = model.hparams.n_vocab
    if n_vocab != base.n_vocab:
        raise ValueError(f"inconsistent vocabulary ({base.n_vocab} in the base file vs {n_vocab})")
    st = KLDStats()
    first = base.n_ctx // 2

    def on_logits(c, chunk, logits):
        st.add(logits, base.rows[c], chunk[first + 1:])
        if on_line:
            on_line(st.chunk_line(c + 1))
    n_chunk = base.n_chunk if not max_chunks else min(max_chunks, base.n_chunk)
    perplexity(model, "", n_ctx=base.n_ctx, n_batch=n_batch, max_chunks=n_chunk, fast=fast,
               tokens=base.tokens.tolist(), on_logits=on_logits, loras=loras)
    return st
