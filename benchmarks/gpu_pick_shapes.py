"""Choose each integer decode kernel's variant and launch shape by the weighted sum of its timings over a 7B
layer's matrix shapes (gpu_matvec.py --timings files), and write gpu_bench.py --mmvq-shapes' JSON.

    python benchmarks/gpu_pick_shapes.py OUT.json TIMINGS.json [TIMINGS.json ...]
"""
import json
import sys

out, files = sys.argv[1], sys.argv[2:]
# weight of each (type, shape) in a Llama 2 7B Q4_K_M / Q4_0 / Q8_0 decode step, per layer
W = {("Q4_K", "4096x4096"): 3, ("Q4_K", "11008x4096"): 2, ("Q6_K", "4096x4096"): 1, ("Q6_K", "4096x11008"): 1,
     ("Q6_K", "32000x4096"): 1 / 32, ("Q4_0", "4096x4096"): 4, ("Q4_0", "11008x4096"): 2, ("Q4_0", "4096x11008"): 1,
     ("Q8_0", "4096x4096"): 4, ("Q8_0", "11008x4096"): 2, ("Q8_0", "4096x11008"): 1}
tot = {}
for f in files:
    d = json.load(open(f))
    for t, cfgs in d["us"].items():
        w = W.get((t, d["shape"]), 1)
        for c, us in cfgs.items():
            tot.setdefault(t, {}).setdefault(c, [0.0, 0])
            tot[t][c][0] += w * us
            tot[t][c][1] += 1
res = {}
for t, cfgs in tot.items():
    n = max(v[1] for v in cfgs.values())
    full = {c: v[0] for c, v in cfgs.items() if v[1] == n}
    ranked = sorted(full.items(), key=lambda kv: kv[1])
    print(t, "best:", ranked[:4], "worst:", ranked[-1])
    var, bn, sb, warps = ranked[0][0].split(",")
    res[t] = [int(bn), int(sb), int(warps), var]
json.dump(res, open(out, "w"))
print("chosen:", res)
