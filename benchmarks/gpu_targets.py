"""The issue's GPU targets from one gpu_check.sh run's files, one line each: met, missed, or not measured and why.

    python benchmarks/gpu_targets.py OUT_DIR

Reads OUT_DIR/bench.json (gpu_bench.py --json: llampy's pp/tg and the decode limit, the copy bandwidth over the
weight bytes a token reads), OUT_DIR/lb_<type>.json (llama-bench -o json on the same files), OUT_DIR/partial.json
(tg with half the layers offloaded, then none) and OUT_DIR/pytest_*.log; writes OUT_DIR/targets.json.
Targets (7B shape, Q4_K_M): decode >= 1.2x llama.cpp's CUDA build on the same device and >= 60% of the copy
bandwidth limit, prompt >= 1.0x llama.cpp; half the layers on the GPU beats CPU-only; the real models' greedy
tokens equal the CPU backend's and their log-probs are within 0.05, each model on its own lines (the lines
tests/cuda/test_cuda_model.py's test prints, run with -s by gpu_check.sh).
"""
from __future__ import annotations

import json
import re
import sys
from pathlib import Path

DECODE_RATIO, ROOFLINE, PROMPT_RATIO = 1.2, 0.60, 1.0
REAL_MODELS, REAL_LOGPROB = ("smollm2", "gemma3"), 0.05
_REAL_LINE = re.compile(r"^real-model (\w+): (\d+) of (\d+) greedy tokens equal \(first difference: (\w+)\), "
                        r"max \|dlogprob\| (\S+)")


def _json(path: Path):
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def llama_bench_figures(path: Path) -> dict:
    """{"pp": t/s, "tg": t/s} of a llama-bench -o json file (empty if absent or unreadable)."""
    out = {}
    for r in _json(path) or []:
        out["pp" if r.get("n_prompt") and not r.get("n_gen") else "tg"] = r.get("avg_ts")
    return out


def _pytest_summary(log: Path) -> str | None:
    try:
        lines = [ln for ln in log.read_text().splitlines() if re.search(r"\d+ (passed|failed|skipped|error)", ln)]
    except OSError:
        return None
    if not lines:
        return None
    skips = [ln.split(": ", 1)[-1] for ln in log.read_text().splitlines() if ln.startswith("SKIPPED")]
    return lines[-1].strip("= ") + (f" ({skips[0]})" if skips else "")


def real_model_line(model: str, same: list[bool], max_dlogprob: float) -> str:
    """The line test_cuda_model.py's real-model test prints (the parser below reads it back)."""
    first = same.index(False) if False in same else None
    return (f"real-model {model}: {sum(same)} of {len(same)} greedy tokens equal (first difference: {first}), "
            f"max |dlogprob| {max_dlogprob:.4g}")


def _real_model_lines(log: Path) -> dict:
    """{model: (tokens equal, tokens, first difference, max |dlogprob|)} from test_cuda_model.py's lines (pytest -s)."""
    try:
        text = log.read_text()
    except OSError:
        return {}
    out = {}
    for ln in text.splitlines():
        m = _REAL_LINE.match(ln)
        if m:
            out[m[1]] = (int(m[2]), int(m[3]), m[4], float(m[5]))
    return out


def targets(out: Path) -> list[dict]:
    bench = _json(out / "bench.json") or {}
    rows = {r["type"]: r for r in bench.get("rows", [])}
    res = []

    def add(name, ok, detail):
        res.append({"target": name, "met": ok, "detail": detail})

    q = rows.get("Q4_K_M")
    lc = llama_bench_figures(out / "lb_Q4_K_M.json")
    if q is None:
        for name in ("decode >= 1.2x llama.cpp", "decode >= 60% of the limit", "prompt >= 1.0x llama.cpp"):
            add(name, None, "no Q4_K_M row in bench.json (gpu_bench did not finish)")
    else:
        tg, pp = q.get("tg"), q.get("pp")
        if lc.get("tg") and tg:
            add("decode >= 1.2x llama.cpp", tg / lc["tg"] >= DECODE_RATIO,
                f"llampy tg {tg:.1f} t/s, llama.cpp {lc['tg']:.1f}: {tg / lc['tg']:.2f}x")
        else:
            add("decode >= 1.2x llama.cpp", None, f"llampy tg {tg}; llama.cpp not measured (no lb_Q4_K_M.json)")
        frac = q.get("tg_of_roofline")
        if frac == frac and frac is not None and q.get("roofline_tg") == q.get("roofline_tg"):   # not NaN
            add("decode >= 60% of the limit", frac >= ROOFLINE,
                f"{tg:.1f} of {q['roofline_tg']:.0f} t/s (copy bandwidth / weight bytes per token): {100 * frac:.0f}%")
        else:
            add("decode >= 60% of the limit", None, "no copy bandwidth (not on a GPU)")
        if lc.get("pp") and pp:
            add("prompt >= 1.0x llama.cpp", pp / lc["pp"] >= PROMPT_RATIO,
                f"llampy pp {pp:.0f} t/s, llama.cpp {lc['pp']:.0f}: {pp / lc['pp']:.2f}x")
        else:
            add("prompt >= 1.0x llama.cpp", None, f"llampy pp {pp}; llama.cpp not measured")
    part = {r["n_gpu_layers"]: r.get("tg8") for r in _json(out / "partial.json") or []}
    half = [k for k in part if k > 0]
    if half and 0 in part and part[half[0]] and part[0]:
        add("half the layers beats CPU-only", part[half[0]] > part[0],
            f"{half[0]} layers offloaded {part[half[0]]:.1f} t/s, none {part[0]:.1f} t/s (tg8)")
    else:
        add("half the layers beats CPU-only", None, "not measured")
    real = _pytest_summary(out / "pytest_real.log")
    lines = _real_model_lines(out / "pytest_real.log")
    for m in REAL_MODELS:
        if m not in lines:
            why = "not run" if real is None else real
            add(f"real model {m}: greedy tokens as the CPU backend's", None, why)
            add(f"real model {m}: log-probs within {REAL_LOGPROB}", None, why)
            continue
        same, n, first, dlp = lines[m]
        add(f"real model {m}: greedy tokens as the CPU backend's", same == n,
            f"{same} of {n} equal" + ("" if first == "None" else f", first difference at step {first}"))
        add(f"real model {m}: log-probs within {REAL_LOGPROB}", dlp <= REAL_LOGPROB,
            f"max |dlogprob| {dlp:.4g} over the greedy steps")
    return res


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    out = Path(argv[0] if argv else "/tmp/gpu_check")
    bench = _json(out / "bench.json") or {}
    print(f"device: {bench.get('device', '?')}")
    for name in ("backend", "model"):
        s = _pytest_summary(out / f"pytest_{name}.log")
        if s:
            print(f"tests/cuda/test_cuda_{name}.py: {s}")
    print("| type | llampy pp / tg | llama.cpp pp / tg | ratio pp / tg | % of the decode limit |")
    print("| --- | --- | --- | --- | --- |")
    for r in bench.get("rows", []):
        lc = llama_bench_figures(out / f"lb_{r['type']}.json")
        lcs = f"{lc['pp']:.0f} / {lc['tg']:.1f}" if lc.get("pp") and lc.get("tg") else "-"
        rat = f"{r['pp'] / lc['pp']:.2f} / {r['tg'] / lc['tg']:.2f}" if lc.get("pp") and lc.get("tg") else "-"
        roof = r.get("tg_of_roofline")
        roofs = f"{100 * roof:.0f}% of {r['roofline_tg']:.0f}" if roof == roof and roof is not None else "-"
        print(f"| {r['type']} | {r['pp']:.0f} / {r['tg']:.1f} | {lcs} | {rat} | {roofs} |")
    res = targets(out)
    for t in res:
        mark = {True: "MET", False: "MISSED", None: "NOT MEASURED"}[t["met"]]
        print(f"target {t['target']}: {mark} ({t['detail']})")
    (out / "targets.json").write_text(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
