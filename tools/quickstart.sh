#!/usr/bin/env bash
# The main job on a fresh Debian 12 machine: install what is missing, build, and run a real
# multi-rank tree-attention decode with an exactness check and a side-by-side comparison.
# Extra arguments go to `treeattn run` (see `treeattn run --help`).
# Builds only the treeattn command and the libraries `run` links (no tests, fuzz inputs,
# benchmarks or Python module, no CUDA objects on a machine without an NVIDIA GPU, only the CPU
# kernel target this CPU runs, and no generate/serve subcommands with their model, engine and
# HTTP libraries: tools/build.sh --main-job), and no model download (the main job decodes
# synthetic attention, not a model); tools/test.sh builds and checks everything (every kernel
# target, CUDA when nvcc is found, the model commands) and fetches the model.
set -euo pipefail
cd "$(dirname "$0")/.."
tools/deps.sh --no-model
tools/build.sh --main-job treeattn_cli
exec build/release/cli/treeattn run "$@"
