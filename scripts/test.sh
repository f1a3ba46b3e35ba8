#!/usr/bin/env bash
# Set up (.venv, install, demo family), then run the whole test suite. Extra arguments go to pytest.
source "$(dirname "$0")/_setup.sh"
# The chat page's browser tests drive Debian's headless Chromium (they fail, not skip, without it).
{ command -v chromium && command -v chromedriver; } >/dev/null || (apt-get update && apt-get install -y chromium chromium-driver)
set +e
python -m pytest "$@"
rc=$?
if [ "$rc" -eq 5 ]; then
  echo "test.sh: no test ran" >&2
  exit 1
fi
exit "$rc"
