#!/usr/bin/env bash
# Creates (once) the Python environment of the model tests' independent float64 reference
# (tests/model/llama_reference.py: numpy and the `gguf` package's dequantizer; jinja2, pinned,
# for the chat template conformance test tests/model/jinja/conformance.py) in
# build/ref-venv, and prints its python. Exit 3 with a message when it cannot be made (no venv
# module, PyPI unreachable): the tests that need it then skip and say why.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="$root/build/ref-venv"
py="$venv/bin/python"
if [ -x "$py" ] && "$py" -c "import gguf, numpy" 2>/dev/null; then
  # An environment made before jinja2 joined it: add it (its test skips when this fails).
  if ! "$py" -c "import jinja2" 2>/dev/null; then
    "$py" -m pip install --quiet --disable-pip-version-check --timeout 30 --retries 1 \
      "jinja2==3.1.6" >&2 || echo "ref-venv: pip could not install jinja2 (offline?)" >&2
  fi
  echo "$py"
  exit 0
fi
mkdir -p "$root/build"
if ! python3 -m venv "$venv" >&2; then
  echo "ref-venv: python3 -m venv failed (Debian: apt-get install python3-venv)" >&2
  exit 3
fi
if ! "$py" -m pip install --quiet --disable-pip-version-check --timeout 30 --retries 1 \
     "gguf>=0.10" numpy "jinja2==3.1.6" >&2; then
  echo "ref-venv: pip could not install gguf, numpy and jinja2 (offline?)" >&2
  exit 3
fi
echo "$py"
