#!/usr/bin/env bash
# Configures and builds treeattn (Release, warnings as errors) into build/release.
set -euo pipefail
cd "$(dirname "$0")/.."
jobs=$(nproc 2>/dev/null || echo 2)
cmake --preset release >/dev/null
cmake --build --preset release -j"$jobs"
