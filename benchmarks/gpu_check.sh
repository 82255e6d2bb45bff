#!/bin/bash
# The issue's GPU checks and targets in one bounded run, for a lent machine with no network:
#   bash benchmarks/gpu_check.sh [OUT_DIR] [TOTAL_SECONDS]            (defaults /tmp/gpu_check, 480)
# Carry .llamacpp-src (scripts/llamacpp_cuda_src.sh .llamacpp-src, ~27 MB; .gitignore lists it) for
# llama.cpp's side. Steps, each bounded so that the whole fits TOTAL_SECONDS (what does not fit is skipped):
#  1. llama.cpp's CUDA build of llama-bench in the background, niced (GGML_CUDA_FA=OFF shortens it: -fa 0)
#  2. the CUDA backend's tests on the GPU (test_cuda_model.py too where the tiny fixtures are: LLAMPY_SHARED)
#  3. gpu_bench.py: 7B-shaped random models (SHAPE) in TYPES, Q4_K_M first, files kept for step 5
#  4. the real models' greedy tokens against the CPU backend's, while llama.cpp's build finishes (a correctness
#     check: it may share the CPUs). Their files do not fit one call's 64 MiB, so benchmarks/gpu_carry.py sends
#     them in pieces over the calls made while this script runs and puts them together in LLAMPY_REAL_MODELS
#     (smollm2.gguf, gemma3.gguf); this step waits for its READY, REAL_S seconds (default 180 then) being kept
#     for it from step 3. Without LLAMPY_REAL_MODELS the files come from their packages (skipped where they are
#     not installed). Tiny fixtures carried with them (LLAMPY_SHARED) run here too.
#  5. llama-bench on the same files (-ngl 99 -fa 0, -p NP -n NG -r REPS), once the build is done
#  6. partial offload: half the layers against none (tg8, every CPU thread) on the first file
#     (steps 5 and 6 keep AFTER seconds, default 150, for themselves from steps 3 and 4)
#  7. benchmarks/gpu_targets.py: the table and one line per target, met or not (targets.json)
# TUNE=1 first times the integer decode kernels' launch shapes over a 7B layer (gpu_matvec.py --small-grid,
# gpu_pick_shapes.py; ~3 min) and benches with the choice; by default the backend's table (mmvq.SHAPES) is used.
# A smoke run of the script on a CPU (Triton's interpreter, tiny sizes):
#   TRITON_INTERPRET=1 SHAPE=tiny TYPES=Q4_K_M NP=8 NG=4 REPS=1 bash benchmarks/gpu_check.sh /tmp/gc 400
cd "$(dirname "$0")/.."
OUT=${1:-${OUT:-/tmp/gpu_check}}
TOTAL=${2:-480}
SHAPE=${SHAPE:-llama2-7b}
TYPES=${TYPES:-Q4_K_M,Q4_0,Q8_0,F16}
NP=${NP:-512}
NG=${NG:-128}
REPS=${REPS:-2}
DIR=${BENCH_DIR:-/tmp/gpu_bench}
PY=${PYTHON:-python3}
mkdir -p "$OUT" "$DIR"
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD LLAMPY_TEST_CUDA=1
REAL_S=${REAL_S:-$([ -n "$LLAMPY_REAL_MODELS" ] && echo 180 || echo 30)}
AFTER=${AFTER:-150}
T0=$(date +%s)
el() { echo $(( $(date +%s) - T0 )); }
left() { echo $(( TOTAL - $(el) )); }
lb() { echo $(( $(left) - AFTER - REAL_S )); }      # what step 3 may take
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader 2>/dev/null || echo "no nvidia-smi: $(
  [ "$TRITON_INTERPRET" = 1 ] && echo "Triton's interpreter on the CPU" || echo "no GPU")"
LB=.llamacpp-src/build/bin/llama-bench
if [ -d .llamacpp-src ]; then
  ( cd .llamacpp-src && cmake -B build -DGGML_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90 -DGGML_NATIVE=ON -DGGML_CUDA_FA=OFF \
      -DLLAMA_CURL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=OFF \
      -DCMAKE_BUILD_TYPE=Release > "$OUT/cmake.log" 2>&1 \
    && nice -n 19 cmake --build build --target llama-bench -j "$(( $(nproc) - 2 ))" > "$OUT/build.log" 2>&1
    echo "build rc $? at $(el) s" >> "$OUT/build.log" ) &
else
  echo "no .llamacpp-src: llama.cpp's side is not measured" > "$OUT/build.log"
fi

# 2. tests
timeout $(( $(left) / 5 )) $PY -m pytest -q -p no:cacheprovider tests/cuda/test_cuda_backend.py \
  > "$OUT/pytest_backend.log" 2>&1
echo "test_cuda_backend rc $? at $(el) s: $(grep -E "passed|failed" "$OUT/pytest_backend.log" | tail -1)"
SHARED=${LLAMPY_SHARED:-../shared}
if [ -z "$LLAMPY_REAL_MODELS" ] && [ -d "$SHARED/fixtures/tiny" ] && [ "$(left)" -gt 300 ]; then
  timeout 60 $PY -m pytest -q -p no:cacheprovider tests/cuda/test_cuda_model.py -k "not real" \
    > "$OUT/pytest_model.log" 2>&1
  echo "test_cuda_model rc $? at $(el) s: $(grep -E "passed|failed" "$OUT/pytest_model.log" | tail -1)"
fi

# 3. llampy on the 7B-shaped files
SHAPES_ARG=()
if [ "${TUNE:-0}" = 1 ]; then
  for sh in 4096x4096 11008x4096 4096x11008; do
    case $sh in 4096x4096) ty=Q4_K,Q6_K,Q4_0,Q8_0;; 11008x4096) ty=Q4_K,Q4_0,Q8_0;; 4096x11008) ty=Q6_K,Q4_0,Q8_0;; esac
    timeout 60 $PY benchmarks/gpu_matvec.py --types $ty --shape $sh --small-grid --timings "$OUT/mv_$sh.json" \
      > "$OUT/mv_$sh.log" 2>&1
  done
  $PY benchmarks/gpu_pick_shapes.py "$OUT/shapes.json" "$OUT"/mv_*.json | tail -1
  SHAPES_ARG=(--mmvq-shapes "$OUT/shapes.json")
fi
rm -f "$OUT"/bench_*.json
for ty in ${TYPES//,/ }; do
  [ "$(lb)" -lt 60 ] && { echo "gpu_bench $ty: skipped (time)"; continue; }
  timeout $(lb) $PY benchmarks/gpu_bench.py --shapes "$SHAPE" --types "$ty" -p "$NP" -n "$NG" \
    -r "$REPS" --keep --dir "$DIR" "${SHAPES_ARG[@]}" --json "$OUT/bench_$ty.json" > "$OUT/bench_$ty.log" 2>&1
  echo "gpu_bench $ty rc $? at $(el) s: $(grep -E '^\{' "$OUT/bench_$ty.log" | tail -1 | cut -c1-160)"
done
$PY - "$OUT" <<'PY'
import json, sys
from pathlib import Path
out = Path(sys.argv[1])
parts = [json.loads(p.read_text()) for p in sorted(out.glob("bench_*.json"))]
rows = [r for p in parts for r in p["rows"]]
rows.sort(key=lambda r: r["type"] != "Q4_K_M")
dev = parts[0]["device"] if parts else "?"
(out / "bench.json").write_text(json.dumps({"device": dev, "rows": rows}, indent=1))
PY

# 4. the real models (where their files are on this machine, or once gpu_carry.py has put them together there)
if [ -n "$LLAMPY_REAL_MODELS" ]; then
  while [ ! -f "$LLAMPY_REAL_MODELS/READY" ] && [ "$(left)" -gt $(( AFTER + 120 )) ]; do sleep 3; done
  echo "carried files: $([ -f "$LLAMPY_REAL_MODELS/READY" ] && echo all || echo 'not all') there at $(el) s"
fi
if [ "$(left)" -gt $(( AFTER + 30 )) ]; then
  timeout $(( $(left) - AFTER )) $PY -m pytest -q -s -p no:cacheprovider -rs tests/cuda/test_cuda_model.py -k real \
    > "$OUT/pytest_real.log" 2>&1
  echo "real models rc $? at $(el) s: $(grep -E "passed|failed|skipped" "$OUT/pytest_real.log" | tail -1)"
  grep "^real-model" "$OUT/pytest_real.log"
fi
if [ -n "$LLAMPY_REAL_MODELS" ] && [ -d "$SHARED/fixtures/tiny" ] && [ "$(left)" -gt $(( AFTER + 40 )) ]; then
  timeout $(( $(left) - AFTER )) $PY -m pytest -q -p no:cacheprovider tests/cuda/test_cuda_model.py -k "not real" \
    > "$OUT/pytest_model.log" 2>&1
  echo "test_cuda_model rc $? at $(el) s: $(grep -E "passed|failed" "$OUT/pytest_model.log" | tail -1)"
fi

# 5. llama.cpp on the same files
while [ "$(left)" -gt 100 ] && [ -d .llamacpp-src ] && ! grep -q "build rc" "$OUT/build.log" 2>/dev/null; do sleep 3; done
grep "build rc" "$OUT/build.log"
if [ -x $LB ]; then
  for ty in ${TYPES//,/ }; do
    f="$DIR/$SHAPE-$ty.gguf"
    [ -f "$f" ] || continue
    [ "$(left)" -lt 70 ] && { echo "llama-bench $ty: skipped (time)"; continue; }
    timeout $(( $(left) - 60 )) $LB -m "$f" -ngl 99 -fa 0 -p "$NP" -n "$NG" -r "$REPS" -o json \
      > "$OUT/lb_$ty.json" 2> "$OUT/lb_$ty.log"
    echo "llama-bench $ty rc $? at $(el) s"
  done
fi

# 6. partial offload against CPU-only, the first type's file
F1="$DIR/$SHAPE-${TYPES%%,*}.gguf"
if [ -f "$F1" ] && [ "$(left)" -gt 50 ]; then
  timeout $(( $(left) - 20 )) $PY - "$F1" "$OUT/partial.json" "$SHAPE" <<'PY'
import json, os, sys
from benchmarks.gpu_bench import SHAPES
from llampy.llama.bench import bench
from llampy.llama.model import Model
rows = []
for ngl in (SHAPES[sys.argv[3]][1] // 2, 0):
    m = Model(sys.argv[1], n_gpu_layers=ngl)
    r = {x.test[:2]: x.avg_ts for x in bench(m, 0, 8, 1, n_threads=os.cpu_count() or 1)}
    rows.append({"n_gpu_layers": ngl, "tg8": r.get("tg")})
    print(json.dumps(rows[-1]), flush=True)
    del m
    open(sys.argv[2], "w").write(json.dumps(rows))
PY
fi

# 7. the targets
$PY benchmarks/gpu_targets.py "$OUT"
[ "${KEEP:-0}" = 1 ] || rm -f "$DIR"/"$SHAPE"-*.gguf
echo "done at $(el) s"
