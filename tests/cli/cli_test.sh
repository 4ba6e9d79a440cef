#!/usr/bin/env bash
# CLI behaviour tests: argument errors, JSON/CSV schema, a tiny bench and verify under mpirun.
# Usage: cli_test.sh /path/to/treeattn CASE
set -u
bin=$1
case_name=$2
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
py=/usr/bin/python3

# expect_fail CODE PATTERN -- command...: exit code and a message on stderr/stdout.
expect_fail() {
  local code=$1 pattern=$2
  shift 3
  local out rc
  out=$(timeout 120 "$@" 2>&1)
  rc=$?
  if [ "$rc" != "$code" ]; then
    echo "expected exit $code, got $rc from: $*"; echo "$out"; exit 1
  fi
  if ! grep -qE -- "$pattern" <<<"$out"; then
    echo "expected /$pattern/ in the output of: $*"; echo "$out"; exit 1
  fi
}

case "$case_name" in
  bad_heads)
    expect_fail 2 "heads \(6\) must be a multiple of kv_heads \(4\)" -- "$bin" run --heads 6 --kv-heads 4 ;;
  bad_head_dim)
    expect_fail 2 "head_dim 59 is not supported \(supported: 64, 80, 96, 128, 192, 256\)" -- "$bin" bench --head-dim 59 ;;
  unknown_method)
    expect_fail 2 "unknown method 'foo' \(known: tree, tree-paper" -- "$bin" bench --methods tree,foo ;;
  unknown_preset)
    expect_fail 2 "unknown preset 'gpt9' \(known: llama3-8b" -- "$bin" run --preset gpt9 ;;
  bad_size)
    expect_fail 2 "'12q' is not a size" -- "$bin" bench --seq 12q ;;
  too_big)
    expect_fail 2 "needs about .* of memory; this machine has .* available" -- "$bin" bench --seq 64G ;;
  unknown_flag)
    expect_fail 109 "--frobnicate" -- "$bin" bench --frobnicate ;;
  help_shows_defaults)
    out=$("$bin" bench --help) || exit 1
    for want in "--seq" "--ranks" "--methods" "--iters" "--warmup" "--plot" "--json" "--csv" "--shard" "--preset" "llama3-8b"; do
      grep -q -- "$want" <<<"$out" || { echo "bench --help lacks $want"; echo "$out"; exit 1; }
    done
    grep -qE -- "--iters INT=20" <<<"$out" || { echo "bench --help does not show the default of --iters"; exit 1; } ;;
  bench_json_schema)
    timeout 300 "$bin" bench --ranks 1,2 --seq 1k,3000 --methods tree,ring-kv,single --iters 3 --warmup 1 \
      --json "$tmp/b.json" --csv "$tmp/b.csv" --plot "$tmp/b.png" > "$tmp/out.txt" 2>&1 || { cat "$tmp/out.txt"; exit 1; }
    test -s "$tmp/b.png" || { echo "no plot written"; exit 1; }
    $py - "$tmp/b.json" "$tmp/b.csv" <<'PY' || exit 1
import csv, json, sys
doc = json.load(open(sys.argv[1]))
pts = doc["points"]
assert len(pts) == 2 * 2 * 3, len(pts)
need = ["method", "ranks", "nodes", "seq", "batch", "heads", "kv_heads", "head_dim", "q_len", "dtype",
        "latency_us", "bytes_sent_per_rank", "bytes_formula", "peak_bytes_per_rank", "peak_rss_bytes",
        "max_rel_err"]
for p in pts:
    for k in need:
        assert k in p, (k, p)
    for k in ["min", "p50", "p90", "p99"]:
        assert p["latency_us"][k] > 0, p
    assert p["latency_us"]["min"] <= p["latency_us"]["p50"] <= p["latency_us"]["p90"] <= p["latency_us"]["p99"]
    assert p["max_rel_err"] <= 1e-5 and p["ok"], p
    assert p["heads"] == 32 and p["kv_heads"] == 8 and p["head_dim"] == 128
    if p["method"] == "ring-kv" and p["ranks"] > 1:
        # the KV rotation moves (p-1)/p of the cache per rank: far more than the tree's states
        kv = 2 * p["seq"] * 8 * 128 * 2
        assert p["bytes_sent_per_rank"] >= 0.9 * kv * (p["ranks"] - 1) / p["ranks"], p
    if p["method"] == "tree" and p["ranks"] > 1:
        assert p["bytes_sent_per_rank"] < 64 * 1024, p
rows = list(csv.DictReader(open(sys.argv[2])))
assert len(rows) == len(pts)
assert {r["method"] for r in rows} == {"tree", "ring-kv", "single"}
print("schema ok:", len(pts), "points")
PY
    ;;
  verify_passes)
    out=$(timeout 300 "$bin" verify --ranks 3 --cases 2 --save "$tmp/cases" 2>&1)
    rc=$?
    [ $rc = 0 ] || { echo "verify failed ($rc)"; echo "$out"; exit 1; }
    grep -q "PASSED: 0 of 18 checks failed" <<<"$out" || { echo "$out"; exit 1; }
    $py - "$tmp/cases" <<'PY' || exit 1
import json, os, sys
import numpy as np
d = sys.argv[1]
idx = json.load(open(os.path.join(d, "index.json")))
assert idx["ranks"] == 3 and len(idx["cases"]) == 2
for c in idx["cases"]:
    f = {k: np.load(os.path.join(d, v)) for k, v in c["files"].items()}
    B, Q, H, D, Hkv = c["batch"], c["q_len"], c["heads"], c["head_dim"], c["kv_heads"]
    out = np.zeros((B, Q, H, D)); lse = np.full((B, Q, H), -np.inf)
    for b in range(B):
        n = c["kv_lengths"][b]
        for i in range(Q):
            lim = n - Q + i + 1
            for h in range(H):
                kv = h // (H // Hkv)
                if lim <= 0: continue
                s = f["k"][b, kv, :lim].astype(np.float64) @ f["q"][b, i, h].astype(np.float64) * c["scale"]
                m = s.max(); w = np.exp(s - m)
                out[b, i, h] = w @ f["v"][b, kv, :lim].astype(np.float64) / w.sum()
                lse[b, i, h] = m + np.log(w.sum())
    err = np.abs(out - f["out"]).max() / max(1.0, np.abs(out).max())
    assert err < 1e-5, err
    fin = np.isfinite(lse)
    assert (np.isfinite(f["lse"]) == fin).all()
    assert np.abs(lse[fin] - f["lse"][fin]).max(initial=0) < 1e-4
print("saved cases recheck with numpy: ok")
PY
    ;;
  verify_can_fail)
    expect_fail 1 "rerun: treeattn verify --ranks 2 --seed 5 --cases 1 --methods tree" -- \
      "$bin" verify --ranks 2 --cases 1 --seed 5 --methods tree --tolerance 1e-30 ;;
  *)
    echo "unknown case $case_name"; exit 2 ;;
esac
echo "ok: $case_name"
