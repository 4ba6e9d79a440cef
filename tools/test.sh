#!/usr/bin/env bash
# The whole default test suite: install what is missing, build with warnings as errors, run
# every test except the labels `large` (slow) and `cluster` (needs network namespaces).
# `tools/test.sh --all` runs those too.
set -euo pipefail
cd "$(dirname "$0")/.."
tools/deps.sh
tools/build.sh
if [ "${1:-}" = "--all" ]; then
  ctest --test-dir build/release --output-on-failure --timeout 900 -j1
else
  ctest --preset release -j1
fi
