# Build helpers shared by _setup.sh and device_check.sh (sourced; defines functions only).

# Compiler flags that leave out ggml's AMX kernels (only those this gcc knows; none off x86): on CPUs that
# advertise AMX they are compiled in, and on some VMs they fault (SIGILL in ggml_backend_amx_mul_mat).
no_amx_flags() {
  local f out=""
  [ "$(uname -m)" = x86_64 ] || return 0
  for f in -mno-amx-tile -mno-amx-int8 -mno-amx-bf16 -mno-amx-fp16 -mno-amx-complex; do
    if echo 'int main(void){return 0;}' | ${CC:-cc} "$f" -x c -o /dev/null - 2>/dev/null; then out="$out $f"; fi
  done
  echo "${out# }"
}

# wants_cuda "CMAKE FLAGS": whether the flags turn ggml's CUDA backend on (-DGGML_CUDA=on, =ON, =1, =true, =yes,
# with or without :BOOL, as CMake reads a true value).
wants_cuda() {
  local a v
  for a in $1; do
    case "$a" in
      -DGGML_CUDA=* | -DGGML_CUDA:BOOL=*)
        v="$(echo "${a#*=}" | tr '[:upper:]' '[:lower:]')"
        case "$v" in on | 1 | true | yes | y) return 0 ;; esac ;;
    esac
  done
  return 1
}

# find_nvcc: the CUDA compiler a build would find (on PATH, at $CUDACXX, or in the toolkit at $CUDA_PATH, by
# default /usr/local/cuda, as CMake looks), printed; 1 when there is none.
find_nvcc() {
  local c
  for c in "$(command -v nvcc 2>/dev/null || true)" "${CUDACXX:-}" "${CUDA_PATH:-/usr/local/cuda}/bin/nvcc"; do
    if [ -n "$c" ] && [ -x "$c" ] && [ ! -d "$c" ]; then
      echo "$c"
      return 0
    fi
  done
  return 1
}
