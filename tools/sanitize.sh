#!/usr/bin/env bash
# The test suite under the sanitizers (issue 12 item 2):
#
#   asan  the `asan` preset (GCC, Debug, AddressSanitizer + UBSan, warnings as errors) and every
#         test labelled unit or multirank (not large, cluster): the library, the CLI, and every
#         strategy under real mpirun. Open MPI's own process-lifetime allocations are suppressed
#         by tools/sanitizers/lsan-openmpi.supp, which names only Open MPI, PMIx, hwloc and
#         libevent frames, nothing of ours. UBSan reports fail the test (halt_on_error).
#   tsan  the `tsan` preset (clang, ThreadSanitizer, LLVM's OpenMP runtime with its Archer tool so
#         that OpenMP's own synchronisation is visible to TSan) and the threaded tests: the kernels
#         at 1..N threads (determinism across thread counts), the in-process communicator (threads
#         as ranks), every strategy and the decode session over it, tree-det.
#
# Usage: tools/sanitize.sh [asan|tsan|all] (default all). Prints the time of each step.
set -euo pipefail
cd "$(dirname "$0")/.."
which=${1:-all}
root=$PWD
step() {
  local t0=$SECONDS
  echo "== $1"
  shift
  "$@"
  echo "== done in $((SECONDS - t0)) s"
}

if [ "$which" = asan ] || [ "$which" = all ]; then
  # Full stacks for every allocation: Open MPI's libraries have no frame pointers, and the
  # suppressions match its entry points, which the fast unwinder does not reach.
  export ASAN_OPTIONS=detect_leaks=1:fast_unwind_on_malloc=0:malloc_context_size=40:check_initialization_order=1
  export LSAN_OPTIONS=suppressions=$root/tools/sanitizers/lsan-openmpi.supp:print_suppressions=0
  export UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1
  step "asan: configure" cmake --preset asan > /dev/null
  step "asan: build" cmake --build build/asan -j"$(nproc)"
  step "asan: unit and multirank tests" \
    ctest --test-dir build/asan -L "unit|multirank" -LE "large|cluster" --output-on-failure \
          --timeout 900 -j1
fi

if [ "$which" = tsan ] || [ "$which" = all ]; then
  archer=$(ls /usr/lib/llvm-*/lib/libarcher.so 2>/dev/null | tail -1)
  [ -n "$archer" ] || { echo "sanitize.sh: libarcher.so missing (apt-get install libomp-14-dev)"; exit 2; }
  export OMP_TOOL_LIBRARIES=$archer
  export TSAN_OPTIONS="halt_on_error=1 second_deadlock_stack=1 ignore_noninstrumented_modules=1"
  tests=(test_kernel_oracle test_kernel_tiled test_local_comm test_strategies_local test_session
         test_tree_det)
  step "tsan: configure" cmake --preset tsan > /dev/null
  step "tsan: build" cmake --build build/tsan -j"$(nproc)" --target "${tests[@]}"
  run_tests() {
    local t bin
    for t in "${tests[@]}"; do
      bin=$(find build/tsan/tests -name "$t" -type f | head -1)
      echo "-- $t"
      "$bin" --gtest_brief=1
    done
  }
  step "tsan: threaded tests" run_tests
fi
