#!/usr/bin/env bash
# Creates (once) the Python environment of the model tests' independent float64 reference
# (tests/model/llama_reference.py: numpy and the `gguf` package's dequantizer) in
# build/ref-venv, and prints its python. Exit 3 with a message when it cannot be made (no venv
# module, PyPI unreachable): the tests that need it then skip and say why.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="$root/build/ref-venv"
py="$venv/bin/python"
if [ -x "$py" ] && "$py" -c "import gguf, numpy" 2>/dev/null; then
  echo "$py"
  exit 0
fi
mkdir -p "$root/build"
if ! python3 -m venv "$venv" >&2; then
  echo "ref-venv: python3 -m venv failed (Debian: apt-get install python3-venv)" >&2
  exit 3
fi
if ! "$py" -m pip install --quiet --disable-pip-version-check --timeout 30 --retries 1 \
     "gguf>=0.10" numpy >&2; then
  echo "ref-venv: pip could not install gguf and numpy (offline?)" >&2
  exit 3
fi
echo "$py"
