# Shared set-up for demo.sh and test.sh (sourced): .venv, llama-cpp-python built for this CPU and
# self-tested, the project with its test extra, the demo family.
# Idempotent: an environment installed from the same pyproject.toml, for the same CPU and build flags, is
# not reinstalled, and a present, verified family is not fetched again.
#
# The llama.cpp build (llama-cpp-python from source):
#   - GGML_NATIVE (the host's vector extensions) with ggml's AMX kernels left out: on CPUs that advertise
#     AMX they are compiled in, and on some VMs they fault (SIGILL in ggml_backend_amx_mul_mat) on every
#     Q4_0/Q8_0 batch. SPECQUANT_AMX=1 keeps them, on a host where they work.
#   - GGML_RPC (llama.cpp's RPC backend).
#   - SPECQUANT_CMAKE_ARGS: extra CMake flags passed through (-DGGML_CUDA=on, -DGGML_VULKAN=on, ...). CUDA asked
#     for where no nvcc is found stops the set-up with one line before anything is touched.
#   - The wheel is kept in a cache keyed by the CPU's model and flags and the build flags, never reused on
#     another CPU. After installing, a self-test decodes through every weight type in child processes; a
#     build that dies there is replaced by a conservative one (no -march=native: AVX2 baseline), and if
#     that dies too the set-up stops with the reason.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
PYTHON=${PYTHON:-python3}
LLAMA_PIN=llama-cpp-python==0.3.36
source scripts/_build.sh  # no_amx_flags, wants_cuda, find_nvcc

# A CUDA build without a CUDA compiler would fail minutes into the build, after the old llama-cpp-python was
# uninstalled: refuse it here, before .venv is touched.
if wants_cuda "${SPECQUANT_CMAKE_ARGS:-}" && ! find_nvcc >/dev/null; then
  echo "setup: error: SPECQUANT_CMAKE_ARGS='${SPECQUANT_CMAKE_ARGS}' asks for CUDA, but no nvcc was found (PATH," \
       "CUDACXX, ${CUDA_PATH:-/usr/local/cuda}/bin); install the CUDA toolkit or leave -DGGML_CUDA out" >&2
  exit 1
fi

if [ ! -x .venv/bin/python ]; then
  echo "setup: creating .venv with $($PYTHON --version)" >&2
  "$PYTHON" -m venv .venv
fi

# build_config MODE -> "CMAKE_ARGS|CFLAGS" for MODE native (default) or baseline (the conservative retry).
build_config() {
  local cmake="-DGGML_RPC=ON" cflags=""
  if [ "$1" = native ]; then
    cmake="$cmake -DGGML_NATIVE=ON"
    [ "${SPECQUANT_AMX:-0}" = 1 ] || cflags="$(no_amx_flags)"
  else
    cmake="$cmake -DGGML_NATIVE=OFF"
  fi
  echo "$cmake ${SPECQUANT_CMAKE_ARGS:-}|$cflags"
}

cpu_id() {
  { grep -m1 -E '^(model name|Hardware|CPU part)' /proc/cpuinfo || true
    grep -m1 -E '^(flags|Features)' /proc/cpuinfo || true
    uname -m; } 2>/dev/null
}

# specquant's user cache folder: $XDG_CACHE_HOME/specquant, or ~/.cache/specquant when it is unset or relative (the
# XDG spec: a relative path is invalid and ignored) — the rule of settings.cache_home.
cache_home() {
  case "${XDG_CACHE_HOME:-}" in
    /*) echo "$XDG_CACHE_HOME/specquant" ;;
    *) echo "$HOME/.cache/specquant" ;;
  esac
}

# install_llama MODE: build (or reuse this CPU's cached wheel) and install llama-cpp-python.
install_llama() {
  local cfg cmake cflags key dir
  cfg="$(build_config "$1")"; cmake="${cfg%%|*}"; cflags="${cfg#*|}"
  key="$( { cpu_id; echo "$LLAMA_PIN|$cfg|$($PYTHON -c 'import sys; print(sys.version_info[:2])')"; } \
         | sha256sum | cut -c1-16)"
  dir="$(cache_home)/wheels/$key"
  if ! ls "$dir"/llama_cpp_python-*.whl >/dev/null 2>&1; then
    echo "setup: building $LLAMA_PIN for this CPU ($1: CMAKE_ARGS='$cmake' CFLAGS='$cflags'; ~5 min on 2 cores)" >&2
    mkdir -p "$dir.tmp"
    CMAKE_ARGS="$cmake" CFLAGS="$cflags" CXXFLAGS="$cflags" \
      CMAKE_BUILD_PARALLEL_LEVEL="${CMAKE_BUILD_PARALLEL_LEVEL:-$(nproc)}" \
      .venv/bin/python -m pip wheel --quiet --no-cache-dir --no-deps --no-binary llama-cpp-python \
      -w "$dir.tmp" "$LLAMA_PIN"
    rm -rf "$dir" && mv "$dir.tmp" "$dir"
  fi
  .venv/bin/python -m pip install --quiet --force-reinstall --no-deps "$dir"/llama_cpp_python-*.whl
  echo "$1|$key" > .venv/.specquant-llama
}

# selftest: 0 when the build passes; 1 when it died or computed garbage on this CPU (a rebuild may help);
# any other failure (the test itself could not run) stops the set-up here with doctor's one-line reason.
selftest() {
  local report=.venv/.specquant-selftest.json
  if .venv/bin/specquant doctor --selftest --json > "$report"; then return 0; fi
  if .venv/bin/python -c 'import json, sys
st = json.load(open(sys.argv[1]))["hardware"]["build"]["selftest"]
sys.exit(0 if st and st["definitive"] else 1)' "$report" 2>/dev/null; then return 1; fi
  echo "setup: error: the llama.cpp self-test could not run (see the error above)" >&2
  exit 1
}

stamp=.venv/.specquant-installed
want="$( { cat pyproject.toml; cpu_id; build_config native; } | sha256sum | cut -d' ' -f1)"
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ] || ! .venv/bin/python -c "import specquant_cli, llama_cpp" 2>/dev/null; then
  echo "setup: installing specquant and its dependencies" >&2
  .venv/bin/python -m pip install --quiet --upgrade pip
  install_llama native
  .venv/bin/python -m pip install --quiet -e ".[test]"
  # The self-test: one multi-token decode per weight type, each in a child process.
  if ! selftest; then
    echo "setup: the native build failed its self-test; rebuilding without -march=native (AVX2 baseline)" >&2
    install_llama baseline
    if ! selftest; then
      echo "setup: error: llama.cpp fails its self-test on this CPU even in the baseline build (see above);" \
           "set SPECQUANT_CMAKE_ARGS (e.g. -DGGML_AVX2=OFF) and run again" >&2
      exit 1
    fi
  fi
  echo "$want" > "$stamp"
fi
export PATH="$PWD/.venv/bin:$PATH"
specquant pull smollm2-135m
