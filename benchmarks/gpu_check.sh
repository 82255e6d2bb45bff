#!/bin/bash
# One GPU session's checks in one go (for a lent machine with no network; see benchmarks/README.md):
#   bash benchmarks/gpu_check.sh [OUT_DIR] [TOTAL_SECONDS]
# llama.cpp's CUDA build in the background (sources from scripts/llamacpp_cuda_src.sh in .llamacpp-src, carried),
# the CUDA backend's tests on the GPU, the integer decode kernels' launch shapes timed over a 7B layer's matrices
# (gpu_matvec.py --small-grid, chosen by gpu_pick_shapes.py), the F16 kernel's (--half), gpu_bench.py with them,
# llama-bench on the same files, and partial offload against CPU-only. Each step is bounded so that the whole
# fits TOTAL_SECONDS (default 540); what does not fit is skipped.
cd "$(dirname "$0")/.."
OUT=${1:-${OUT:-/tmp/gpu_check}}
TOTAL=${2:-540}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD LLAMPY_TEST_CUDA=1
T0=$(date +%s)
el() { echo $(( $(date +%s) - T0 )); }
left() { echo $(( TOTAL - $(el) )); }
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
if [ -d .llamacpp-src ]; then
  ( cd .llamacpp-src && cmake -B build -DGGML_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90 -DGGML_NATIVE=ON -DGGML_CUDA_FA=OFF \
      -DLLAMA_CURL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=OFF \
      -DCMAKE_BUILD_TYPE=Release > "$OUT/cmake.log" 2>&1 \
    && nice cmake --build build --target llama-bench -j "$(( $(nproc) - 2 ))" > "$OUT/build.log" 2>&1
    echo "build rc $? at $(el) s" >> "$OUT/build.log" ) &
fi
timeout 80 python3 -m pytest -q -p no:cacheprovider tests/cuda/test_cuda_backend.py > "$OUT/pytest.log" 2>&1
echo "tests rc $? at $(el) s"; grep -E "passed|failed" "$OUT/pytest.log" | tail -3
for sh in 4096x4096 11008x4096 4096x11008; do
  case $sh in 4096x4096) ty=Q4_K,Q6_K,Q4_0,Q8_0;; 11008x4096) ty=Q4_K,Q4_0,Q8_0;; 4096x11008) ty=Q6_K,Q4_0,Q8_0;; esac
  timeout 60 python3 benchmarks/gpu_matvec.py --types $ty --shape $sh --small-grid --timings "$OUT/mv_$sh.json" \
    > "$OUT/mv_$sh.log" 2>&1
done
python3 benchmarks/gpu_pick_shapes.py "$OUT/shapes.json" "$OUT"/mv_*.json | tail -1
timeout 60 python3 benchmarks/gpu_matvec.py --half --shape 4096x4096,11008x4096,4096x11008 > "$OUT/half.log" 2>&1
HS=$(grep -o "half-shape [0-9,]*" "$OUT/half.log" | cut -d" " -f2); echo "F16 kernel: ${HS:-default}"
timeout $(( $(left) - 150 )) python3 benchmarks/gpu_bench.py --types Q4_K_M,Q4_0,Q8_0,F16 -r 2 --keep \
  --mmvq-shapes "$OUT/shapes.json" ${HS:+--half-shape $HS} --json "$OUT/bench.json" > "$OUT/bench.log" 2>&1
echo "gpu_bench rc $? at $(el) s"; grep -E "^\| llama" "$OUT/bench.log"
LB=.llamacpp-src/build/bin/llama-bench
while [ "$(left)" -gt 90 ] && [ -d .llamacpp-src ] && ! grep -q "build rc" "$OUT/build.log" 2>/dev/null; do sleep 3; done
if [ -x $LB ]; then
  for f in Q4_K_M Q4_0 Q8_0 F16; do
    [ "$(left)" -lt 60 ] && break
    timeout $(( $(left) - 45 )) $LB -m /tmp/gpu_bench/llama2-7b-$f.gguf -ngl 99 -fa 0 -p 512 -n 128 -r 2 -o md 2>/dev/null \
      | grep -E "^\| llama"
  done
fi
# a quantized KV cache on the GPU (both sides: -ctk/-ctv q8_0), the Q4_K_M file again
if [ "$(left)" -gt 120 ]; then
  timeout $(( $(left) - 80 )) python3 benchmarks/gpu_bench.py --types Q4_K_M -r 2 --keep --reuse -ctk q8_0 -ctv q8_0 \
    --mmvq-shapes "$OUT/shapes.json" ${HS:+--half-shape $HS} $( [ -x $LB ] && echo --llama-bench $LB ) \
    > "$OUT/bench_kvq8.log" 2>&1
  echo "gpu_bench q8_0 cache rc $? at $(el) s"; grep -E '^\{' "$OUT/bench_kvq8.log" | tail -1
fi
[ "$(left)" -gt 40 ] && timeout $(( $(left) - 5 )) python3 - <<'PY'
import json, os
from llampy.llama.bench import bench
from llampy.llama.model import Model
path = "/tmp/gpu_bench/llama2-7b-Q4_K_M.gguf"
for ngl in (16, 0):          # half the layers, then none: partial offload against CPU-only
    r = {x.test[:2]: x.avg_ts for x in bench(Model(path, n_gpu_layers=ngl), 0, 8, 1, n_threads=os.cpu_count() or 1)}
    print(json.dumps({"n_gpu_layers": ngl, "tg8": r.get("tg")}), flush=True)
PY
echo "done at $(el) s"
