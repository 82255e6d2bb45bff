#!/usr/bin/env bash
# llama.cpp's llama-server, for benchmarks/serve_load.py's side-by-side column. Only what the server adds is compiled
# from llama-cpp-python's sdist (its common library, the server, the vendored HTTP library: ~70 files); it links
# against the libraries scripts/llamacpp.sh built from the same sources (libllama, ggml, libmtmd). Prints the directory
# holding the binary, the one scripts/llamacpp_tools.sh fills (LLAMPY_LLAMACPP_TOOLS). Minutes on 2 cores: run it
# under nice on a shared machine. LLAMPY_LLAMACPP_BUILD keeps the build folder (to resume an interrupted build).
set -euo pipefail
VER=0.3.36
PY=${PYTHON:-python3}
LIBDIR=${LLAMPY_LLAMACPP:-$(bash "$(dirname "$0")/llamacpp.sh")}
LIB=$(echo "$LIBDIR"/lib/python3*/site-packages/llama_cpp/lib)
DIR=${LLAMPY_LLAMACPP_TOOLS:-${LLAMPY_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/llampy}/llamacpp-tools-$VER-$(basename "$LIBDIR" | sed 's/.*-//')}
if [ -x "$DIR/llama-server" ]; then
  echo "$DIR"
  exit 0
fi
TMP=$(mktemp -d)
trap 'rm -rf "$TMP"' EXIT
BUILD=${LLAMPY_LLAMACPP_BUILD:-$TMP/build}
if [ -n "${LLAMPY_LLAMACPP_SRC:-}" ]; then
  SRC=$LLAMPY_LLAMACPP_SRC
else
  "$PY" -m pip download -q --no-deps --no-binary :all: "llama-cpp-python==$VER" -d "$TMP" >&2
  tar -xzf "$TMP"/llama_cpp_python-$VER.tar.gz -C "$TMP"
  SRC="$TMP"/llama_cpp_python-$VER/vendor/llama.cpp
fi
mkdir -p "$DIR"
cmake -S "$SRC" -B "$BUILD" -G Ninja -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON -DBUILD_SHARED_LIBS=ON \
  -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF -DLLAMA_USE_PREBUILT_UI=OFF -DLLAMA_BUILD_TESTS=OFF \
  -DLLAMA_BUILD_EXAMPLES=OFF >&2
cd "$BUILD"
# the server's objects, less those of the libraries already built (src/: libllama, ggml/, tools/mtmd/)
OBJS=$(ninja -t inputs bin/llama-server | grep '\.o$' | grep -v '^src/\|^ggml/\|^tools/mtmd/')
ninja -j"${JOBS:-2}" $OBJS >&2
"${CXX:-c++}" -O3 $OBJS -o "$DIR/llama-server" -L"$LIB" -lmtmd -lllama -lggml -lggml-cpu -lggml-base -lpthread \
  -Wl,-rpath,"$LIB" >&2
echo "$DIR"
