#!/usr/bin/env bash
# Set up (.venv, install, demo family), then run the whole test suite. Extra arguments go to pytest.
source "$(dirname "$0")/_setup.sh"
set +e
python -m pytest "$@"
rc=$?
if [ "$rc" -eq 5 ]; then
  echo "test.sh: no test ran" >&2
  exit 1
fi
exit "$rc"
