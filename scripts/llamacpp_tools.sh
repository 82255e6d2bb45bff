#!/usr/bin/env bash
# llama.cpp's llama-gguf-split, compiled from llama-cpp-python's sdist against the libraries scripts/llamacpp.sh
# built (its tool links only libllama and ggml; two one-line headers of llama.cpp's common library are given here),
# for tests/gguf/test_split.py's byte-for-byte comparison. Prints the directory holding the binary; the tests find it
# there or in LLAMPY_LLAMACPP_TOOLS. Takes a few seconds once the library is built.
set -euo pipefail
VER=0.3.36
PY=${PYTHON:-python3}
LIBDIR=${LLAMPY_LLAMACPP:-$(bash "$(dirname "$0")/llamacpp.sh")}
LIB=$(echo "$LIBDIR"/lib/python3*/site-packages/llama_cpp/lib)
DIR=${LLAMPY_LLAMACPP_TOOLS:-${LLAMPY_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/llampy}/llamacpp-tools-$VER-$(basename "$LIBDIR" | sed 's/.*-//')}
if [ -x "$DIR/llama-gguf-split" ]; then
  echo "$DIR"
  exit 0
fi
TMP=$(mktemp -d)
trap 'rm -rf "$TMP"' EXIT
if [ -n "${LLAMPY_LLAMACPP_SRC:-}" ]; then
  SRC=$LLAMPY_LLAMACPP_SRC
else
  "$PY" -m pip download -q --no-deps --no-binary :all: "llama-cpp-python==$VER" -d "$TMP" >&2
  tar -xzf "$TMP"/llama_cpp_python-$VER.tar.gz -C "$TMP"
  SRC="$TMP"/llama_cpp_python-$VER/vendor/llama.cpp
fi
mkdir -p "$TMP/shim" "$DIR"
cat > "$TMP/shim/common.h" <<'H'
#pragma once
const char * const LLM_KV_SPLIT_NO            = "split.no";
const char * const LLM_KV_SPLIT_COUNT         = "split.count";
const char * const LLM_KV_SPLIT_TENSORS_COUNT = "split.tensors.count";
static int llama_build_number() { return 0; }
static const char * llama_commit() { return "llampy-test"; }
static const char * llama_compiler() { return "c++"; }
static const char * llama_build_target() { return "native"; }
H
: > "$TMP/shim/build-info.h"
"${CXX:-c++}" -O2 -std=c++17 -I"$TMP/shim" -I"$SRC/include" -I"$SRC/ggml/include" "$SRC/tools/gguf-split/gguf-split.cpp" \
  -L"$LIB" -lllama -lggml-base -lggml -Wl,-rpath,"$LIB" -o "$DIR/llama-gguf-split" >&2
echo "$DIR"
