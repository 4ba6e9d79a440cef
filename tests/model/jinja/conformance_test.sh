#!/usr/bin/env bash
# ctest model.jinja.conformance: conformance.py with the reference Python (tools/ref-venv.sh, or
# $TREEATTN_PYTHON); exit 77 (skipped) when that Python has no jinja2.
set -uo pipefail
render="$1"
dir="$2"
root="$(cd "$dir/../../.." && pwd)"
py="${TREEATTN_PYTHON:-}"
if [ -z "$py" ]; then py="$("$root/tools/ref-venv.sh")" || { echo "SKIP: no reference Python (tools/ref-venv.sh)"; exit 77; }; fi
if ! "$py" -c "import jinja2" 2>/dev/null; then
  echo "SKIP: $py has no jinja2 (tools/ref-venv.sh installs it)"
  exit 77
fi
exec "$py" "$dir/conformance.py" "$render" "$dir/data"
