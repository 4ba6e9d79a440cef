#!/usr/bin/env bash
# The main job on a fresh Debian 12 machine: install what is missing, build, and run a real
# multi-rank tree-attention decode with an exactness check and a side-by-side comparison.
# Extra arguments go to `treeattn run` (see `treeattn run --help`).
set -euo pipefail
cd "$(dirname "$0")/.."
tools/deps.sh
tools/build.sh
exec build/release/cli/treeattn run "$@"
