#!/usr/bin/env bash
# Limits and faults of the CLI and its launcher: caps on threads and counts, the messages without
# ranks, the oracle's wait, the blame for a crashed or aborted rank, /dev/shm after SIGKILLs. Each
# case must not crash, run until killed, blame the wrong rank or leave shared memory behind.
# Usage: limits_and_faults_test.sh /path/to/treeattn CASE
#
#   threads      --threads beyond the kernels' one cap (kMaxThreads, 1024) or below 0, in every
#                subcommand that takes it: bench --kernel and topo --detect used to segfault
#   counts       counts that ran until killed (verify --cases, topo --latency-iters and
#                --bandwidth-iters, bench --kernel --repeats, bench --iters as "out of memory"),
#                and --q-len larger than the context
#   messages     --model DIR and /dev/null, a GGUF whose header counts no metadata, --baseline
#                foo, hexadecimal/binary/octal integers, --nodes / --root / --device cuda refused
#                before mpirun starts (TREEATTN_MPIRUN points at nothing, so a launch would show)
#   oracle_wait  a short --timeout-ms while rank 0 computes a long float64 oracle and the ranks
#                fill their shards: local work, not a rank that never arrived (multirank)
#   blame        a rank that crashes is named with its signal; a rank stopped by another rank's
#                MPI_Abort is not reported as SIGKILLed (mismatch:0 under load) (multirank)
#   shm          a SIGKILLed mpirun, and a SIGKILLed launcher + mpirun + ranks, leave no Open MPI
#                segments in /dev/shm once the launcher (or the next launch) has swept (multirank)
set -u
bin=$1
case_name=$2
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMP_NUM_THREADS=1
tmp=$(mktemp -d)
busy=()
cleanup() {
  for p in "${busy[@]}"; do kill "$p" 2>/dev/null; done
  rm -rf "$tmp"
}
trap cleanup EXIT

. "$(dirname "$0")/expect.sh"  # fail, expect

# pids of processes whose environment carries VAR=VALUE (and, if given, also VAR2=VALUE2)
pids_with() {
  local p
  for p in /proc/[0-9]*; do
    grep -qz "^$1\$" "$p/environ" 2>/dev/null || continue
    [ -z "${2:-}" ] || grep -qz "^$2\$" "$p/environ" 2>/dev/null || continue
    echo "${p#/proc/}"
  done
}

# /dev/shm names of Open MPI job JOB (decimal, as in OMPI_MCA_ess_base_jobid)
segments_of() { ls /dev/shm 2>/dev/null | grep -E "^vader_segment\..*\.$(printf '%x' "$1")\.[0-9]+\$"; }

threads_msg="must be between 0 \(the default\) and 1024"

case "$case_name" in
  threads)
    expect 2 "--threads 100000: $threads_msg" 5 -- "$bin" bench --kernel --seq 4k --repeats 1 --threads 100000
    expect 2 "--threads -1: $threads_msg" 5 -- "$bin" bench --kernel --seq 4k --repeats 1 --threads -1
    expect 2 "--threads 100000: $threads_msg" 5 -- "$bin" topo --detect --ranks 2 --threads 100000
    expect 2 "--threads 2147483647: $threads_msg" 5 -- "$bin" topo --detect --ranks 2 --threads 2147483647
    expect 2 "--threads -1: $threads_msg" 5 -- "$bin" topo --detect --threads -1
    expect 2 "--threads 4096: $threads_msg" 5 -- "$bin" run --ranks 2 --seq 1k --threads 4096
    expect 2 "--threads -1: $threads_msg" 5 -- "$bin" bench --ranks 2 --seq 1k --threads -1
    expect 2 "--threads 2000: $threads_msg" 5 -- "$bin" generate --prompt a --threads 2000
    expect 2 "--threads -1: $threads_msg" 5 -- "$bin" serve --threads -1
    ;;
  counts)
    expect 2 "--cases 2147483647: must be between 1 and 100000" 5 -- "$bin" verify --cases 2147483647
    expect 2 "--latency-iters 2147483647: must be between 1 and 1000000" 5 -- \
      "$bin" topo --detect --latency-iters 2147483647
    expect 2 "--bandwidth-iters 2147483647: must be between 1 and 10000" 5 -- \
      "$bin" topo --detect --bandwidth-iters 2147483647
    expect 2 "--repeats 2147483647: must be between 1 and 10000" 5 -- \
      "$bin" bench --kernel --seq 4k --repeats 2147483647
    expect 2 "--iters 2147483647: must be between 1 and 100000" 5 -- "$bin" bench --iters 2147483647
    expect 2 "--steps 0: must be between 1 and 100000" 5 -- "$bin" run --steps 0
    expect 2 "--warmup 2147483647: must be between 0 and 100000" 5 -- "$bin" run --warmup 2147483647
    expect 2 "--q-len 5000 must be <= the context \(--seq 4k\)" 5 -- "$bin" bench --q-len 5000 --seq 4k
    expect 2 "--q-len 5000 must be <= the context" 5 -- "$bin" bench --kernel --q-len 5000 --seq 4k
    ;;
  messages)
    mkdir "$tmp/dir"
    expect 2 "--model $tmp/dir is a directory" 5 -- "$bin" generate --model "$tmp/dir" --prompt hi
    expect 2 "--model /dev/null is not a regular file" 5 -- "$bin" generate --model /dev/null --prompt hi
    expect 2 "--model $tmp/missing.gguf: no such file" 5 -- "$bin" generate --model "$tmp/missing.gguf" --prompt hi
    # GGUF v3 whose header counts 1 tensor and 0 metadata entries, followed by the metadata it
    # does have (general.architecture = "llama"): the tensor directory starts with a key.
    python3 - "$tmp/nometa.gguf" <<'PY'
import struct, sys
key, val = b"general.architecture", b"llama"
body = struct.pack("<Q", len(key)) + key + struct.pack("<I", 8) + struct.pack("<Q", len(val)) + val
open(sys.argv[1], "wb").write(b"GGUF" + struct.pack("<IQQ", 3, 1, 0) + body + b"\0" * 64)
PY
    expect 2 "tensor 0 is named 'general.architecture', a metadata key: the header's metadata count \(0\)" 5 -- \
      "$bin" generate --model "$tmp/nometa.gguf" --prompt hi
    expect 2 "--baseline: unknown method 'foo' \(known: .*ring-kv" 5 -- "$bin" bench --ranks 2 --seq 1k --baseline foo
    for a in "bench --heads 0x20" "verify --cases 0x10" "topo --detect --ranks 0b10" "run --seed 0x5" \
             "plan --heads 1e3" "bench --threads +5"; do
      # shellcheck disable=SC2086
      expect 105 "is not a decimal integer" 5 -- "$bin" $a
    done
    # Leading zeros are zeros, not octal: 010 is ten.
    expect 0 "H=10 Hkv=2" 10 -- "$bin" plan --topology preset:local --heads 010 --kv-heads 2 --ranks 2 --seq 1k
    # Refused before mpirun starts: a launch would fail to run the missing program instead.
    export TREEATTN_MPIRUN=$tmp/no-mpirun
    expect 2 "--nodes 0 must be between 1 and the 2 ranks" 5 -- "$bin" bench --ranks 2 --seq 1k --nodes 0
    expect 2 "--nodes 3 must be between 1 and the 2 ranks" 5 -- "$bin" run --ranks 2 --seq 1k --nodes 3
    expect 2 "--root 2 must be -1 .* or a rank of the 2-rank job \(0..1\)" 5 -- "$bin" bench --ranks 2 --seq 1k --root 2
    expect 2 "--root 2 must be -1" 5 -- "$bin" bench --ranks 4,2 --seq 1k --root 2
    if nvidia-smi -L >/dev/null 2>&1; then
      echo "messages: --device cuda before mpirun skipped: this machine has a GPU"
    else
      expect 2 "treeattn bench: error: .*--device cuda: (this treeattn was built without|.*without NCCL|no CUDA device)" 5 -- \
        "$bin" bench --device cuda --ranks 2 --seq 1k --methods tree
    fi
    unset TREEATTN_MPIRUN
    ;;
  oracle_wait)
    # Rank 0's oracle over 256k tokens takes seconds; each rank fills 128k tokens of shard.
    expect 0 "tree +2 +256k .* ok" 120 -- \
      "$bin" bench --ranks 2 --seq 256k --iters 1 --warmup 0 --methods tree --timeout-ms 300
    ;;
  blame)
    # A crash: SIGSEGV sent to rank 1 while it decodes.
    mark=h2-$$-$RANDOM
    TREEATTN_TEST_MARK=$mark "$bin" run --ranks 2 --seq 64k --methods tree --warmup 0 --steps 5000 \
      > "$tmp/out" 2>&1 &
    pid=$!
    for _ in $(seq 100); do
      r1=$(pids_with "TREEATTN_TEST_MARK=$mark" "OMPI_COMM_WORLD_RANK=1")
      [ -n "$r1" ] && grep -q "round robin" "$tmp/out" && break
      sleep 0.2
    done
    [ -n "$r1" ] || { cat "$tmp/out"; fail "blame: rank 1 did not start"; }
    kill -SEGV "$r1"
    wait "$pid"
    rc=$?
    [ "$rc" = 139 ] || { cat "$tmp/out"; fail "blame: a crashed rank: exit $rc, expected 139"; }
    grep -qE "treeattn run: rank 1 \(pid $r1\) crashed in p=2 seq=65536 batch=1: .*: signal 11 \(Segmentation fault\)" "$tmp/out" \
      || { cat "$tmp/out"; fail "blame: the crash and its signal are not named"; }
    grep -q "SIGKILL" "$tmp/out" && { cat "$tmp/out"; fail "blame: a crash described as SIGKILL"; }
    # Another rank's MPI_Abort ends the ranks; under load some are gone before they can say
    # so. None of them died of a SIGKILL of its own.
    for _ in 1 2; do sh -c 'while :; do :; done' & busy+=($!); done
    for i in 1 2 3 4 5 6 7 8; do
      out=$(timeout 60 "$bin" run --ranks 4 --seq 16k --methods tree --inject mismatch:0 2>&1)
      rc=$?
      [ "$rc" = 3 ] || { echo "$out" | tail; fail "blame: mismatch:0 trial $i: exit $rc, expected 3"; }
      grep -qE "rank [0-3] has head_dim=(64|128), rank [0-3] has head_dim=(64|128)" <<<"$out" \
        || { echo "$out" | tail; fail "blame: mismatch:0 trial $i: the mismatch is not named"; }
      if grep -q "died without a message" <<<"$out"; then
        echo "$out" | tail; fail "blame: mismatch:0 trial $i: a rank stopped by MPI_Abort reported as killed"
      fi
    done
    ;;
  shm)
    # 1. mpirun SIGKILLed (its process group): the launcher ends the orphaned ranks and sweeps.
    # 2. launcher, mpirun and ranks all SIGKILLed: the next launch sweeps the dead job's segments.
    for how in mpirun all; do
      mark=h2shm-$$-$RANDOM
      TREEATTN_TEST_MARK=$mark setsid "$bin" run --ranks 2 --seq 64k --methods tree --warmup 0 \
        --steps 5000 > "$tmp/out" 2>&1 &
      pid=$!
      job=""
      for _ in $(seq 100); do
        r0=$(pids_with "TREEATTN_TEST_MARK=$mark" "OMPI_COMM_WORLD_RANK=0")
        [ -n "$r0" ] && job=$(tr '\0' '\n' < "/proc/$r0/environ" | sed -n 's/^OMPI_MCA_ess_base_jobid=//p')
        [ -n "$job" ] && [ -n "$(segments_of "$job")" ] && grep -q "round robin" "$tmp/out" && break
        sleep 0.2
      done
      [ -n "$job" ] && [ -n "$(segments_of "$job")" ] || { cat "$tmp/out"; fail "shm $how: no job segments seen"; }
      mp=$(pgrep -P "$pid" mpirun)
      [ -n "$mp" ] || fail "shm $how: no mpirun under the launcher"
      if [ "$how" = mpirun ]; then
        kill -KILL -- "-$mp"
        wait "$pid"
        rc=$?
        [ "$rc" = 137 ] || { cat "$tmp/out"; fail "shm mpirun: exit $rc, expected 137"; }
      else
        # shellcheck disable=SC2046
        kill -KILL "$pid" "$mp" $(pids_with "TREEATTN_TEST_MARK=$mark")
        wait "$pid" 2>/dev/null
        sleep 1
        [ -n "$(segments_of "$job")" ] || fail "shm all: the segments went without a sweep (nothing to test)"
        expect 0 "PASSED" 60 -- "$bin" verify --ranks 2 --cases 1 --methods tree
      fi
      sleep 0.5
      [ -z "$(pids_with "TREEATTN_TEST_MARK=$mark")" ] || fail "shm $how: processes left"
      left=$(segments_of "$job")
      [ -z "$left" ] || { ls -la /dev/shm; fail "shm $how: segments of job $job left in /dev/shm: $left"; }
    done
    ;;
  *)
    echo "unknown case $case_name"; exit 2 ;;
esac
echo "ok: $case_name"
