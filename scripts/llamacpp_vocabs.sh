#!/usr/bin/env bash
# llama.cpp's tokenizer test vocabularies (models/ggml-vocab-*.gguf) that are too large to keep in the repository
# (tests/fixtures/vocab holds the small ones and every .inp/.out), taken from llama-cpp-python's sdist into a cache
# outside the clone, with the source that names llama.cpp's tokenizer models and pre-tokenizers (src/llama-vocab.cpp:
# tests/llama/test_vocab_llamacpp.py reads its lists, so a pre-tokenizer llama.cpp knows and llampy does not fails a
# test). Prints the directory; the tests find it there (or in LLAMPY_VOCABS).
set -euo pipefail
VER=0.3.36
PY=${PYTHON:-python3}
DIR=${LLAMPY_VOCABS:-${LLAMPY_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/llampy}/llamacpp-vocab-$VER}
if [ -f "$DIR/.done" ] && [ -f "$DIR/llama-vocab.cpp" ]; then
  echo "$DIR"
  exit 0
fi
TMP=$(mktemp -d)
trap 'rm -rf "$TMP"' EXIT
"$PY" -m pip download -q --no-deps --no-binary :all: "llama-cpp-python==$VER" -d "$TMP" >&2
mkdir -p "$DIR"
tar -xzf "$TMP"/llama_cpp_python-$VER.tar.gz -C "$TMP" --wildcards '*/vendor/llama.cpp/models/ggml-vocab-*.gguf' \
  '*/vendor/llama.cpp/src/llama-vocab.cpp'
cp "$TMP"/llama_cpp_python-$VER/vendor/llama.cpp/models/ggml-vocab-*.gguf \
  "$TMP"/llama_cpp_python-$VER/vendor/llama.cpp/src/llama-vocab.cpp "$DIR"/
touch "$DIR/.done"
echo "$DIR"
