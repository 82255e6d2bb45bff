#!/usr/bin/env bash
# llama.cpp's own library, built natively for this machine from llama-cpp-python's sdist (the anchor: DESIGN.md),
# for the differential tests (ggml's quantizers, llama.cpp's tokenizers and samplers) and the benchmarks.
# Built once into a cache outside the clone, keyed by the version and this CPU (a native build runs only on the CPU
# it was made for), so CI on the same machine finds it. Prints the directory: a venv whose python imports llama_cpp,
# with llama.cpp's shared libraries in its site-packages/llama_cpp/lib. A first build takes ~15 minutes on 2 cores.
set -euo pipefail
VER=0.3.36
PY=${PYTHON:-python3}
CPU=$( (grep -m1 '^model name' /proc/cpuinfo || true; grep -m1 '^flags' /proc/cpuinfo || true) | sha256sum | cut -c1-12)
DIR=${LLAMPY_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/llampy}/llamacpp-$VER-$CPU
if [ -f "$DIR/.built" ] && "$DIR/bin/python" -c "import llama_cpp" >/dev/null 2>&1; then
  echo "$DIR"
  exit 0
fi
echo "scripts/llamacpp.sh: building llama.cpp $VER (llama-cpp-python's sdist, GGML_NATIVE) into $DIR" >&2
rm -rf "$DIR"
mkdir -p "$(dirname "$DIR")"
"$PY" -m venv "$DIR"
"$DIR/bin/pip" install -q --upgrade pip >&2
# --no-cache-dir: pip's wheel cache is keyed by the sdist, not the CPU; a native wheel must not travel
CMAKE_ARGS="-DGGML_NATIVE=ON -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF" \
  CMAKE_BUILD_PARALLEL_LEVEL=$(nproc) \
  "$DIR/bin/pip" install -q --no-cache-dir --no-binary llama-cpp-python "llama-cpp-python==$VER" >&2
"$DIR/bin/python" -c "import llama_cpp" >&2
touch "$DIR/.built"
echo "$DIR"
