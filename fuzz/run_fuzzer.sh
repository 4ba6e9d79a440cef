#!/usr/bin/env bash
# One fuzz target under ctest (label fuzz) or tools/fuzz.sh: replay every regression input (each
# once crashed the target; now each must pass), then fuzz for SECONDS (or RUNS executions, when
# $TREEATTN_FUZZ_RUNS is set) from the checked-in seeds, with a scratch corpus in WORK. Prints
# the executions done; fails on any crash, leak, timeout or sanitizer report, leaving the input
# under WORK/artifacts/.
# Usage: run_fuzzer.sh BINARY FUZZ_DIR WORK SECONDS
set -euo pipefail
bin=$1 fuzz_dir=$2 work=$3 seconds=$4
name=$(basename "$bin")
seeds=$fuzz_dir/corpus/$name
regressions=$fuzz_dir/regressions/$name
mkdir -p "$work/corpus" "$work/artifacts"
if [ -d "$regressions" ] && [ -n "$(ls -A "$regressions")" ]; then
  "$bin" -runs=0 "$regressions"/* > "$work/regressions.log" 2>&1 \
    || { cat "$work/regressions.log"; echo "$name: a regression input fails again"; exit 1; }
  echo "$name: $(ls "$regressions" | wc -l) regression input(s) pass"
fi
cp -n "$seeds"/* "$work/corpus/" 2>/dev/null || true
limit=(-max_total_time="$seconds")
[ -n "${TREEATTN_FUZZ_RUNS:-}" ] && limit=(-runs="$TREEATTN_FUZZ_RUNS")
dict=()
[ -f "$fuzz_dir/$name.dict" ] && dict=(-dict="$fuzz_dir/$name.dict")
set +e
"$bin" "${limit[@]}" "${dict[@]}" -timeout=10 -rss_limit_mb=2048 -max_len=65536 \
  -print_final_stats=1 -artifact_prefix="$work/artifacts/" "$work/corpus" > "$work/fuzz.log" 2>&1
rc=$?
set -e
runs=$(grep -Eo "stat::number_of_executed_units: *[0-9]+" "$work/fuzz.log" | grep -Eo "[0-9]+$" || echo 0)
corpus=$(ls "$work/corpus" | wc -l)
echo "$name: $runs executions, corpus $corpus inputs, exit $rc"
if [ "$rc" != 0 ]; then
  tail -40 "$work/fuzz.log"
  echo "$name: FAILED; the input is in $work/artifacts/"
  exit 1
fi
