#!/bin/sh
# Runs a command and checks its combined output and duration; used by the multirank failure
# tests, which must end with a given error inside a bounded time (never hang).
#
#   expect.sh MAX_SECONDS EXIT -e REGEX [-e REGEX]... -- COMMAND [ARGS...]
#
# EXIT is the required exit status, "nonzero", or "any". Every extended REGEX must match some
# line of the output. The command is killed after MAX_SECONDS + 20 s; taking longer than
# MAX_SECONDS fails the test.
set -u
max=$1; want=$2; shift 2
regexes=""
n=0
while [ "$#" -gt 0 ] && [ "$1" != "--" ]; do
  [ "$1" = "-e" ] || { echo "expect.sh: expected -e REGEX or --, got '$1'"; exit 2; }
  n=$((n + 1)); eval "re_$n=\$2"; shift 2
done
[ "$#" -gt 0 ] && shift
out=$(mktemp); trap 'rm -f "$out"' EXIT
start=$(date +%s%N)
timeout -s KILL $((max + 20)) "$@" >"$out" 2>&1
rc=$?
end=$(date +%s%N)
cat "$out"
elapsed_ms=$(( (end - start) / 1000000 ))
echo "expect.sh: exit status $rc after $elapsed_ms ms (limit $max s)"
fail=0
if [ "$elapsed_ms" -gt $((max * 1000)) ]; then echo "expect.sh: FAIL: took longer than $max s"; fail=1; fi
case "$want" in
  any) ;;
  nonzero) [ "$rc" -ne 0 ] || { echo "expect.sh: FAIL: expected a non-zero exit status"; fail=1; } ;;
  *) [ "$rc" -eq "$want" ] || { echo "expect.sh: FAIL: expected exit status $want"; fail=1; } ;;
esac
i=1
while [ "$i" -le "$n" ]; do
  eval "re=\$re_$i"
  if grep -Eq -- "$re" "$out"; then echo "expect.sh: found: $re"; else echo "expect.sh: FAIL: missing: $re"; fail=1; fi
  i=$((i + 1))
done
[ "$fail" -eq 0 ] && echo "expect.sh: PASS"
exit "$fail"
