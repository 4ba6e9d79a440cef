#!/usr/bin/env bash
# Creates (once) a Python virtual environment with the official `openai` client and `jsonschema`
# (the oracle of structured output), for the end-to-end tests of `treeattn serve` (tests/serve)
# and bench/serve/loadgen.py, and prints the
# path of its python. Location: $TREEATTN_SERVE_VENV, else build/serve-venv in the source tree.
# Exit 3 (with a message) when the environment cannot be made, e.g. PyPI cannot be reached:
# the tests then skip.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="${TREEATTN_SERVE_VENV:-$root/build/serve-venv}"
py="$venv/bin/python"
mkdir -p "$(dirname "$venv")"
exec 9> "$venv.lock"
flock 9  # tests running at once make it once
if [ -x "$py" ] && "$py" -c "import openai, jsonschema" 2>/dev/null; then
  echo "$py"
  exit 0
fi
# A failure is remembered for 10 minutes, so that a suite of tests without network skips at once
# instead of waiting for pip's timeout in every test.
failed="$venv.failed"
if [ -f "$failed" ] && [ $(( $(date +%s) - $(stat -c %Y "$failed") )) -lt 600 ]; then
  echo "serve-venv: $(cat "$failed") (cached; remove $failed to retry now)" >&2
  exit 3
fi
if ! python3 -m venv "$venv" >&2; then
  echo "python3 -m venv failed (Debian: apt-get install python3-venv)" | tee "$failed" >&2
  exit 3
fi
if ! "$py" -m pip install --quiet --disable-pip-version-check --timeout 30 --retries 1 \
     "openai>=1.0,<4" "jsonschema>=4,<5" >&2; then
  echo "cannot install the openai and jsonschema packages from PyPI (no network?)" |
    tee "$failed" >&2
  exit 3
fi
rm -f "$failed"
echo "$py"
