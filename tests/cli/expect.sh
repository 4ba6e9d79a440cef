# Shared by the CLI test scripts (sourced): fail, and expect, which runs a command and checks its
# exit code, a line of its output, that nothing crashed and how long it took.

fail() { echo "FAIL: $*"; exit 1; }

# expect CODE PATTERN MAX_SECONDS -- command...: exit code, a line matching PATTERN, no crash or
# uncaught C++ exception, and done within MAX_SECONDS. The output is left in $out.
expect() {
  local code=$1 pattern=$2 max=$3 rc t0 t1
  shift 4
  t0=$(date +%s)
  out=$(timeout 120 "$@" 2>&1)
  rc=$?
  t1=$(date +%s)
  [ "$rc" = "$code" ] || { echo "$out" | tail -20; fail "expected exit $code, got $rc from: $*"; }
  grep -qE -- "$pattern" <<<"$out" || { echo "$out" | tail -20; fail "expected /$pattern/ from: $*"; }
  if grep -qE "terminate called|what\(\)|Segmentation|Aborted|bad_alloc|core dumped" <<<"$out"; then
    echo "$out" | tail -20; fail "a crash or an uncaught exception in: $*"
  fi
  [ $((t1 - t0)) -le "$max" ] || fail "took $((t1 - t0)) s (at most $max) for: $*"
}
