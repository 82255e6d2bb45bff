#!/usr/bin/env bash
# llama.cpp's sources trimmed to what a CUDA build of llama-bench needs (about 27 MB: ggml with its CPU and CUDA
# backends, src, include, common, tools, vendor, app), for carrying to a GPU machine that has no network, beside
# benchmarks/gpu_bench.py (--llama-bench). Usage: scripts/llamacpp_cuda_src.sh DEST; then on the GPU machine:
#   cmake -S DEST -B DEST/build -DGGML_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90 -DGGML_NATIVE=ON -DGGML_CUDA_FA=OFF \
#     -DLLAMA_CURL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=OFF \
#     -DCMAKE_BUILD_TYPE=Release && cmake --build DEST/build --target llama-bench -j "$(nproc)"
# (GGML_CUDA_FA=OFF leaves out the flash-attention kernels, the longest part of the build: llama-bench -fa 0.)
set -euo pipefail
VER=0.3.36
DEST=${1:?usage: scripts/llamacpp_cuda_src.sh DEST}
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT
python3 -m pip download -q --no-deps --no-binary :all: "llama-cpp-python==$VER" -d "$WORK" >&2
tar -xzf "$WORK"/llama_cpp_python-$VER.tar.gz -C "$WORK"
S="$WORK/llama_cpp_python-$VER/vendor/llama.cpp"
rm -rf "$DEST" && mkdir -p "$DEST/ggml/src"
cp -r "$S"/CMakeLists.txt "$S"/cmake "$S"/src "$S"/include "$S"/common "$S"/vendor "$S"/tools "$S"/app "$DEST"/
cp -r "$S"/ggml/CMakeLists.txt "$S"/ggml/cmake "$S"/ggml/include "$DEST"/ggml/
find "$S"/ggml/src -maxdepth 1 -type f -exec cp {} "$DEST"/ggml/src/ \;
cp -r "$S"/ggml/src/ggml-cpu "$S"/ggml/src/ggml-cuda "$S"/ggml/src/ggml-blas "$DEST"/ggml/src/
rm -rf "$DEST"/tools/ui "$DEST"/tools/server/public*
du -sh "$DEST" >&2
