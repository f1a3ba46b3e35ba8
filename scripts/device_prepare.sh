#!/usr/bin/env bash
# Prepare, here, what a GPU device check carries (scripts/device_check.sh runs it there; docs/gpu.md says how):
#
#   build/device/llama-cpp-python/  the llama-cpp-python 0.3.36 sdist cut to what its library build needs: no
#                                   tests, examples, tools, docs or vocabulary models, ggml's CPU, CUDA and RPC
#                                   backends only (~77 MB as published, too big to travel)
#   build/device/wheels/            gguf and diskcache, pure Python, which the device's Python lacks
#   build/device/models/            the identity check's real model: smollm2-135m cut to fit (its first two and
#                                   last two of 30 layers, Q4_0 throughout), from models/smollm2-135m
#   build/device/prepared.json      what is there, with sizes and digests
#
# build/ is ignored by git; a device run carries build/device (and nothing else of build/). The sdist download is
# kept in build/device-cache/ and never travels. Refuses, with one line, when the working tree and build/device
# together would pass 60 MiB (the device call takes 64 MiB). Needs .venv (scripts/test.sh makes it) and the
# smollm2-135m family (specquant pull smollm2-135m).
set -euo pipefail
cd "$(dirname "$0")/.."
PIN=0.3.36
DEST=build/device
CACHE=build/device-cache
LIMIT_MIB=${SPECQUANT_DEVICE_LIMIT_MIB:-60}
PY=.venv/bin/python

die() { echo "device_prepare: error: $*" >&2; exit 1; }
[ -x "$PY" ] || die "no .venv here (scripts/test.sh sets it up)"
[ -f models/smollm2-135m/manifest.json ] || die "no models/smollm2-135m family (specquant pull smollm2-135m)"

mkdir -p "$CACHE"
SDIST="$CACHE/llama_cpp_python-$PIN.tar.gz"
if [ ! -f "$SDIST" ]; then
  echo "device_prepare: downloading the llama-cpp-python $PIN sdist (~77 MB)" >&2
  "$PY" -m pip download --quiet --no-deps --no-binary :all: -d "$CACHE.tmp" "llama-cpp-python==$PIN" >&2
  mv "$CACHE.tmp/llama_cpp_python-$PIN.tar.gz" "$SDIST"
  rm -rf "$CACHE.tmp"
fi

STAGE="$(mktemp -d "${TMPDIR:-/tmp}/specquant-device-prepare.XXXXXX")"
trap 'rm -rf "$STAGE"' EXIT
tar -xzf "$SDIST" -C "$STAGE"
SRC="$STAGE/llama_cpp_python-$PIN"
OUTSRC="$STAGE/out/llama-cpp-python"
mkdir -p "$OUTSRC/vendor/llama.cpp"

# The Python package and its build files (scikit-build-core reads pyproject.toml, README.md and the version from
# llama_cpp/__init__.py).
cp -a "$SRC"/{CMakeLists.txt,pyproject.toml,README.md,LICENSE.md,llama_cpp} "$OUTSRC/"
# llama.cpp: the library (src, include), ggml and the vendored CMake targets. tools/ (the multimodal library) is left
# out, so the build needs -DLLAVA_BUILD=OFF; and so is common/: llama-cpp-python forces llama.cpp's common library
# on, but only the multimodal library links it (nothing of it is installed), so the copy turns it off.
V="$SRC/vendor/llama.cpp"
cp -a "$V"/{CMakeLists.txt,LICENSE,cmake,include,src,vendor,ggml,licenses} "$OUTSRC/vendor/llama.cpp/"
grep -q '^ *set(LLAMA_BUILD_COMMON ON CACHE BOOL .* FORCE)' "$OUTSRC/CMakeLists.txt" \
  || die "llama-cpp-python's CMakeLists.txt no longer forces LLAMA_BUILD_COMMON on as this script expects"
sed -i 's/set(LLAMA_BUILD_COMMON ON CACHE/set(LLAMA_BUILD_COMMON OFF CACHE/' "$OUTSRC/CMakeLists.txt"
G="$OUTSRC/vendor/llama.cpp/ggml/src"
for b in "$G"/ggml-*/; do
  case "$(basename "$b")" in ggml-cpu | ggml-cuda | ggml-rpc) ;; *) rm -rf "$b" ;; esac
done
# What only the common library and the multimodal tool use (their CMake targets stay, as interface libraries).
rm -rf "$OUTSRC/vendor/llama.cpp/vendor/cpp-httplib"
rm -f "$OUTSRC/vendor/llama.cpp/vendor/miniaudio/miniaudio.h" "$OUTSRC/vendor/llama.cpp/vendor/stb/stb_image.h"

# Pure-Python wheels the check imports that the device lacks, at the versions this .venv runs.
WHEELS="$STAGE/out/wheels"
mkdir -p "$WHEELS"
for pkg in gguf diskcache; do
  ver="$("$PY" -c "from importlib.metadata import version; print(version('$pkg'))")"
  "$PY" -m pip download --quiet --no-deps --only-binary=:all: -d "$WHEELS" "$pkg==$ver" >&2
done

# The identity check's real model, cut to fit.
mkdir -p "$STAGE/out/models"
"$PY" -m specquant_cli.bench.device cut models/smollm2-135m "$STAGE/out/models" >&2

"$PY" - "$STAGE/out" "$SDIST" "$PIN" <<'EOF'
import hashlib, json, os, sys
from pathlib import Path
out, sdist, pin = Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3]
def size(p):
    return sum(f.stat().st_size for f in p.rglob("*") if f.is_file() and not f.is_symlink())
def sha(p):
    h = hashlib.sha256()
    with open(p, "rb") as f:
        for b in iter(lambda: f.read(1 << 20), b""):
            h.update(b)
    return h.hexdigest()
rec = {"llama_cpp_python": {"version": pin, "sdist_sha256": sha(sdist), "sdist_bytes": sdist.stat().st_size,
                            "slim_bytes": size(out / "llama-cpp-python")},
       "wheels": {w.name: w.stat().st_size for w in sorted((out / "wheels").glob("*.whl"))},
       "models": {m.name: {"bytes": m.stat().st_size, "sha256": sha(m)} for m in sorted((out / "models").glob("*.gguf"))}}
(out / "prepared.json").write_text(json.dumps(rec, indent=2) + "\n")
EOF

# What a device call would carry: the working tree git sends (tracked and untracked-not-ignored files) plus it.
tree_bytes="$(git ls-files -z --cached --others --exclude-standard | xargs -0 -r stat -L -c %s 2>/dev/null \
             | awk '{s += $1} END {print s + 0}')"
dev_bytes="$(find "$STAGE/out" -type f -printf '%s\n' | awk '{s += $1} END {print s + 0}')"
total=$((tree_bytes + dev_bytes))
mib() { awk -v b="$1" 'BEGIN {printf "%.1f", b / 1048576}'; }
if [ "$total" -gt $((LIMIT_MIB * 1048576)) ]; then
  die "a device call would carry $(mib "$total") MiB (working tree $(mib "$tree_bytes"), $DEST $(mib "$dev_bytes")), over $LIMIT_MIB MiB; nothing was replaced"
fi
rm -rf "$DEST.old"
[ -d "$DEST" ] && mv "$DEST" "$DEST.old"
mkdir -p "$(dirname "$DEST")"
mv "$STAGE/out" "$DEST"
rm -rf "$DEST.old"
echo "device_prepare: $DEST ready: $(mib "$dev_bytes") MiB, $(mib "$total") MiB with the working tree (limit $LIMIT_MIB)" >&2
echo "device_prepare: run it there with carry [\"$DEST\"]: bash scripts/device_check.sh" >&2
