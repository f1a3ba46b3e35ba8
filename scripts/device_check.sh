#!/usr/bin/env bash
# The GPU device check (docs/gpu.md): in one call on a lent GPU machine, build llama-cpp-python for CUDA from the
# slimmed source scripts/device_prepare.sh made here, then run the self-test on CUDA, doctor (NVML facts, the
# placement plan), the parent's and the drafts' call costs on 1..16 tokens fully on the GPU and with the drafts on
# the CPU, and the greedy lossless identity of speculative answers against the parent. One JSON and one markdown
# report under $OUT (device-check.json, device-check.md), with the logs.
#
# usage: bash scripts/device_check.sh [--cpu] [--build] [--quick] [--budget SECONDS] [--build-only]
#   (no flag)     CUDA: needs nvcc and build/device (carried). Builds into $WORK (the machine's /tmp: a second call
#                 on the same machine reuses the build), with the device's python3 and its packages, the carried
#                 wheels, and specquant from this source tree (PYTHONPATH: nothing else of its dependencies).
#   --cpu         CUDA off, the same steps here, on .venv's llama-cpp-python (no build).
#   --build       with --cpu: build the slimmed source for this CPU first and run the check on that build.
#   --build-only  stop after the build (to time it).
#   --quick       small synthetic shapes, fewer prompts and repetitions (the test suite's run).
#   --budget S    seconds for the whole run (default 540 with CUDA: a device call runs at most 600); steps that
#                 would not finish in what is left are reported as skipped, not started.
# OUT: the device's $OUT, else build/device-out. SPECQUANT_DEVICE_WORK: the work folder (default
# /tmp/specquant-device).
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/_build.sh
START=$SECONDS
MODE=cuda BUILD=0 BUILD_ONLY=0 QUICK=0 BUDGET=""
while [ $# -gt 0 ]; do
  case "$1" in
    --cpu) MODE=cpu ;;
    --build) BUILD=1 ;;
    --build-only) BUILD=1 BUILD_ONLY=1 ;;
    --quick) QUICK=1 ;;
    --budget) BUDGET="${2:-}"; shift ;;
    *) echo "device_check: error: unknown argument $1 (see the head of $0)" >&2; exit 2 ;;
  esac
  shift
done
die() { echo "device_check: error: $*" >&2; exit 1; }
[[ -z "$BUDGET" || "$BUDGET" =~ ^[0-9]+$ ]] || die "--budget $BUDGET: a whole number of seconds"
[ "$MODE" = cuda ] && BUILD=1
BUDGET=${BUDGET:-$([ "$MODE" = cuda ] && echo 540 || echo 3600)}
OUT=${OUT:-build/device-out}
WORK=${SPECQUANT_DEVICE_WORK:-/tmp/specquant-device}
SRC=build/device/llama-cpp-python

if [ "$MODE" = cuda ]; then
  NVCC="$(find_nvcc)" || die "no nvcc found (PATH, CUDACXX, ${CUDA_PATH:-/usr/local/cuda}/bin): a CUDA check needs the CUDA toolkit; --cpu runs the CPU check"
  nvidia-smi -L >/dev/null 2>&1 || die "no NVIDIA GPU here (nvidia-smi -L): the CUDA check is for a GPU machine; --cpu runs the CPU check"
  export PATH="$(dirname "$NVCC"):$PATH" CUDACXX="$NVCC"
  PY=${PYTHON:-python3}
else
  [ -x .venv/bin/python ] || die "no .venv here (scripts/test.sh sets it up)"
  PY=.venv/bin/python
fi
if [ "$BUILD" = 1 ] && [ ! -f "$SRC/pyproject.toml" ]; then
  die "no $SRC: scripts/device_prepare.sh makes it here, and a device run carries build/device"
fi
mkdir -p "$OUT" "$WORK"
OUT="$(cd "$OUT" && pwd)" WORK="$(cd "$WORK" && pwd)"

ENVJ="$WORK/env.json"
note() { echo "device_check: $*" >&2; }
json_env() {  # MODE BUILD_SECONDS BUILD_STATE CMAKE CFLAGS
  "$PY" - "$ENVJ" "$@" <<'EOF'
import json, os, platform, shutil, subprocess, sys
path, mode, secs, state, cmake, cflags = sys.argv[1:7]
def run(*cmd):
    try:
        return subprocess.run(cmd, capture_output=True, text=True, timeout=30).stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        return None
nvcc = os.environ.get("CUDACXX") or shutil.which("nvcc")
rec = {"mode": mode, "python": platform.python_version(), "executable": sys.executable,
       "nproc": os.cpu_count(), "nvcc": (run(nvcc, "--version") or "").splitlines()[-1:] if nvcc else None,
       "nvidia_smi": run("nvidia-smi", "-L") if shutil.which("nvidia-smi") else None,
       "build": {"state": state, "seconds": float(secs) if secs else None, "cmake_args": cmake or None,
                 "cflags": cflags or None, "jobs": os.cpu_count()}}
try:
    rec["carried"] = json.load(open("build/device/prepared.json"))
except (OSError, ValueError):
    rec["carried"] = None
json.dump(rec, open(path, "w"), indent=2)
EOF
}

SITE="$WORK/site-$MODE"
CMAKE="" CFLAGS_="" BUILD_SECS="" BUILD_STATE="not built: .venv's llama-cpp-python"
if [ "$BUILD" = 1 ]; then
  CMAKE="-DGGML_NATIVE=ON -DGGML_RPC=ON -DLLAVA_BUILD=OFF"
  if [ "$MODE" = cuda ]; then
    # sm_90 (Hopper) machine code only; FlashAttention's vector kernels for F16 K/V only (the KV cache's type);
    # no NCCL (one GPU) and no fatbin compression: each cuts compile time.
    CMAKE="$CMAKE -DGGML_CUDA=on -DCMAKE_CUDA_ARCHITECTURES=${SPECQUANT_CUDA_ARCH:-90-real}"
    CMAKE="$CMAKE -DGGML_CUDA_FA_QUANTS=f16-f16 -DGGML_CUDA_NCCL=OFF -DGGML_CUDA_COMPRESSION_MODE=none"
  fi
  CFLAGS_="$(no_amx_flags)"
  BUILDPY="$PY"
  if ! "$BUILDPY" -c "import scikit_build_core" 2>/dev/null; then
    [ "$MODE" = cpu ] || die "$PY has no scikit-build-core: the CUDA build needs it (the device's python3 has it)"
    note "a build environment with scikit-build-core in $WORK/buildenv"
    [ -x "$WORK/buildenv/bin/python" ] || "$PY" -m venv "$WORK/buildenv"
    "$WORK/buildenv/bin/python" -c "import scikit_build_core" 2>/dev/null \
      || "$WORK/buildenv/bin/python" -m pip install --quiet scikit-build-core >&2
    BUILDPY="$WORK/buildenv/bin/python"
  fi
  key="$( { cat "$SRC/pyproject.toml"; cat build/device/prepared.json 2>/dev/null || true; echo "$CMAKE|$CFLAGS_"; } \
         | sha256sum | cut -c1-16)"
  if [ "$(cat "$SITE/.specquant-build" 2>/dev/null)" = "$key" ]; then
    BUILD_STATE="reused: built earlier on this machine with the same source and flags" BUILD_SECS=0
    note "$BUILD_STATE"
  else
    note "building llama-cpp-python ($MODE: CMAKE_ARGS='$CMAKE' CFLAGS='$CFLAGS_', $(nproc) jobs); log: $OUT/build.log"
    rm -rf "$SITE.tmp" "$WORK/src-$MODE"
    # A copy to build from: llama-cpp-python's CMake also installs its libraries into the source tree, which must
    # stay as it was carried.
    cp -a "$SRC" "$WORK/src-$MODE"
    t0=$SECONDS
    # The build may take what is left of the budget but 30 s: a build that runs longer is stopped and reported (with
    # ninja's log of what it compiled), rather than killed with the call and nothing written.
    limit=$((BUDGET - (SECONDS - START) - 30))
    if [ "$limit" -gt 0 ] && CMAKE_ARGS="$CMAKE" CFLAGS="$CFLAGS_" CXXFLAGS="$CFLAGS_" \
        CMAKE_BUILD_PARALLEL_LEVEL="$(nproc)" timeout "$limit" \
        "$BUILDPY" -m pip install -v --no-build-isolation --no-deps --no-index --no-cache-dir --target "$SITE.tmp" \
        --config-settings=build-dir="$WORK/build-$MODE" "$WORK/src-$MODE" > "$OUT/build.log" 2>&1; then
      BUILD_SECS=$((SECONDS - t0)) BUILD_STATE="built"
      # each object's compile time on this machine (ninja's log: start and end in ms), for the next estimate
      cp "$WORK/build-$MODE/.ninja_log" "$OUT/ninja_log.txt" 2>/dev/null || true
      note "built in ${BUILD_SECS} s"
      if ls build/device/wheels/*.whl >/dev/null 2>&1; then
        "$BUILDPY" -m pip install --quiet --no-index --no-deps --no-compile --target "$SITE.tmp" build/device/wheels/*.whl >&2
      fi
      echo "$key" > "$SITE.tmp/.specquant-build"
      rm -rf "$SITE" && mv "$SITE.tmp" "$SITE"
    else
      BUILD_SECS=$((SECONDS - t0))
      why="$(grep -m1 -E 'error:|CMake Error|FAILED:' "$OUT/build.log" 2>/dev/null | cut -c1-300 || true)"
      [ "$BUILD_SECS" -ge "$limit" ] && why="stopped at the budget's limit (${limit} s)"
      BUILD_STATE="failed after ${BUILD_SECS} s: ${why:-see build.log}"
      cp "$WORK/build-$MODE/.ninja_log" "$OUT/ninja_log.txt" 2>/dev/null || true
      note "the build failed: ${why:-see $OUT/build.log}"
    fi
  fi
  export PYTHONPATH="$PWD:$SITE${PYTHONPATH:+:$PYTHONPATH}"
else
  export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
fi
json_env "$MODE" "$BUILD_SECS" "$BUILD_STATE" "$CMAKE" "$CFLAGS_"
if [ "$BUILD_ONLY" = 1 ]; then
  [ "$BUILD_STATE" != "${BUILD_STATE#failed}" ] && exit 1
  exit 0
fi

args=(run --mode "$MODE" --out "$OUT" --work "$WORK" --env "$ENVJ" --budget $((BUDGET - (SECONDS - START))))
[ "$QUICK" = 1 ] && args+=(--quick)
export PYTHONUNBUFFERED=1
exec "$PY" -m specquant_cli.bench.device "${args[@]}"  # it logs to $OUT/check.log too
