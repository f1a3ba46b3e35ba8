# Shared set-up for demo.sh and test.sh (sourced): .venv, the project with its test extra, the demo family.
# Idempotent: an installed environment whose pyproject.toml has not changed is not reinstalled, and a
# present, verified family is not fetched again.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
PYTHON=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  echo "setup: creating .venv with $($PYTHON --version)" >&2
  "$PYTHON" -m venv .venv
fi
stamp=.venv/.specquant-installed
want="$(cat pyproject.toml | sha256sum | cut -d' ' -f1)"
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ] || ! .venv/bin/python -c "import specquant_cli, llama_cpp" 2>/dev/null; then
  echo "setup: installing specquant and its dependencies (llama-cpp-python builds from source: ~5 min the first time)" >&2
  export CMAKE_BUILD_PARALLEL_LEVEL="${CMAKE_BUILD_PARALLEL_LEVEL:-$(nproc)}"
  .venv/bin/python -m pip install --quiet --upgrade pip
  .venv/bin/python -m pip install --quiet -e ".[test]"
  echo "$want" > "$stamp"
fi
export PATH="$PWD/.venv/bin:$PATH"
specquant pull smollm2-135m
