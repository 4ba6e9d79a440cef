#!/usr/bin/env bash
# Configures and builds treeattn (Release, warnings as errors) into build/release: every target,
# or only the given ones and what they need (tools/quickstart.sh: treeattn_cli).
#   tools/build.sh                 everything: libraries, CLI, tests, benchmarks, Python module,
#                                  CUDA objects (tools/test.sh)
#   tools/build.sh TARGET...       e.g. tools/build.sh treeattn_cli
set -euo pipefail
cd "$(dirname "$0")/.."
jobs=$(nproc 2>/dev/null || echo 2)
cmake --preset release >/dev/null
if [ "$#" -gt 0 ]; then
  cmake --build --preset release -j"$jobs" --target "$@"
else
  cmake --build --preset release -j"$jobs"
fi
