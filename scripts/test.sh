#!/usr/bin/env bash
# Set up (.venv, install, demo family), then run the whole test suite. Extra arguments go to pytest.
source "$(dirname "$0")/_setup.sh"
# The chat page's browser tests drive Debian's headless Chromium (they fail, not skip, without it).
{ command -v chromium && command -v chromedriver; } >/dev/null || (apt-get update && apt-get install -y chromium chromium-driver)
set +e
# One pytest worker per core this process may use (tests/conftest.py gives each its core); -n 0 in the arguments
# runs them in this process.
workers=$(nproc 2>/dev/null || echo 1)
if [ "$workers" -gt 1 ]; then
  python -m pytest -n "$workers" --dist loadfile "$@"
else
  python -m pytest "$@"
fi
rc=$?
if [ "$rc" -eq 5 ]; then
  echo "test.sh: no test ran" >&2
  exit 1
fi
exit "$rc"
