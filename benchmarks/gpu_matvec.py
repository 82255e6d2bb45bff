"""The CUDA backend's decode kernel alone: GB/s of the Triton matvec per block format and launch shape, against
the device's copy bandwidth, and whether a CUDA graph captures it.

    python benchmarks/gpu_matvec.py [--types Q4_K,Q4_0,Q8_0,Q6_K] [--shape 4096x4096]

For each format: weights of N rows of K values (64 random quantized rows, repeated), one activation row; every
(rows per program, K tile, warps, K split) of a small grid is timed with triton.testing.do_bench and checked
against the first; the table lists the best shapes. GB/s counts the weight bytes read once per product.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main(argv=None) -> int:
    import torch
    import triton
    from llampy.ggml.backends.cuda import kernels as K
    from llampy.ggml.backends.cuda import mmvq as MMVQ
    from llampy.ggml.quants import quantize
    from llampy.ggml.quants_tables import kvalues_iq4nl
    from llampy.ggml.types import GGMLType, TYPE_TRAITS

    ap = argparse.ArgumentParser()
    ap.add_argument("--types", default="Q4_K,Q4_0,Q8_0,Q6_K")
    ap.add_argument("--shape", default="4096x4096")
    ap.add_argument("--quick", action="store_true", help="value rules at one launch shape")
    ap.add_argument("--no-mmvq", action="store_true")
    ap.add_argument("--timings", default=None, help="write every integer-kernel timing here (JSON), to choose "
                    "launch shapes over several matrix shapes")
    ap.add_argument("--variant-grid", action="store_true", help="the integer kernels only (both variants), on a "
                    "smaller grid of launch shapes")
    ap.add_argument("--json", default=None, help="write the best integer-kernel shape per type here "
                    "(gpu_bench.py --mmvq-shapes reads it)")
    args = ap.parse_args(argv)
    best = {}
    timings: dict = {}      # type -> "variant,BN,SB,warps" -> us (--timings)
    n, k = (int(v) for v in args.shape.split("x"))
    dev = torch.device("cuda")
    lut = torch.tensor(kvalues_iq4nl.astype(np.int8), device=dev)
    a = torch.empty(1 << 30, dtype=torch.uint8, device=dev)
    b = torch.empty_like(a)
    ms = triton.testing.do_bench(lambda: b.copy_(a))
    print(f"copy: {2 * a.numel() / ms / 1e6:.0f} GB/s (read + written)")
    del a, b
    rng = np.random.default_rng(0)
    x = torch.tensor(rng.standard_normal((1, k)).astype(np.float32), device=dev)
    nsm = torch.cuda.get_device_properties(dev).multi_processor_count
    for name in args.types.split(","):
        t = GGMLType[name]
        base = quantize((rng.standard_normal((64, k)) * 0.02).astype(np.float32), t).reshape(64, -1)
        w = torch.tensor(np.tile(base, ((n + 63) // 64, 1))[:n].copy(), device=dev)
        sw = w.shape[1]
        act = K.ACT_OF_DOT_TYPE.get(TYPE_TRAITS[t].vec_dot_type, 0)
        results = []
        ref = None
        quick = args.quick
        for bn in (() if args.variant_grid else (4,) if quick else (1, 4, 8, 16, 32)):
            for bk in ((1024,) if quick else (256, 512, 1024)):
                for warps in ((4,) if quick else (4, 8)):
                    for want in ((32,) if quick else (0, 16, 32)):
                        nkb = (k + bk - 1) // bk
                        split = 1 if want == 0 else max(1, min(nkb, want * nsm // ((n + bn - 1) // bn)))
                        kc = (nkb + split - 1) // split * bk
                        split = (k + kc - 1) // kc
                        part = torch.empty((split, 1, n), dtype=torch.float32, device=dev)
                        y = torch.empty((1, n), dtype=torch.float32, device=dev)

                        def go():
                            K.matvec[((n + bn - 1) // bn, split)](w, x, part, lut, n, k, kc, sw, k, n, n, NC=1,
                                                                  TYPE=int(t), ACT=act, BN=bn, BK=bk,
                                                                  num_warps=warps)
                            if split > 1:
                                torch.sum(part, dim=0, out=y)
                            else:
                                y.copy_(part[0])
                        try:
                            go()
                            torch.cuda.synchronize()
                        except Exception as e:      # a shape the compiler refuses (registers)
                            print(f"{name} BN={bn} BK={bk} warps={warps}: {type(e).__name__}", flush=True)
                            continue
                        if ref is None:
                            ref = y.clone()
                        err = float((y - ref).abs().max() / ref.abs().max())
                        t_ms = triton.testing.do_bench(go, warmup=5, rep=30)
                        results.append((w.numel() / t_ms / 1e6, bn, bk, warps, split, t_ms * 1e3, err))
        if t in MMVQ.KERNELS and not args.no_mmvq:    # the integer kernels (mmvq.py): quantize + one launch
            g = MMVQ.KERNELS[t][1]
            xq = torch.empty(k, dtype=torch.int8, device=dev)
            xd = torch.empty(k // g, dtype=torch.float32, device=dev)
            xs = torch.empty(k // 16, dtype=torch.int32, device=dev)
            extra = {"TYPE": int(t)} if t in MMVQ.TYPE_ARG else {}
            sbs = (16, 32) if g == 32 else (8, 16)
            for var, kern in MMVQ.VARIANTS[t].items():
                for bn in (1, 2, 4, 8):
                    for sb in sbs:
                        for warps in (4, 8):
                            if args.variant_grid and (bn == 1 or (warps == 8 and bn < 4)):
                                continue
                            y = torch.empty((1, n), dtype=torch.float32, device=dev)

                            def go_q():
                                MMVQ.quantize_act[(k // g,)](x, xq, xd, xs, k, G=g)
                                kern[((n + bn - 1) // bn,)](w, xq, xd, xs, y, n, k, sw, BN=bn, SB=sb, ASM=True,
                                                            num_warps=warps, **extra)
                            try:
                                go_q()
                                torch.cuda.synchronize()
                            except Exception as e:
                                print(f"{name} mmvq {var} BN={bn} SB={sb} warps={warps}: {type(e).__name__}: "
                                      f"{str(e)[:300]}", flush=True)
                                continue
                            if ref is None:         # --variant-grid: the first integer kernel is the reference
                                ref = y.clone()
                            err = float((y - ref).abs().max() / ref.abs().max())
                            t_ms = triton.testing.do_bench(go_q, warmup=5, rep=30)
                            results.append((w.numel() / t_ms / 1e6, f"mmvq-{var} {bn}", sb, warps, 1, t_ms * 1e3,
                                            err))
                            if err < 1e-3:
                                timings.setdefault(name, {})[f"{var},{bn},{sb},{warps}"] = t_ms * 1e3
                            if err < 1e-3 and (t not in best or t_ms < best[t][0]):
                                best[t] = (t_ms, bn, sb, warps, var)
        if ref is None:
            continue
        results.sort(key=lambda r: -r[0])
        print(f"\n{name} {n}x{k} ({w.numel() / 2**20:.1f} MiB): best launch shapes")
        print("| GB/s | BN | BK | warps | splits | us | rel. err vs first |")
        print("| --- | --- | --- | --- | --- | --- | --- |")
        for r in results[:8]:
            print(f"| {r[0]:.0f} | {r[1]} | {r[2]} | {r[3]} | {r[4]} | {r[5]:.1f} | {r[6]:.1e} |")
        worst = max(r[6] for r in results)
        print(f"(configurations: {len(results)}, largest disagreement {worst:.1e})", flush=True)

    if args.json:
        import json
        Path(args.json).write_text(json.dumps({t.name: list(v[1:]) for t, v in best.items()}))
    if args.timings:
        import json
        Path(args.timings).write_text(json.dumps({"shape": args.shape, "us": timings}))
    print("best integer-kernel shapes (BN, SB, warps):", {t.name: v[1:] for t, v in best.items()})

    # does a CUDA graph capture the kernel? replay after new input values must follow them
    t = GGMLType.Q4_0
    base = quantize((rng.standard_normal((64, k)) * 0.02).astype(np.float32), t).reshape(64, -1)
    w = torch.tensor(np.tile(base, ((n + 63) // 64, 1))[:n].copy(), device=dev)
    y = torch.empty((1, n), dtype=torch.float32, device=dev)

    def launch():
        K.matvec[((n + 7) // 8, 1)](w, x, y, lut, n, k, k, w.shape[1], k, n, 0, NC=1, TYPE=int(t), ACT=1, BN=8,
                                    BK=256)
    launch()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        launch()
    x.copy_(torch.tensor(rng.standard_normal((1, k)).astype(np.float32), device=dev))
    g.replay()
    torch.cuda.synchronize()
    got = y.clone()
    launch()
    torch.cuda.synchronize()
    print(f"\ncuda graph replay follows new inputs: {bool(torch.allclose(got, y))} "
          f"(max diff {float((got - y).abs().max()):.3e})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
