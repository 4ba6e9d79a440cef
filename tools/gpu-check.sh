#!/usr/bin/env bash
# tools/gpu-check.sh OUTDIR: the one command to run on a machine with a GPU.
#
# Needs only the CUDA toolkit (nvcc, with NCCL for the communicator part), CMake, ninja (or make),
# a C++ compiler and python3 (PyTorch optional, for the SDPA peer); no MPI, CLI11, fmt, json,
# GoogleTest or network. It configures a core-only build (TREEATTN_CORE_ONLY: libtreeattn, the
# CUDA executor, the NCCL communicator and tools/gpu_check) in build/gpu-check, builds gpu_check,
# runs it (correctness against the float64 oracle, bandwidth, virtual ranks, NCCL; see
# tools/gpu_check/gpu_check.cpp), then every gpu-labelled test (tests/cuda/test_cuda_executor.cpp
# and test_nccl_comm.cpp, built against minitest instead of GoogleTest: tools/gpu_check/minitest),
# runs PyTorch's SDPA on the same shapes when torch is importable, writes OUTDIR/gpu-check.json
# and prints a short table.
#
# Exit status: 0 every result correct; 1 a wrong result (or gpu_check crashed); 2 the
# environment: no usable GPU, a set-up that failed (the NCCL communicator), or the build failed.
# Environment: TREEATTN_GPU_CHECK_BUILD (build dir), TREEATTN_GPU_CHECK_CMAKE_ARGS (extra
# configure arguments, e.g. -DCMAKE_CUDA_ARCHITECTURES=100), TREEATTN_GPU_CHECK_ARGS (extra
# gpu_check arguments: --seed N --cases N --max-tokens N).
set -uo pipefail
if [ $# -ne 1 ]; then
  echo "usage: $0 OUTDIR" >&2
  exit 2
fi
mkdir -p "$1" && out=$(cd "$1" && pwd)
cd "$(dirname "$0")/.."
build=${TREEATTN_GPU_CHECK_BUILD:-build/gpu-check}
start=$(date +%s)

if ! command -v nvcc >/dev/null 2>&1 && [ -x /usr/local/cuda/bin/nvcc ]; then
  export PATH=/usr/local/cuda/bin:$PATH
fi
if ! command -v nvcc >/dev/null 2>&1; then
  echo "gpu-check: nvcc not found (install the CUDA toolkit or put its bin/ on PATH)" >&2
  exit 2
fi
generator=()
if command -v ninja >/dev/null 2>&1; then generator=(-G Ninja); fi

echo "== configure ($build, core only, CUDA on)"
# shellcheck disable=SC2086
if ! cmake -S . -B "$build" "${generator[@]}" -DCMAKE_BUILD_TYPE=Release -DTREEATTN_CORE_ONLY=ON \
    -DTREEATTN_WITH_CUDA=ON -DTREEATTN_WERROR=OFF -DTREEATTN_CUDA_PTXAS_VERBOSE=ON \
    ${TREEATTN_GPU_CHECK_CMAKE_ARGS:-} \
    >"$out/configure.log" 2>&1; then
  tail -n 30 "$out/configure.log" >&2
  echo "gpu-check: configure failed (full log: $out/configure.log)" >&2
  exit 2
fi
grep -E "treeattn: (CUDA|NCCL|no CUDA)" "$out/configure.log" || true
echo "== build gpu_check and the GPU tests (minitest)"
if ! cmake --build "$build" -j"$(nproc 2>/dev/null || echo 4)" --target gpu_check \
    gpu_minitest_selftest gpu_test_cuda_executor gpu_test_nccl_comm >"$out/build.log" 2>&1; then
  tail -n 40 "$out/build.log" >&2
  echo "gpu-check: build failed (full log: $out/build.log)" >&2
  exit 2
fi
built=$(date +%s)
echo "   built in $((built - start)) s"
# ptxas's figures for the decode kernel instances (TREEATTN_CUDA_PTXAS_VERBOSE): registers per
# thread, stack and spills, to compare with the comment in src/kernels/cuda/decode_kernel.cuh.
awk '/Compiling entry function .*decode_split_kernel/ { k = 1; next }
     k && /bytes stack frame/ { stack = $1; spill = $5 + $9 }
     k && /Used [0-9]+ registers/ { n++; if ($5 > most) most = $5; if (stack + spill > 0) bad++; k = 0 }
     END { if (n) printf "   ptxas: %d decode kernel instances, at most %d registers, %d with stack or spills\n", n, most, bad;
           else print "   ptxas: no figures in the build log (objects were up to date)" }' "$out/build.log"

echo "== gpu_check"
# shellcheck disable=SC2086
"$build/tools/gpu_check/gpu_check" "$out" ${TREEATTN_GPU_CHECK_ARGS:-} 2>&1 | tee "$out/gpu_check.log"
rc=${PIPESTATUS[0]}
# gpu_check: 0 correct, 1 a wrong result, 2 the environment (no usable GPU, or a set-up such as
# the NCCL communicator failed); anything else is a crash, which counts as a failure (1), and
# gpu-check-core.json holds the sections that ended before it ("complete": false).
if [ "$rc" -eq 2 ] && grep -q '"section": "device", "name": "CUDA executor"' "$out/gpu-check-core.json" 2>/dev/null; then
  echo "gpu-check: no usable GPU here; nothing was measured (details: $out/gpu-check-core.json)" >&2
  cp "$out/gpu-check-core.json" "$out/gpu-check.json" 2>/dev/null || true
  exit 2
fi
if [ "$rc" -ne 0 ] && [ "$rc" -ne 1 ] && [ "$rc" -ne 2 ]; then
  echo "gpu-check: gpu_check crashed (exit $rc); $out/gpu-check-core.json holds the sections before it" >&2
  rc=1
fi

# The gpu-labelled tests (tests/cuda/test_cuda_executor.cpp, test_nccl_comm.cpp: what ctest -L
# gpu runs on a full machine), built against minitest; each writes OUTDIR/gpu-tests-NAME.json.
echo "== GPU tests"
if ! "$build/tools/gpu_check/gpu_minitest_selftest" >"$out/minitest-selftest.log" 2>&1; then
  echo "   minitest's selftest failed (see $out/minitest-selftest.log): the GPU tests' verdicts cannot be trusted" >&2
  rc=1
fi
for t in test_cuda_executor test_nccl_comm; do
  MINITEST_JSON="$out/gpu-tests-$t.json" timeout 900 "$build/tools/gpu_check/gpu_$t" \
    >"$out/gpu-tests-$t.log" 2>&1
  trc=$?
  echo "   $t: $(tail -n 2 "$out/gpu-tests-$t.log" | head -n 1) (exit $trc; log: $out/gpu-tests-$t.log)"
  grep -A3 -E '^\S+:[0-9]+: Failure' "$out/gpu-tests-$t.log" | head -n 40 || true
  if [ "$trc" -ne 0 ]; then
    rc=1
    [ -s "$out/gpu-tests-$t.json" ] || echo "   $t crashed or timed out before its summary" >&2
  fi
done

if command -v python3 >/dev/null 2>&1; then
  echo "== PyTorch SDPA peer"
  timeout 240 python3 tools/gpu_check/sdpa_peer.py "$out" || echo "   (sdpa peer failed or timed out; see above)"
  python3 tools/gpu_check/report.py "$out" "$((built - start))" || cp "$out/gpu-check-core.json" "$out/gpu-check.json"
else
  cp "$out/gpu-check-core.json" "$out/gpu-check.json"
fi
case "$rc" in
  0) verdict='all results correct' ;;
  2) verdict='a set-up failed (environment; see the ENV lines); no wrong result' ;;
  *) verdict='WRONG RESULTS' ;;
esac
echo "gpu-check: $(( $(date +%s) - start )) s in all; exit $rc ($verdict)"
exit "$rc"
