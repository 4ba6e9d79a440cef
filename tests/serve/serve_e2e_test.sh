#!/usr/bin/env bash
# One end-to-end case of `treeattn serve` (serve_e2e.py): the real model, real sockets, curl and
# the official openai client from the venv of tools/serve-venv.sh. Exit 77 (ctest: skipped)
# when the model or the openai package cannot be had.
# Usage: serve_e2e_test.sh TREEATTN CASE
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
root="$(cd "$here/../.." && pwd)"
bin=$1 case=$2
# The model of the case: tools2 needs a template that takes tools (Qwen2.5-Coder-0.5B), window2
# sliding-window layers (Gemma-3-270M); the others the default model.
name=""
case "$case" in tools2) name=qwen2.5-coder-0.5b ;; window2) name=gemma-3-270m ;; esac
if ! model="$("$root/tools/model-path.sh" $name)"; then
  echo "SKIP: the model ${name:-(default)} is not here (tools/fetch-model.sh ${name} fetches it)"
  exit 77
fi
if ! command -v curl > /dev/null; then
  echo "SKIP: curl is missing (apt-get install curl)"
  exit 77
fi
if ! py="$("$root/tools/serve-venv.sh")"; then
  echo "SKIP: the openai Python client cannot be installed (tools/serve-venv.sh: no PyPI?)"
  exit 77
fi
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
export NO_PROXY="127.0.0.1,localhost${NO_PROXY:+,$NO_PROXY}" no_proxy="127.0.0.1,localhost${no_proxy:+,$no_proxy}"
exec "$py" "$here/serve_e2e.py" "$bin" "$model" "$case"
