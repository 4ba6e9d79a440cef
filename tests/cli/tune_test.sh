#!/usr/bin/env bash
# The kernel tuning from the command line, in a scratch cache directory (never the user's):
#   table       treeattn tune prints every candidate with the probe and the choice, writes the
#               cache and --json; a second key is added to the same file
#   at_start    a first `treeattn run` calibrates its workload (one line) and stores it; the next
#               run finds it (no line) and says the auto layout is the tuned one; --no-tune and
#               TREEATTN_TUNE=0 neither read nor calibrate
#   ignored     a foreign and a corrupt cache: one warning each, the defaults, then rewritten
#   flags       bad flags of tune are refused by name (no measurement)
# Usage: tune_test.sh /path/to/treeattn CASE
set -u
bin=$1
case_name=$2
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
export TREEATTN_CACHE_DIR=$tmp/cache TREEATTN_TUNE=1
py=/usr/bin/python3
. "$(dirname "$0")/expect.sh"  # fail, expect
quick=(--mib 16 --seconds 0.05)

case "$case_name" in
  table)
    out=$("$bin" tune --dtype bf16 --head-dim 64 --group 3 --threads 1 "${quick[@]}" --json "$tmp/t.json" 2>&1) ||
      fail "tune failed: $out"
    for want in "bf16 D64 G3 T1: " "probe .* GB/s" "tiled_prefetch +12288 .* default" "paged_prefetch" \
                "rows_prefetch" "item_order +heads" "item_order +chunks" "layout +rows" "layout +tiled" \
                "<- chosen" "chosen: tiled lead [0-9]+(:l2)?, paged lead [0-9]+(:l2)?, rows lead [0-9]+, (heads|chunks) outer, layout (rows|tiled)" \
                "matmul T1: int8 K-quant token tile" "matmul_tile +512 .* default" \
                "stored 2 entries in $TREEATTN_CACHE_DIR/kernel-tuning-[0-9a-f]{16}.txt"; do
      grep -qE -- "$want" <<<"$out" || fail "tune's output lacks /$want/: $out"
    done
    [ "$(grep -c '<- chosen' <<<"$out")" = 6 ] || fail "not one choice per knob: $out"
    file=$(ls "$TREEATTN_CACHE_DIR"/kernel-tuning-*.txt) || fail "no cache file"
    head -1 "$file" | grep -qx "treeattn kernel tuning 2" || fail "bad header: $(cat "$file")"
    grep -qE "^entry bf16 64 3 1 tiled_prefetch=" "$file" || fail "no entry: $(cat "$file")"
    grep -qE "^matmul 1 tile_bytes=[0-9]+ gops=" "$file" || fail "no matmul line: $(cat "$file")"
    $py - "$tmp/t.json" <<'PY' || exit 1
import json, sys
doc = json.load(open(sys.argv[1]))
assert len(doc) == 2, doc
m = doc[1]
assert m["matmul_threads"] == 1 and m["tile_bytes"] in [c["tile_bytes"] for c in m["candidates"]], m
assert sum(c["chosen"] for c in m["candidates"]) == 1, m
e = doc[0]
assert (e["dtype"], e["head_dim"], e["group"], e["threads"]) == ("bf16", 64, 3, 1), e
assert e["probe_gbps"] > 0 and e["rounds"] >= 3 and e["bytes"] > 0, e
knobs = {c["knob"] for c in e["candidates"]}
assert knobs == {"tiled_prefetch", "paged_prefetch", "rows_prefetch", "item_order", "layout"}, knobs
for k in knobs:
    assert sum(c["chosen"] for c in e["candidates"] if c["knob"] == k) == 1, k
assert str(e["choice"]["tiled_prefetch"]) in [c["value"] for c in e["candidates"] if c["knob"] == "tiled_prefetch"]
assert e["choice"]["layout"] in ("rows", "tiled") and e["choice"]["item_order"] in ("heads", "chunks")
PY
    "$bin" tune --dtype f32 --head-dim 64 --group 3 --threads 1 "${quick[@]}" --no-matmul > "$tmp/2.txt" 2>&1 ||
      fail "second tune: $(cat "$tmp/2.txt")"
    ! grep -q "^matmul" "$tmp/2.txt" || fail "--no-matmul timed matmul: $(cat "$tmp/2.txt")"
    grep -qE "^entry bf16 64 3 1 " "$file" && grep -qE "^entry f32 64 3 1 " "$file" && grep -qx "end 3" "$file" ||
      fail "the second key did not join the first: $(cat "$file")"
    "$bin" tune --dtype f16 --head-dim 64 --threads 1 "${quick[@]}" --no-matmul --no-store > "$tmp/3.txt" 2>&1 ||
      fail "--no-store: $(cat "$tmp/3.txt")"
    grep -q "not stored" "$tmp/3.txt" && ! grep -q "^entry f16" "$file" || fail "--no-store stored" ;;
  at_start)
    run=("$bin" run --ranks 1 --seq 4k --heads 6 --kv-heads 2 --head-dim 64 --dtype f16 --methods tree --warmup 0 --steps 1)
    out=$(TREEATTN_TUNE=0 "${run[@]}" 2>&1) || fail "run with TREEATTN_TUNE=0: $out"
    ! grep -q "tuning the CPU kernels" <<<"$out" || fail "TREEATTN_TUNE=0 calibrated: $out"
    grep -q "KV layout .*(auto, by the CPU's kernel target (TREEATTN_TUNE=0))" <<<"$out" || fail "layout line: $out"
    out=$("${run[@]}" --no-tune 2>&1) || fail "run --no-tune: $out"
    ! grep -q "tuning the CPU kernels" <<<"$out" || fail "--no-tune calibrated: $out"
    [ ! -e "$TREEATTN_CACHE_DIR" ] || fail "--no-tune wrote a cache: $(ls -R "$TREEATTN_CACHE_DIR")"
    out=$("${run[@]}" 2>&1) || fail "first run: $out"
    grep -qE "treeattn run: tuning the CPU kernels for f16 D64 G3 T[0-9]+ \(first use on this CPU and build\) \.\.\. [0-9.]+ s: tiled lead .*; cached in $TREEATTN_CACHE_DIR/kernel-tuning-" <<<"$out" ||
      fail "the first run did not calibrate: $out"
    grep -q "KV layout .*(auto, tuned on this CPU for f16 D64 G3 T" <<<"$out" || fail "the tuned layout is not used: $out"
    out=$("${run[@]}" 2>&1) || fail "second run: $out"
    ! grep -q "tuning the CPU kernels" <<<"$out" || fail "the second run calibrated again: $out"
    grep -q "KV layout .*(auto, tuned on this CPU for f16 D64 G3 T" <<<"$out" || fail "second run: $out" ;;
  ignored)
    "$bin" tune --dtype bf16 --head-dim 64 --group 3 --threads 1 "${quick[@]}" --no-matmul > "$tmp/t.txt" 2>&1 || fail "$(cat "$tmp/t.txt")"
    file=$(ls "$TREEATTN_CACHE_DIR"/kernel-tuning-*.txt)
    sed -i 's/^key .*/key Another CPU (family 25 model 97 stepping 2)|avx2|0.1.0 Release GNU 12.2.0, kernels 000000000000/' "$file"
    run=("$bin" run --ranks 1 --seq 2k --heads 6 --kv-heads 2 --head-dim 64 --dtype bf16 --methods tree --warmup 0 --steps 1 --threads 1)
    out=$(TREEATTN_TUNE=0 "${run[@]}" 2>&1) || fail "$out"
    ! grep -q "warning" <<<"$out" || fail "TREEATTN_TUNE=0 read the file: $out"
    out=$("${run[@]}" 2>&1) || fail "run over a foreign cache: $out"
    grep -q "treeattn: warning: kernel tuning cache $file ignored: it was tuned for Another CPU (family 25 model 97 stepping 2)|avx2|" <<<"$out" ||
      fail "no warning for a foreign file: $out"
    grep -q "tuning the CPU kernels for bf16 D64 G3 T1" <<<"$out" || fail "the foreign file was not replaced: $out"
    grep -q "^key Another CPU" "$file" && fail "still foreign: $(cat "$file")"
    printf 'treeattn kernel tuning 2\nkey half a file' > "$file"
    out=$("$bin" tune --dtype bf16 --head-dim 64 --group 3 --threads 1 "${quick[@]}" --no-matmul 2>&1) || fail "$out"
    grep -q "treeattn: warning: kernel tuning cache $file ignored: it is corrupt" <<<"$out" || fail "no warning for a corrupt file: $out"
    grep -qx "end 1" "$file" || fail "not rewritten: $(cat "$file")" ;;
  flags)
    "$bin" tune --help | grep -q -- "--seconds" || fail "tune --help"
    expect 2 "unknown type 'q4'" 30 -- "$bin" tune --dtype q4
    expect 2 "head_dim 59 is not supported" 30 -- "$bin" tune --head-dim 59
    expect 2 "group '0'" 30 -- "$bin" tune --group 0
    expect 2 "--seconds" 30 -- "$bin" tune --seconds 0
    expect 2 "--mib" 30 -- "$bin" tune --mib -1
    [ ! -e "$TREEATTN_CACHE_DIR" ] || fail "a refused tune wrote a cache" ;;
  *) echo "unknown case $case_name"; exit 2 ;;
esac
echo PASS
