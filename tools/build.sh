#!/usr/bin/env bash
# Configures and builds treeattn (Release, warnings as errors) into build/release: every target,
# or only the given ones and what they need (tools/quickstart.sh: treeattn_cli).
#   tools/build.sh                 everything: libraries, CLI, tests, benchmarks, Python module,
#                                  CUDA objects when nvcc is found (tools/test.sh)
#   tools/build.sh TARGET...       e.g. tools/build.sh treeattn_cli
#   tools/build.sh --cpu-only TARGET...
#                                  without the CUDA objects when this machine has no NVIDIA GPU
#                                  (no /dev/nvidia0): they are a third of the CLI's build on two
#                                  cores and the main job cannot run them there; the CLI's
#                                  --device cuda then says CUDA support was not built. The next
#                                  plain call builds them again (TREEATTN_WITH_CUDA back to AUTO).
#   tools/build.sh --host-only TARGET...
#                                  --cpu-only, and only the CPU kernel target this CPU runs
#                                  (TREEATTN_CPU_KERNELS=host: AVX2 here, not also generic and
#                                  AVX-512). A plain call builds them all again.
#   tools/build.sh --main-job TARGET...
#                                  --host-only, and the treeattn command without its generate and
#                                  serve subcommands (TREEATTN_CLI_MODEL_COMMANDS=OFF: no model,
#                                  engine or HTTP libraries; that command says so when asked for
#                                  them). tools/quickstart.sh uses it; a plain call builds them
#                                  again.
set -euo pipefail
cd "$(dirname "$0")/.."
jobs=$(nproc 2>/dev/null || echo 2)
cuda=(-DTREEATTN_WITH_CUDA=AUTO -DTREEATTN_WITH_NCCL=AUTO)
kernels=all
model_commands=ON
if [ "${1:-}" = "--cpu-only" ] || [ "${1:-}" = "--host-only" ] || [ "${1:-}" = "--main-job" ]; then
  if [ "$1" != "--cpu-only" ]; then kernels=host; fi
  if [ "$1" = "--main-job" ]; then model_commands=OFF; fi
  shift
  if [ ! -e /dev/nvidia0 ]; then cuda=(-DTREEATTN_WITH_CUDA=OFF -DTREEATTN_WITH_NCCL=OFF); fi
fi
cmake --preset release "${cuda[@]}" -DTREEATTN_CPU_KERNELS="$kernels" \
  -DTREEATTN_CLI_MODEL_COMMANDS="$model_commands" >/dev/null
if [ "$#" -gt 0 ]; then
  cmake --build --preset release -j"$jobs" --target "$@"
else
  cmake --build --preset release -j"$jobs"
fi
