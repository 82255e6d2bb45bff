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
# llama-quantize, linked against the venv's libllama/libggml (the same ggml quantizers the library runs): only its
# three sources and a build-info stub are compiled (~10 s), not llama.cpp's common library
build_quantize() {
  [ -x "$DIR/bin/llama-quantize" ] && return 0
  local SRC=${LLAMACPP_SRC:-}
  local TMP
  TMP=$(mktemp -d)
  if [ -z "$SRC" ]; then
    "$DIR/bin/pip" download -q --no-deps --no-binary :all: -d "$TMP" "llama-cpp-python==$VER" >&2
    tar -xzf "$TMP"/llama_cpp_python-$VER.tar.gz -C "$TMP"
    SRC="$TMP/llama_cpp_python-$VER/vendor/llama.cpp"
  fi
  local LIB
  LIB=$(echo "$DIR"/lib/python3*/site-packages/llama_cpp/lib)
  mkdir -p "$TMP/shim"
  cp "$SRC/common/imatrix-loader.cpp" "$TMP/shim/"
  printf '%s\n' '#pragma once' '#include <cstdio>' '#define LOG_ERR(...) fprintf(stderr, __VA_ARGS__)' \
    '#define LOG_WRN(...) fprintf(stderr, __VA_ARGS__)' '#define LOG_INF(...) fprintf(stderr, __VA_ARGS__)' \
    '#define LOG_DBG(...) ((void)0)' > "$TMP/shim/log.h"
  { echo '#include "common.h"'; echo '#include <cstring>'; echo '#include <cstdlib>'; echo '#undef COM_ERR';
    echo '#define COM_ERR(...) fprintf(stderr, __VA_ARGS__)';
    awk '/^bool string_parse_kv_override/,/^}/' "$SRC/common/common.cpp"; } > "$TMP/shim/kv-override.cpp"
  sed -e 's/@LLAMA_BUILD_NUMBER@/0/' -e "s/@LLAMA_BUILD_COMMIT@/llama-cpp-python-$VER/" -e 's/@BUILD_COMPILER@/g++/' \
    -e 's/@BUILD_TARGET@/native/' "$SRC/common/build-info.cpp.in" > "$TMP/shim/build-info.cpp"
  g++ -O2 -std=c++17 -I"$SRC/include" -I"$SRC/ggml/include" -I"$SRC/common" -I"$SRC/tools/quantize" \
    "$SRC/tools/quantize/main.cpp" "$SRC/tools/quantize/quantize.cpp" "$TMP/shim/imatrix-loader.cpp" \
    "$TMP/shim/kv-override.cpp" "$TMP/shim/build-info.cpp" -L"$LIB" -lllama -lggml -lggml-base \
    -Wl,-rpath,"$LIB" -lpthread -o "$DIR/bin/llama-quantize" >&2
  rm -rf "$TMP"
}

if [ -f "$DIR/.built" ] && "$DIR/bin/python" -c "import llama_cpp" >/dev/null 2>&1; then
  build_quantize
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
build_quantize
echo "$DIR"
