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
    ap.add_argument("--small-grid", action="store_true", help="the integer kernels only: programs of 1-2 rows "
                    "and 1-2 warps, beside the backend's current shape")
    ap.add_argument("--variant-grid", action="store_true", help="the integer kernels only (both variants), on a "
                    "smaller grid of launch shapes")
    ap.add_argument("--json", default=None, help="write the best integer-kernel shape per type here "
                    "(gpu_bench.py --mmvq-shapes reads it)")
    ap.add_argument("--half", action="store_true", help="the F16/BF16 decode kernel (matvec_half) over a grid of "
                    "launch shapes instead")
    args = ap.parse_args(argv)
    if args.half:
        return half_grid(args)
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
        for bn in (() if args.variant_grid or args.small_grid else (4,) if quick else (1, 4, 8, 16, 32)):
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
            cur = MMVQ.SHAPES[t]
            cur_var = next(v for v, f in MMVQ.VARIANTS[t].items() if f is MMVQ.KERNELS[t][0])
            for var, kern in MMVQ.VARIANTS[t].items():
                for bn in (1, 2, 4, 8):
                    for sb in sbs:
                        for warps in (1, 2, 4, 8):
                            if args.small_grid:     # small programs, and the backend's current choice
                                if not (bn <= 2 and warps <= 2) and (var, bn, sb, warps) != (cur_var, *cur):
                                    continue
                            elif warps < 4 or args.variant_grid and (bn == 1 or (warps == 8 and bn < 4)):
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


def half_grid(args) -> int:
    """matvec_half's launch shapes (rows per program, K tile, warps) on each --shape (comma-separated), F16
    weights: GB/s each, and the shape with the least total time over them."""
    import torch
    import triton
    from llampy.ggml.backends.cuda import kernels as K
    dev = torch.device("cuda")
    tot: dict = {}
    for shape in args.shape.split(","):
        n, k = (int(v) for v in shape.split("x"))
        w = (torch.randn((n, k), device=dev) * 0.02).to(torch.float16)
        x = torch.randn((1, k), device=dev)
        want = (w.float() @ x.half().float().t()).t()
        rows = []
        for bn in (1, 2, 4, 8, 16):
            for bk in (256, 512, 1024, 2048):
                for warps in (2, 4, 8):
                    if bn * bk > 16384 or bn * bk < 256 * warps:
                        continue
                    y = torch.empty((1, n), device=dev)

                    def go():
                        K.matvec_half[((n + bn - 1) // bn,)](w, x, y, n, k, k, k, n, NC=1, BN=bn, BK=bk,
                                                             num_warps=warps)
                    go()
                    torch.cuda.synchronize()
                    err = float((y - want).abs().max() / want.abs().max())
                    ms = triton.testing.do_bench(go, warmup=5, rep=30)
                    rows.append((2 * n * k / ms / 1e6, bn, bk, warps, ms * 1e3, err))
                    if err < 1e-4:
                        tot[(bn, bk, warps)] = tot.get((bn, bk, warps), 0.0) + ms * 1e3
        rows.sort(key=lambda r: -r[0])
        print(f"\nF16 {shape}: best launch shapes\n| GB/s | BN | BK | warps | us | rel. err |")
        for r in rows[:6]:
            print(f"| {r[0]:.0f} | {r[1]} | {r[2]} | {r[3]} | {r[4]:.1f} | {r[5]:.1e} |")
    best = min(tot, key=tot.get)
    print(f"\nbest over the shapes: --half-shape {best[0]},{best[1]},{best[2]} ({tot[best]:.1f} us in all)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
