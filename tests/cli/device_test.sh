#!/usr/bin/env bash
# `--device cpu|cuda` of treeattn run and bench (issue 11, item 6).
# Usage: device_test.sh /path/to/treeattn CASE
#
#   flags      without ranks: an unknown device names the known ones; with cuda, --kv-layout tiled
#              is refused (or, in a build without CUDA, the build is named);
#              --help describes --device
#   cuda       bench --kernel --device cuda, and bench and run --device cuda at 1 and 2 ranks: on a
#              machine without a usable GPU
#              (or a build without CUDA/NCCL) exit 2 with one line that names the problem, fast
#              and without a crash; on a machine with GPUs the run must succeed instead, its JSON
#              points carrying "device": "cuda" and the report naming the GPU
#   cpu_json   bench --device cpu (and without --device): every JSON point and the metadata say
#              "cpu", the CSV has the device column, the report header says "device cpu"
set -u
bin=$1
case_name=$2
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMP_NUM_THREADS=1
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
py=/usr/bin/python3

. "$(dirname "$0")/expect.sh"  # fail, expect

# What this build and machine say when CUDA cannot be used.
no_cuda='built without CUDA \(nvcc was not found at configure time; see README, GPUs\)|without NCCL|no CUDA device'
# ... what a build without them says (before any flag check).
no_build='built without CUDA \(nvcc was not found at configure time; see README, GPUs\)|without NCCL'
# ... and when a host has fewer GPUs than ranks (the 2-rank runs on a machine with one GPU).
too_few='ranks on this host share its [0-9]+ GPUs?; --device cuda needs one GPU per rank'
tiny=(--preset mha-64 --seq 1k --warmup 0)

case "$case_name" in
  flags)
    expect 2 "--device 'tpu': unknown device \(known: cpu, cuda\)" 5 -- "$bin" bench --device tpu
    expect 2 "--device 'tpu': unknown device \(known: cpu, cuda\)" 5 -- "$bin" run --device tpu
    expect 2 "--device 'CUDA': unknown device" 5 -- "$bin" run --device CUDA
    expect 2 "--kv-layout tiled .*with --device cuda the shards are rows|$no_cuda" 5 -- \
      "$bin" bench --device cuda --kv-layout tiled
    expect 2 "--kv-layout tiled .*with --device cuda the shards are rows|$no_cuda" 5 -- \
      "$bin" run --device cuda --kv-layout tiled
    # Flag checks come before the search for a GPU: they are checked on every machine (a build
    # without CUDA or NCCL refuses --device cuda first).
    expect 2 "--methods auto with --device cuda|$no_build" 5 -- "$bin" bench --device cuda --methods auto
    expect 2 "method 'hier' is not available with --device cuda|$no_build" 5 -- \
      "$bin" bench --device cuda --methods hier
    expect 2 "--device 'tpu': unknown device \(known: cpu, cuda\)" 5 -- "$bin" verify --device tpu
    expect 2 "method 'hier' is not available with --device cuda|$no_build" 5 -- \
      "$bin" verify --device cuda --methods hier
    expect 0 "PASSED: 0 of 2 checks failed" 120 -- "$bin" verify --device cpu --ranks 2 --cases 2 \
      --methods tree
    help=$("$bin" bench --help) || fail "bench --help"
    grep -qE -- "--device TEXT=cpu" <<<"$help" || { echo "$help"; fail "bench --help lacks --device and its default"; }
    grep -qE "cuda \(one GPU per rank" <<<"$help" || fail "bench --help does not say what cuda needs"
    "$bin" run --help | grep -qE -- "--device" || fail "run --help lacks --device" ;;
  cuda)
    # verify --device cuda: every strategy NCCL can run checked on the GPUs against the float64
    # oracle, or one error line before any rank starts.
    out=$(timeout 300 "$bin" verify --device cuda --ranks 1 --cases 2 2>&1)
    rc=$?
    if grep -qE "terminate called|what\(\)|Segmentation|Aborted|core dumped" <<<"$out"; then
      echo "$out" | tail -20; fail "verify --device cuda crashed"
    fi
    if [ $rc = 0 ]; then
      grep -q "^device cuda" <<<"$out" || { echo "$out"; fail "verify --device cuda: no device line"; }
      grep -q "PASSED" <<<"$out" || { echo "$out"; fail "verify --device cuda did not pass"; }
    else
      [ $rc = 2 ] || { echo "$out" | tail -20; fail "verify --device cuda: exit $rc, expected 0 or 2"; }
      grep -qE "^treeattn verify: error: .*($no_cuda)" <<<"$out" || {
        echo "$out"; fail "verify --device cuda: no line naming the problem"; }
    fi
    # bench --kernel --device cuda: the GPU kernel's roofline (run_roofline_on), or one error line.
    out=$(timeout 120 "$bin" bench --kernel --device cuda --heads 8 --kv-heads 2 --head-dim 128 \
          --seq 4k --dtype bf16 --repeats 1 --json "$tmp/k.json" 2>&1)
    rc=$?
    if grep -qE "terminate called|what\(\)|Segmentation|Aborted|core dumped" <<<"$out"; then
      echo "$out" | tail -20; fail "bench --kernel --device cuda crashed"
    fi
    if [ $rc = 0 ]; then
      grep -qE "^device cuda: .* \(sm_[0-9]+, [0-9]+ GiB\)" <<<"$out" || { echo "$out"; fail "no device line"; }
      $py - "$tmp/k.json" <<'PY' || fail "bench --kernel --device cuda JSON"
import json, sys
r = json.load(open(sys.argv[1]))
assert r and all(x["isa"] == "cuda" and x["layout"] == "rows" and 0 <= x["max_rel_error"] < 1e-5 for x in r), r
PY
    else
      [ $rc = 2 ] || { echo "$out" | tail -20; fail "bench --kernel --device cuda: exit $rc, expected 2"; }
      grep -qE "^treeattn bench --kernel: error: .*($no_cuda)" <<<"$out" || {
        echo "$out"; fail "bench --kernel --device cuda: no line naming the problem"; }
    fi
    for cmd in bench run; do
      for p in 1 2; do
        iters=--iters; [ $cmd = run ] && iters=--steps
        rm -f "$tmp/c.json"
        t0=$(date +%s)
        out=$(timeout 120 "$bin" $cmd --device cuda --ranks $p "${tiny[@]}" $iters 1 --methods tree \
              --json "$tmp/c.json" 2>&1)
        rc=$?
        t1=$(date +%s)
        if grep -qE "terminate called|what\(\)|Segmentation|Aborted|core dumped" <<<"$out"; then
          echo "$out" | tail -20; fail "$cmd --device cuda --ranks $p crashed"
        fi
        if [ $rc = 0 ]; then
          # A machine with GPUs: the real path must work.
          grep -qE "^device cuda: .* \(sm_[0-9]+, [0-9]+ GiB\)" <<<"$out" || { echo "$out"; fail "no device line"; }
          $py - "$tmp/c.json" <<'PY' || fail "$cmd --device cuda JSON"
import json, sys
d = json.load(open(sys.argv[1]))
assert d["meta"]["device"] == "cuda", d["meta"]
assert d["points"] and all(p["device"] == "cuda" and p["ok"] and p["kv_layout"] == "rows" for p in d["points"]), d["points"]
PY
          continue
        fi
        [ $rc = 2 ] || { echo "$out" | tail -20; fail "$cmd --device cuda --ranks $p: exit $rc, expected 2"; }
        # One line says it all: the command, "error", the rank that found it, the problem.
        grep -qE "^treeattn $cmd: error: .*($no_cuda|$too_few)" <<<"$out" || {
          echo "$out"; fail "$cmd --device cuda --ranks $p: no line naming the problem"; }
        [ "$(grep -cE "^treeattn $cmd: error: " <<<"$out")" = 1 ] || {
          echo "$out"; fail "$cmd --device cuda --ranks $p: more than one error line"; }
        if grep -q "no CUDA device" <<<"$out"; then
          # Found by the launcher before any rank starts (this machine's ranks), or by a rank
          # (an outside mpirun): then the rank is named.
          grep -qE "^treeattn $cmd: error: (rank 0: |unsupported: --device cuda: no CUDA device for the ranks on this machine)" <<<"$out" \
            || { echo "$out"; fail "the rank is not named"; }
          if [ $p = 2 ] && grep -q "error: rank 0: " <<<"$out"; then
            grep -q "(and 1 more rank)" <<<"$out" || { echo "$out"; fail "the other rank is not counted"; }
          fi
        fi
        [ $((t1 - t0)) -le 60 ] || fail "$cmd --device cuda --ranks $p took $((t1 - t0)) s"
        [ ! -e "$tmp/c.json" ] || fail "a failed run wrote its JSON"
      done
    done ;;
  cpu_json)
    timeout 300 "$bin" bench --device cpu --ranks 2 "${tiny[@]}" --iters 2 --methods tree,single \
      --json "$tmp/a.json" --csv "$tmp/a.csv" > "$tmp/a.txt" 2>&1 || { cat "$tmp/a.txt"; fail "bench --device cpu"; }
    grep -qx "device cpu" "$tmp/a.txt" || { cat "$tmp/a.txt"; fail "no 'device cpu' header line"; }
    timeout 300 "$bin" bench --ranks 1 "${tiny[@]}" --iters 2 --methods tree \
      --json "$tmp/b.json" > "$tmp/b.txt" 2>&1 || { cat "$tmp/b.txt"; fail "bench without --device"; }
    $py - "$tmp/a.json" "$tmp/a.csv" "$tmp/b.json" <<'PY' || fail "device keys"
import csv, json, sys
a = json.load(open(sys.argv[1]))
assert a["meta"]["device"] == "cpu" and a["meta"]["device_description"] == "device cpu", a["meta"]
assert len(a["points"]) == 2, a["points"]
for p in a["points"]:
    assert p["device"] == "cpu" and p["ok"], p
rows = list(csv.DictReader(open(sys.argv[2])))
assert len(rows) == 2 and all(r["device"] == "cpu" for r in rows), rows
b = json.load(open(sys.argv[3]))
assert b["points"] and all(p["device"] == "cpu" for p in b["points"]), b["points"]
print("device keys ok")
PY
    ;;
  *)
    echo "unknown case $case_name"; exit 2 ;;
esac
echo "ok: $case_name"
