#!/usr/bin/env bash
# tools/gpu-check.sh OUTDIR [--build-only]: the one command to run on a machine with a GPU.
#
# Needs only the CUDA toolkit (nvcc, with NCCL for the communicator part), CMake >= 3.25, ninja (or
# make), a C++ compiler and python3 (PyTorch optional, for the SDPA peer); no MPI, CLI11, fmt,
# json, GoogleTest or network. It configures a core-only build (TREEATTN_CORE_ONLY: libtreeattn
# with its strategies and session, the CUDA executor, the NCCL communicator and tools/gpu_check)
# in build/gpu-check. Where NCCL is not found it installs the nvidia-nccl-cuMAJOR wheel for the
# toolkit's major version (pip, into the build folder) and configures again; where that fails too
# the verdict says "NCCL: NOT TESTED".
#
# One failure hides no other verdict:
# - build: gpu_check first and alone, then each test program on its own; a program that does not
#   compile fails its own verdict (OUTDIR/build-TARGET.log) and the rest still build and run;
# - gpu_check: each section (widening, correctness, bandwidth (bf16), bandwidth8 (fp8 and int8),
#   nccl) in a process of its own, under a timeout (TREEATTN_GPU_CHECK_SECTION_TIMEOUT seconds,
#   600), into OUTDIR/gpu-check-SECTION.json: a kernel fault spoils the CUDA context of its
#   process only;
# - the gpu-labelled tests (tests/cuda/test_cuda_executor.cpp, test_nccl_comm.cpp, built against
#   tools/gpu_check/minitest): each test in a process of its own (minitest --isolate, at most
#   TREEATTN_GPU_CHECK_TEST_TIMEOUT seconds a test, 300), OUTDIR/gpu-tests-NAME.json rewritten as
#   each test ends.
# Then PyTorch's SDPA on the same shapes when torch is importable, and tools/gpu_check/report.py
# joins everything into OUTDIR/gpu-check.json and prints the table and every verdict.
# --build-only stops after the build (for a machine without a GPU: every GPU target compiles).
#
# Exit status: 0 every result correct; 1 a wrong result, a crash, a timeout or a target that did
# not build; 2 the environment and nothing wrong: no usable GPU, CMake too old, no nvcc, a failed
# configure or a set-up that failed (the NCCL communicator).
# Environment: TREEATTN_GPU_CHECK_BUILD (build dir), TREEATTN_GPU_CHECK_CMAKE_ARGS (extra
# configure arguments, e.g. -DCMAKE_CUDA_ARCHITECTURES=100), TREEATTN_GPU_CHECK_ARGS (extra
# gpu_check arguments: --seed N --cases N --max-tokens N), TREEATTN_GPU_CHECK_SECTION_TIMEOUT,
# TREEATTN_GPU_CHECK_TEST_TIMEOUT.
set -uo pipefail
build_only=0
if [ $# -eq 2 ] && [ "$2" = "--build-only" ]; then
  build_only=1
elif [ $# -ne 1 ]; then
  echo "usage: $0 OUTDIR [--build-only]" >&2
  exit 2
fi
mkdir -p "$1" && out=$(cd "$1" && pwd)
cd "$(dirname "$0")/.." || exit 2
build=${TREEATTN_GPU_CHECK_BUILD:-build/gpu-check}
section_timeout=${TREEATTN_GPU_CHECK_SECTION_TIMEOUT:-600}
test_timeout=${TREEATTN_GPU_CHECK_TEST_TIMEOUT:-300}
start=$(date +%s)
# What ran and how it ended, one line each (kind, name, status, detail; tab-separated), for
# report.py: build TARGET ok|failed LOG, section NAME EXIT, tests NAME EXIT|build-failed, and
# nccl - built|NOT TESTED (why).
runs="$out/gpu-check-runs.tsv"
: >"$runs"
rm -f "$out"/gpu-check-*.json "$out"/gpu-tests-*.json "$out/gpu-check.json"
record() { printf '%s\t%s\t%s\t%s\n' "$1" "$2" "$3" "${4:-}" >>"$runs"; }

# ---- tools ----------------------------------------------------------------------------------------
cmake_version=$(cmake --version 2>/dev/null | sed -n '1s/^cmake version \([0-9][0-9.]*\).*/\1/p')
if [ -z "$cmake_version" ]; then
  echo "gpu-check: cmake not found; CMake >= 3.25 is needed ('python3 -m pip install cmake' installs one; then put its bin/ on PATH)" >&2
  exit 2
fi
if [ "$(printf '%s\n%s\n' 3.25 "$cmake_version" | sort -V | head -n 1)" != 3.25 ]; then
  echo "gpu-check: cmake $cmake_version is older than 3.25, which this build needs ('python3 -m pip install cmake' installs a newer one; then put its bin/ on PATH)" >&2
  exit 2
fi
if ! command -v nvcc >/dev/null 2>&1 && [ -x /usr/local/cuda/bin/nvcc ]; then
  export PATH=/usr/local/cuda/bin:$PATH
fi
if ! command -v nvcc >/dev/null 2>&1; then
  echo "gpu-check: nvcc not found (install the CUDA toolkit or put its bin/ on PATH)" >&2
  exit 2
fi
cuda_major=$(nvcc --version | sed -n 's/.*release \([0-9][0-9]*\)\..*/\1/p' | head -n 1)
generator=()
if command -v ninja >/dev/null 2>&1; then generator=(-G Ninja); fi
jobs=$(nproc 2>/dev/null || echo 4)

configure() {
  # shellcheck disable=SC2086
  cmake -S . -B "$build" "${generator[@]}" -DCMAKE_BUILD_TYPE=Release -DTREEATTN_CORE_ONLY=ON \
    -DTREEATTN_WITH_CUDA=ON -DTREEATTN_WERROR=OFF -DTREEATTN_CUDA_PTXAS_VERBOSE=ON "$@" \
    ${TREEATTN_GPU_CHECK_CMAKE_ARGS:-} >"$out/configure.log" 2>&1
}
echo "== configure ($build, core only, CUDA on, cmake $cmake_version, CUDA $cuda_major)"
if ! configure; then
  tail -n 30 "$out/configure.log" >&2
  echo "gpu-check: configure failed (full log: $out/configure.log)" >&2
  exit 2
fi
nccl_found() { grep -qE '^-- treeattn: NCCL [0-9]+\.[0-9]+\.[0-9]+ \(' "$out/configure.log"; }
nccl=built
if ! nccl_found; then
  if ! grep -q 'treeattn: NCCL' "$out/configure.log"; then
    nccl="NOT TESTED (the build has no NCCL: TREEATTN_WITH_NCCL=OFF)"
  else
    wheel="nvidia-nccl-cu$cuda_major"
    echo "   NCCL not found: installing the $wheel wheel into $build/nccl-wheel"
    if python3 -m pip install --quiet --disable-pip-version-check --target "$build/nccl-wheel" \
        "$wheel" >"$out/nccl-pip.log" 2>&1 &&
        [ -f "$build/nccl-wheel/nvidia/nccl/include/nccl.h" ] &&
        configure -DTREEATTN_NCCL_ROOT="$PWD/$build/nccl-wheel/nvidia/nccl" && nccl_found; then
      export LD_LIBRARY_PATH="$PWD/$build/nccl-wheel/nvidia/nccl/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
    else
      nccl="NOT TESTED (NCCL >= 2.18 not found, and pip could not install $wheel: $out/nccl-pip.log)"
      configure >/dev/null 2>&1 || true
    fi
  fi
fi
grep -E "treeattn: (CUDA|NCCL|no CUDA)" "$out/configure.log" || true
record nccl - "$nccl"

# ---- build: gpu_check alone, then each test program ------------------------------------------------
# A target that does not build fails its own verdict only.
build_target() {
  local t=$1
  if cmake --build "$build" -j"$jobs" --target "$t" >"$out/build-$t.log" 2>&1; then
    record build "$t" ok "$out/build-$t.log"
    echo "   built $t"
    return 0
  fi
  record build "$t" failed "$out/build-$t.log"
  echo "   $t DID NOT BUILD (log: $out/build-$t.log):" >&2
  grep -m 5 -E 'error' "$out/build-$t.log" >&2 || tail -n 5 "$out/build-$t.log" >&2
  return 1
}
tests=(test_cuda_executor test_nccl_comm)
echo "== build"
build_target gpu_check
for t in gpu_minitest_selftest gpu_minitest_isolate_selftest "${tests[@]/#/gpu_}"; do
  build_target "$t"
done
built=$(date +%s)
echo "   built in $((built - start)) s"
# ptxas's figures for the decode kernel instances (TREEATTN_CUDA_PTXAS_VERBOSE): registers per
# thread, stack and spills, to compare with the comment in src/kernels/cuda/decode_kernel.cuh.
cat "$out"/build-*.log | awk '/Compiling entry function .*decode_split_kernel/ { k = 1; next }
     k && /bytes stack frame/ { stack = $1; spill = $5 + $9 }
     k && /Used [0-9]+ registers/ { n++; if ($5 > most) most = $5; if (stack + spill > 0) bad++; k = 0 }
     END { if (n) printf "   ptxas: %d decode kernel instances, at most %d registers, %d with stack or spills\n", n, most, bad;
           else print "   ptxas: no figures in the build logs (objects were up to date)" }'
build_failed=0
if grep -q $'^build\t[^\t]*\tfailed' "$runs"; then build_failed=1; fi
if [ "$build_only" -eq 1 ]; then
  echo "gpu-check: build only: $([ "$build_failed" -eq 0 ] && echo 'every target built' || echo 'A TARGET DID NOT BUILD'); NCCL: $nccl"
  exit "$build_failed"
fi

# ---- gpu_check, one section a process ---------------------------------------------------------------
rc=0
[ "$build_failed" -eq 1 ] && rc=1
no_gpu=0
echo "== gpu_check"
if [ -x "$build/tools/gpu_check/gpu_check" ] && grep -q $'^build\tgpu_check\tok' "$runs"; then
  for s in widening correctness bandwidth bandwidth8 nccl; do
    # shellcheck disable=SC2086
    timeout -k 10 "$section_timeout" "$build/tools/gpu_check/gpu_check" "$out" --section "$s" \
      ${TREEATTN_GPU_CHECK_ARGS:-} 2>&1 | tee "$out/gpu_check-$s.log"
    src=${PIPESTATUS[0]}
    record section "$s" "$src"
    # 0 correct, 1 a wrong result, 2 the environment; 124 / 137 the timeout; else a crash.
    if [ "$src" -eq 2 ] && grep -q '"section": "device", "name": "CUDA executor"' \
        "$out/gpu-check-$s.json" 2>/dev/null; then
      echo "gpu-check: no usable GPU here; nothing was measured (details: $out/gpu-check-$s.json)" >&2
      no_gpu=1
      break
    fi
    case "$src" in
      0) ;;
      2) [ "$rc" -eq 0 ] && rc=2 ;;
      1) rc=1 ;;
      124 | 137)
        echo "   section $s timed out after $section_timeout s" >&2
        rc=1
        ;;
      *)
        echo "   section $s crashed (exit $src); the others ran in processes of their own" >&2
        rc=1
        ;;
    esac
  done
else
  echo "   gpu_check did not build: its sections have no verdict (log: $out/build-gpu_check.log)" >&2
fi

# ---- the gpu-labelled tests, one test a process -------------------------------------------------------
echo "== GPU tests"
if [ -x "$build/tools/gpu_check/gpu_minitest_isolate_selftest" ] &&
    ! "$build/tools/gpu_check/gpu_minitest_isolate_selftest" >"$out/minitest-isolate-selftest.log" 2>&1; then
  echo "   minitest's isolation selftest failed (see $out/minitest-isolate-selftest.log)" >&2
  rc=1
fi
if ! "$build/tools/gpu_check/gpu_minitest_selftest" >"$out/minitest-selftest.log" 2>&1; then
  echo "   minitest's selftest failed or did not build (see $out/minitest-selftest.log): the GPU tests' verdicts cannot be trusted" >&2
  rc=1
fi
for t in "${tests[@]}"; do
  json="$out/gpu-tests-$t.json"
  if ! grep -q $'^build\tgpu_'"$t"$'\tok' "$runs"; then
    printf '{"tests": [{"name": "%s (build)", "result": "failed", "message": "did not compile: build-gpu_%s.log"}], "passed": 0, "failed": 1, "skipped": 0, "not_run": 0, "complete": true, "build_failed": true}\n' \
      "$t" "$t" >"$json"
    record tests "$t" build-failed
    echo "   $t: DID NOT BUILD (counts as failed; log: $out/build-gpu_$t.log)"
    rc=1
    continue
  fi
  MINITEST_JSON="$json" MINITEST_TIMEOUT="$test_timeout" timeout -k 10 3600 \
    "$build/tools/gpu_check/gpu_$t" --isolate >"$out/gpu-tests-$t.log" 2>&1
  trc=$?
  record tests "$t" "$trc"
  echo "   $t: $(grep -E '^\[==========\]' "$out/gpu-tests-$t.log" | tail -n 1) (exit $trc; log: $out/gpu-tests-$t.log)"
  grep -A3 -E '^\S+:[0-9]+: Failure' "$out/gpu-tests-$t.log" | head -n 40 || true
  grep -E '^\[  FAILED  \] .* \(its process' "$out/gpu-tests-$t.log" || true
  if [ "$trc" -ne 0 ]; then rc=1; fi
done

if [ "$no_gpu" -eq 0 ] && command -v python3 >/dev/null 2>&1; then
  echo "== PyTorch SDPA peer"
  timeout 240 python3 tools/gpu_check/sdpa_peer.py "$out" || echo "   (sdpa peer failed or timed out; see above)"
fi
if command -v python3 >/dev/null 2>&1; then
  python3 tools/gpu_check/report.py "$out" "$((built - start))" || rc=1
fi
if [ "$no_gpu" -eq 1 ] && [ "$rc" -eq 0 ]; then rc=2; fi
case "$rc" in
  0) verdict='all results correct' ;;
  2) if [ "$no_gpu" -eq 1 ]; then verdict='no usable GPU; nothing measured'; else verdict='a set-up failed (environment; see the ENV lines); no wrong result'; fi ;;
  *) verdict='WRONG RESULTS, a crash, a timeout or a target that did not build' ;;
esac
echo "gpu-check: $(($(date +%s) - start)) s in all; exit $rc ($verdict); NCCL: $nccl"
exit "$rc"
