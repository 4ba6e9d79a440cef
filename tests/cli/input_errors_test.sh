#!/usr/bin/env bash
# Bad input to the CLI, as a new user and an operator would give it: each case must end with exit
# 2 (or the job's own code) and one clear line, quickly; never a crash, a hang, processes or files
# left behind, or nonsense accepted.
# Usage: input_errors_test.sh /path/to/treeattn CASE
#
#   sizes            k / M alone, fractions of a token, hexadecimal, exponents, signs
#   topology_files   numbers beyond a double, 60,000-deep nesting, duplicate keys (topo --show,
#                    plan --topology, bench --topology)
#   outputs          --json/--csv/--plot/--out/--save into unwritable places or directories,
#                    refused before any rank starts
#   huge_shapes      shapes whose queries and states do not fit: the memory pre-check, and the
#                    exception guard for what it does not cover (bench --kernel); --seq as large
#                    as --q-len (which must not exceed the context)
#   limits           rank caps, --threads, --timeout-ms, --tolerance, --methods '', --devices 0,
#                    --inject syntax, and the help text of --timeout-ms
#   interrupt        SIGTERM / SIGINT / timeout(1) on the launcher: forwarded, job stopped, no
#                    process or temporary file left (multirank)
#   rank_errors      a killed rank and a rank that a library ends with exit(1) are named by our
#                    own line, and exit 1 from a library is not reported as "not exact"
#                    (multirank)
#   inject           every --inject fault once at 3 ranks: the message names the faulty rank,
#                    `slow` passes (multirank)
set -u
bin=$1
case_name=$2
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMP_NUM_THREADS=1
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT

. "$(dirname "$0")/expect.sh"  # fail, expect

# Processes carrying this run's marker in their environment (ranks inherit it through mpirun).
marked() {
  local n=0 p
  for p in /proc/[0-9]*; do
    grep -qz "^TREEATTN_TEST_MARK=$mark\$" "$p/environ" 2>/dev/null && n=$((n + 1))
  done
  echo $n
}

case "$case_name" in
  sizes)
    for s in k M G 0x10 1e3 -5 +5 " 5" 5q 1.5.2 .5k 1.; do
      esc=$(printf '%s' "$s" | sed 's/[][\.*^$+?(){}|]/\\&/g')
      expect 2 "'$esc' is not a size" 5 -- "$bin" bench --seq "$s"
    done
    expect 2 "'1.5' is 1.5 tokens, not a whole number \(use 1 or 2\)" 5 -- "$bin" bench --seq 1.5
    expect 2 "'5.12M' is 5368709.12 tokens, not a whole number \(use 5368709 or 5368710\)" 5 -- \
      "$bin" bench --seq 5.12M
    expect 2 "--batch: 'k' is not a size" 5 -- "$bin" bench --batch k
    expect 2 "size '99999999999G' is too large" 5 -- "$bin" bench --seq 99999999999G
    # Whole numbers with fractions and suffixes are fine: 1.5M = 1572864 tokens.
    expect 0 "1572864|1.5M|1536k" 10 -- "$bin" plan --topology preset:local --seq 1.5M --ranks 2
    ;;
  topology_files)
    "$bin" topo --show preset:local | sed -n '/^{/,$p' > "$tmp/good.json"
    sed 's/"bandwidth_GBps": 32.0/"bandwidth_GBps": 1e400/' "$tmp/good.json" > "$tmp/ovf.json"
    python3 -c "import sys; print(open(sys.argv[1]).read().replace('\"nodes\": 1', '\"nodes\": ' + '9' * 5000))" \
      "$tmp/good.json" > "$tmp/digits.json"
    python3 -c "print('[' * 60000 + ']' * 60000)" > "$tmp/deep.json"
    python3 -c "print('{\"a\":' * 60000 + '1' + '}' * 60000)" > "$tmp/deep_obj.json"
    sed 's/"nodes": 1,/"nodes": 1, "nodes": 2,/' "$tmp/good.json" > "$tmp/dup.json"
    expect 0 "topology local" 5 -- "$bin" topo --show "$tmp/good.json"
    for cmd in "topo --show" "plan --topology" "bench --ranks 2 --seq 1k --topology"; do
      # shellcheck disable=SC2086
      expect 2 "ovf.json: \\\$.memory.bandwidth_GBps: the number 1e400 \(5 characters\) does not fit in a double" 5 -- "$bin" $cmd "$tmp/ovf.json"
      # shellcheck disable=SC2086
      expect 2 "digits.json: \\\$.nodes: the number 9999.*\(5000 characters\) does not fit in a double" 5 -- "$bin" $cmd "$tmp/digits.json"
      # shellcheck disable=SC2086
      expect 2 "deep.json: \\\$\[0\]\[0\].*nested deeper than 64 levels" 5 -- "$bin" $cmd "$tmp/deep.json"
      # shellcheck disable=SC2086
      expect 2 "deep_obj.json: \\\$.a.a.a.*nested deeper than 64 levels" 5 -- "$bin" $cmd "$tmp/deep_obj.json"
      # shellcheck disable=SC2086
      expect 2 "dup.json: \\\$.nodes: duplicate key" 5 -- "$bin" $cmd "$tmp/dup.json"
    done
    ;;
  outputs)
    touch "$tmp/file"
    mkdir "$tmp/dir"
    for bad in /dev/null/sub /proc/x/y.json "$tmp/file/sub" "$tmp/missing/x.json"; do
      expect 2 "--json '$bad' cannot be (created|written)" 5 -- "$bin" bench --ranks 2 --seq 1k --json "$bad"
      expect 2 "--csv '$bad' cannot be (created|written)" 5 -- "$bin" run --ranks 2 --seq 1k --csv "$bad"
      expect 2 "--out '$bad' cannot be (created|written)" 5 -- "$bin" topo --detect --ranks 2 --out "$bad"
      expect 2 "--json '$bad' cannot be (created|written)" 5 -- "$bin" plan --json "$bad"
    done
    expect 2 "--plot '$tmp/dir' is a directory; give a file name in it \($tmp/dir/out.png\)" 5 -- \
      "$bin" bench --ranks 2 --seq 1k --plot "$tmp/dir"
    expect 2 "--json '$tmp/dir' is a directory" 5 -- "$bin" bench --ranks 2 --seq 1k --json "$tmp/dir"
    expect 2 "--plot '$tmp/dir' is a directory" 5 -- "$bin" plan --sweep --plot "$tmp/dir"
    expect 2 "--plot is a --sweep option" 5 -- "$bin" plan --plot "$tmp/x.png"
    expect 2 "--save '/dev/null/sub': cannot create the directory: Not a directory" 5 -- \
      "$bin" verify --ranks 2 --cases 1 --save /dev/null/sub
    expect 2 "--save '$tmp/file': cannot create the directory" 5 -- "$bin" verify --ranks 2 --cases 1 --save "$tmp/file"
    expect 2 "--save '/proc/x': cannot create the directory" 5 -- "$bin" verify --ranks 2 --cases 1 --save /proc/x
    # A read-only directory (root bypasses permissions: a read-only bind mount is not available
    # everywhere, so /proc/self stands in for a place where files cannot be created).
    expect 2 "--save '/proc/self': cannot create files in it" 5 -- "$bin" verify --ranks 2 --cases 1 --save /proc/self
    # The checks leave nothing behind, and a writable path still works.
    [ -z "$(ls -A "$tmp/dir")" ] || fail "the output checks left files in $tmp/dir"
    ;;
  huge_shapes)
    expect 2 "needs about .* of memory; this machine has .* available \(.* of KV cache, .* TiB of queries, outputs and states\)" 10 -- \
      "$bin" run --q-len 2147483647 --seq 2G
    expect 2 "needs about .* of queries, outputs and states" 10 -- "$bin" run --heads 1073741824 --kv-heads 8
    expect 2 "needs about .* of queries, outputs and states" 10 -- "$bin" run --q-len 1000000 --seq 1M
    expect 2 "needs about .* of queries, outputs and states" 10 -- "$bin" bench --batch 100000 --seq 1
    # bench --kernel checks each case against MemAvailable before allocating (under ASan an
    # allocation that large aborts instead of throwing, so the check must come first).
    expect 2 "treeattn bench --kernel: error: out of memory: roofline: .* needs [0-9]* MiB .* MiB are available" 10 -- \
      "$bin" bench --kernel --seq 100M --q-len 100000000 --no-peer --repeats 1
    ;;
  limits)
    expect 2 "--ranks 2147483647: more local ranks than .* cap" 5 -- "$bin" verify --ranks 2147483647
    expect 2 "--ranks 1000: more local ranks than .* cap" 5 -- "$bin" bench --ranks 1000 --seq 1k
    expect 2 "--ranks 1000: more local ranks" 5 -- "$bin" topo --detect --ranks 1000
    expect 2 "--ranks 65: more local ranks than \\\$TREEATTN_MAX_LOCAL_RANKS, 64" 5 -- \
      env TREEATTN_MAX_LOCAL_RANKS=64 "$bin" run --ranks 65 --seq 1k
    expect 2 "--threads 4096: must be between 0 .* and [0-9]+" 5 -- "$bin" bench --ranks 2 --seq 1k --threads 4096
    expect 2 "--threads -1: must be between" 5 -- "$bin" run --ranks 2 --seq 1k --threads -1
    expect 2 "--timeout-ms -5: must be >= 0 \(milliseconds. 0 waits forever\)" 5 -- "$bin" run --ranks 2 --timeout-ms -5
    expect 2 "--timeout-ms -5: must be >= 0" 5 -- "$bin" verify --ranks 2 --timeout-ms -5
    expect 2 "--timeout-ms -5: must be >= 0" 5 -- "$bin" topo --detect --timeout-ms -5
    for cmd in run bench verify topo; do
      "$bin" $cmd --help | grep -qE -- "--timeout-ms .*0: wait forever" || fail "$cmd --help does not say what --timeout-ms 0 does"
    done
    expect 2 "--tolerance nan: must be a finite number >= 0" 5 -- "$bin" verify --tolerance nan
    expect 2 "--tolerance -1: must be a finite number >= 0" 5 -- "$bin" verify --tolerance -1
    expect 2 "--tolerance inf: must be a finite number >= 0" 5 -- "$bin" verify --tolerance inf
    expect 2 "--methods '': no method given" 5 -- "$bin" verify --methods ''
    expect 2 "--methods ',': no method given" 5 -- "$bin" verify --methods ','
    expect 2 "--devices: 0 is not a device count" 5 -- "$bin" plan --sweep --devices 0
    expect 2 "--devices: 0 is not a device count" 5 -- "$bin" plan --sweep --devices 8,0
    expect 2 "--devices is a --sweep option" 5 -- "$bin" plan --devices 8
    expect 2 "--inject 'kill:1': expected never-arrive:RANK@STEP.* \(kill needs @STEP\)" 5 -- "$bin" run --inject kill:1
    expect 2 "--inject 'boom:1': expected" 5 -- "$bin" run --inject boom:1
    expect 2 "--inject 'slow:1:x': .*MS 'x' is not a count" 5 -- "$bin" run --inject slow:1:x
    expect 2 "--inject kill:4@0: there is no rank 4 in a job of 4 ranks" 5 -- "$bin" run --inject kill:4@0
    expect 2 "--inject never-arrive:1@7: step 7 is past the run's 7 steps" 5 -- "$bin" run --inject never-arrive:1@7
    "$bin" run --help | grep -qE -- "--inject .*never-arrive:RANK@STEP" || fail "run --help does not document --inject"
    ;;
  interrupt)
    mark=$$-$RANDOM  # set for the command only: this shell and its greps must not carry it
    for how in TERM INT timeout; do
      ls /tmp | grep "^treeattn-" | sort > "$tmp/before" || true
      t0=$(date +%s)
      if [ "$how" = timeout ]; then
        TREEATTN_TEST_MARK=$mark timeout -s TERM 6 "$bin" run --ranks 3 --seq 256k --methods tree,ring-kv --steps 200 > "$tmp/out" 2>&1
        rc=$?
        want=124
      else
        TREEATTN_TEST_MARK=$mark "$bin" run --ranks 3 --seq 256k --methods tree,ring-kv --steps 200 \
          > "$tmp/out" 2>&1 &
        pid=$!
        sleep 6
        [ "$(marked)" -ge 4 ] || { cat "$tmp/out"; fail "$how: the job is not running (launcher, mpirun, ranks)"; }
        kill -s "$how" "$pid"
        wait "$pid"
        rc=$?
        want=$((128 + $(kill -l "$how")))
      fi
      t1=$(date +%s)
      [ "$rc" = "$want" ] || { cat "$tmp/out"; fail "$how: exit $rc, expected $want"; }
      [ $((t1 - t0)) -le 20 ] || fail "$how: took $((t1 - t0)) s to stop"
      sleep 1
      [ "$(marked)" = 0 ] || { ps -ef | grep -E "mpirun|treeattn" | grep -v grep; fail "$how: processes left running"; }
      grep -qE "interrupted by signal (15|2) \((Terminated|Interrupt)\); the 3-rank job was stopped" "$tmp/out" \
        || { cat "$tmp/out"; fail "$how: no line saying the job was stopped"; }
      # New /tmp/treeattn-<what>-<pid>-* files whose launcher is gone are ours and left behind;
      # files of launchers still running belong to other jobs on this machine.
      left=""
      for f in $(ls /tmp | grep "^treeattn-" | sort | comm -13 "$tmp/before" -); do
        owner=$(echo "$f" | sed -nE 's/^treeattn-[a-z]+-([0-9]+)-.*/\1/p')
        if [ -n "$owner" ] && kill -0 "$owner" 2>/dev/null; then continue; fi
        left="$left $f"
      done
      [ -z "$left" ] || { ls -la /tmp | grep treeattn-; fail "$how: temporary files left in /tmp:$left"; }
    done
    ;;
  rank_errors)
    expect 137 "treeattn run: rank 1 \(pid [0-9]+\) died without a message in p=3 seq=4096 batch=1: timed steps of tree, step 2: killed by a signal" 60 -- \
      "$bin" run --ranks 3 --seq 4k --methods tree --inject kill:1@2 --timeout-ms 5000
    # A library ends the ranks with exit(1): the OpenMP runtime cannot create threads whose 1 GiB
    # stacks do not fit a 4 GB address space. Not "not exact": the ranks and the code are named.
    # An ASan build cannot start under `ulimit -v` at all (its shadow memory is terabytes of
    # address space), so that half is skipped there (tools/sanitize.sh).
    if ldd "$bin" 2>/dev/null | grep -q libasan; then
      echo "rank_errors: the exit(1) case skipped: $bin is built with AddressSanitizer"
      exit 0
    fi
    out=$( (ulimit -v 4000000; OMP_STACKSIZE=1G timeout 120 "$bin" bench --ranks 2 --seq 64k --methods tree \
             --iters 2 --warmup 0 --threads 8) 2>&1)
    rc=$?
    [ "$rc" = 2 ] || { echo "$out"; fail "a library's exit(1): exit $rc, expected 2"; }
    grep -qE "treeattn bench: rank [01] \(pid [0-9]+\) exited with code 1 in p=2 seq=65536 batch=1: memory pass of tree" <<<"$out" \
      || { echo "$out"; fail "the rank's real end is not named"; }
    grep -q "not exact" <<<"$out" && { echo "$out"; fail "a library's exit(1) reported as not exact"; }
    grep -q "the 2-rank job failed (exit 1)" <<<"$out" || { echo "$out"; fail "no job failure line"; }
    ;;
  inject)
    common=(--ranks 3 --seq 4k --methods tree,ring-state --warmup 1 --steps 3 --timeout-ms 2000)
    expect 3 "rank 2 never arrived" 30 -- "$bin" run "${common[@]}" --inject never-arrive:2@1
    expect 137 "rank 0 \(pid [0-9]+\) died without a message in .* step 3" 30 -- "$bin" run "${common[@]}" --inject kill:0@3
    expect 2 "rank [0-2]: rank 1 brought a non-finite input \(nan\)" 30 -- "$bin" run "${common[@]}" --inject nan:1
    expect 3 "rank 0 has head_dim=128, rank 2 has head_dim=64" 30 -- "$bin" run "${common[@]}" --inject mismatch:2
    expect 0 "tree .* ok" 30 -- "$bin" run "${common[@]}" --inject slow:1:300
    ;;
  *)
    echo "unknown case $case_name"; exit 2 ;;
esac
echo "ok: $case_name"
