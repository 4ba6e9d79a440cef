#!/usr/bin/env bash
# Fuzzing with libFuzzer (fuzz/): builds the targets with clang into build/fuzz, then runs each
# one (the topology loader, the CLI's value parsers, the GGUF reader, the tokenizer, serve's
# request parser and HTTP request reader, the chat template interpreter, structured output's
# schema compiler and token mask) for a time
# or a number of executions, and prints the executions per target. Crashing inputs are left in
# build/fuzz/work/<target>/artifacts/; a fixed one belongs in fuzz/regressions/<target>/ (every
# run replays those first).
#
# Usage: tools/fuzz.sh [--seconds N] [--runs N] [--target NAME]...   a campaign (default: 600 s
#                                                                    per target, all targets)
#        tools/fuzz.sh --ci                                          what tools/test.sh runs:
#                                                                    ctest -L fuzz, 30 s each (the issue asked for about 30 s)
# --runs N stops each target after N executions instead of after a time.
set -euo pipefail
cd "$(dirname "$0")/.."
seconds=600
runs=
ci=0
targets=()
while [ $# -gt 0 ]; do
  case "$1" in
    --seconds) seconds=$2; shift 2 ;;
    --runs) runs=$2; shift 2 ;;
    --target) targets+=("$2"); shift 2 ;;
    --ci) ci=1; shift ;;
    -h|--help) sed -n '2,/^set -euo/p' "$0" | sed '$d; s/^# \{0,1\}//'; exit 0 ;;
    *) echo "fuzz.sh: unknown argument $1 (see --help)" >&2; exit 2 ;;
  esac
done
if ! command -v clang++ > /dev/null; then
  echo "fuzz.sh: clang++ is missing (tools/deps.sh installs clang and libclang-rt-14-dev)" >&2
  exit 2
fi
ci_seconds=30
CC=clang CXX=clang++ cmake -S fuzz -B build/fuzz -G Ninja -DTREEATTN_FUZZ_SECONDS=$ci_seconds > /dev/null
cmake --build build/fuzz -j"$(nproc)"
if [ $ci = 1 ]; then
  ctest --test-dir build/fuzz -L fuzz --output-on-failure -j1
  exit 0
fi
[ ${#targets[@]} -eq 0 ] && targets=(fuzz_topology fuzz_cli_parsers fuzz_gguf fuzz_tokenizer fuzz_serve_request fuzz_http_request fuzz_jinja fuzz_structured)
declare -A result
status=0
for t in "${targets[@]}"; do
  [ -x "build/fuzz/$t" ] || { echo "fuzz.sh: no target $t" >&2; exit 2; }
  start=$(date +%s)
  mkdir -p build/fuzz/work
  log=build/fuzz/work/$t.log
  if TREEATTN_FUZZ_RUNS=$runs fuzz/run_fuzzer.sh "build/fuzz/$t" fuzz "build/fuzz/work/$t" "$seconds" > "$log" 2>&1; then
    result[$t]="$(grep -E "executions" "$log" | tail -1) ($(( $(date +%s) - start )) s)"
  else
    cat "$log"
    result[$t]="FAILED: see $log and build/fuzz/work/$t/artifacts/"
    status=1
  fi
  echo "${result[$t]}"
done
echo
echo "| target | result |"
echo "|---|---|"
for t in "${targets[@]}"; do echo "| $t | ${result[$t]} |"; done
exit $status
