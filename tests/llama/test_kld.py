"""llampy perplexity --kl-divergence-base / --kl-divergence: llama-perplexity's base file and statistics."""
from __future__ import annotations

import re
import struct

import numpy as np

from llampy.cli import main
from llampy.llama.kld import KLDStats, base_rows, read_base
from tests.paths import ROOT

TINY = ROOT.parent / "shared" / "fixtures" / "tiny"
MODEL = TINY / "llama-F32.gguf"
TEXT = TINY / "seed004_first6000.txt"


def test_base_rows_encode_log_probs():
    rng = np.random.default_rng(0)
    logits = (rng.standard_normal((5, 1001)) * 4).astype(np.float32)
    targets = rng.integers(0, 1001, 5)
    rows, nll = base_rows(logits, targets)
    assert rows.shape == (5, 2 * 501 + 4) and (rows[:, 4 + 1001:] == 0).all()
    scale, mlp = np.ascontiguousarray(rows[:, :4]).view(np.float32).T
    logp = logits - np.log(np.exp(logits.astype(np.float64)).sum(1, keepdims=True))
    dec = scale[:, None] * rows[:, 4:4 + 1001] + mlp[:, None]
    inside = logp > logp.max(1, keepdims=True) - 16
    assert np.abs(dec - logp)[inside].max() < 16 / 65535 + 1e-4
    assert np.allclose(nll, -logp[np.arange(5), targets], atol=1e-4)
    st = KLDStats()
    st.add(logits, rows, targets)          # the model against its own base: KLD ~ 0, same top token everywhere
    assert st.n_same_top == 5 and abs(st.sum_kld) < 1e-3


def test_kl_divergence_cli(tmp_path, capsys):
    base = tmp_path / "base.kld"
    args = [str(MODEL), "-f", str(TEXT), "-c", "128", "--chunks", "2", "-t", "1"]
    assert main(["perplexity", *args, "--kl-divergence-base", str(base)]) == 0
    raw = base.read_bytes()
    assert raw[:8] == b"_logits_"
    n_ctx, n_vocab, n_chunk = struct.unpack_from("<Iii", raw, 8)
    assert (n_ctx, n_vocab, n_chunk) == (128, 49152, 2)
    assert len(raw) == 20 + 4 * 128 * 2 + 2 * 2 * 63 * (49152 + 4)
    b = read_base(base)
    assert b.rows.shape == (2, 63, 49156)
    capsys.readouterr()
    assert main(["perplexity", str(MODEL), "-c", "128", "-t", "1", "--kl-divergence-base", str(base),
                 "--kl-divergence"]) == 0
    out = capsys.readouterr().out
    # the base logits are stored as 16-bit steps (llama.cpp's format), so the model against itself is 0 up to
    # that rounding, of either sign
    kld = float(re.search(r"Mean    KLD:\s+(-?[0-9.]+)", out).group(1))
    assert abs(kld) < 1e-4 and "Same top p: 100.000 ± 0.000 %" in out
    for line in ("Mean PPL(Q)", "Cor(ln(PPL(Q)), ln(PPL(base)))", "99.9%   KLD:", "Median  KLD:", "RMS Δp",
                 "Minimum Δp:"):
        assert line in out
