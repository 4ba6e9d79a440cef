#!/usr/bin/env bash
# The paper's Llama experiment (Tables 1-2 of arXiv 2408.04093) with the shipped SmolLM2-135M:
# a prompt of N tokens, prefill, then 10 new tokens at batch 1, at P ranks, decoding with tree,
# ring-kv and single. One prefill per (N, P) feeds one session per method (`generate --method
# tree,ring-kv,single`), so the three decode on the same cache in the same run; the prefill
# (balanced blocks + per-layer K/V all-gather, generate.hpp) is the same for every method.
#
#   bench/model/paper_protocol.sh [OUT_DIR]      (default /tmp/treeattn-paper)
#   SEQS="8k 16k 32k" RANKS="2 4" THREADS=1 SYNTHETIC=0 bench/model/paper_protocol.sh
#
# SYNTHETIC=1 fills the KV cache with seeded values instead of running the prefill (decode-only
# numbers in seconds instead of minutes). Writes OUT_DIR/pN_P.json per point, OUT_DIR/table.md
# and OUT_DIR/paper.png (gnuplot, if installed). Not part of the test suite.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
B="${TREEATTN:-$root/build/release/cli/treeattn}"
OUT="${1:-/tmp/treeattn-paper}"
SEQS="${SEQS:-8k 16k 32k}"
RANKS="${RANKS:-2 4}"
THREADS="${THREADS:-1}"
SYNTHETIC="${SYNTHETIC:-0}"
mkdir -p "$OUT"
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMP_NUM_THREADS=1

extra=()
[ "$SYNTHETIC" = 1 ] && extra+=(--synthetic-kv)
echo "# paper protocol: $(date -u +%FT%TZ), commit $(git -C "$root" rev-parse --short HEAD), load $(cut -d' ' -f1-3 /proc/loadavg)" | tee "$OUT/log.txt"
for n in $SEQS; do
  for p in $RANKS; do
    tokens=$(python3 -c "s='$n'; print(int(float(s[:-1]) * 1024) if s[-1] in 'kK' else int(s))")
    echo "== N=$n ($tokens tokens), P=$p" | tee -a "$OUT/log.txt"
    "$B" generate --prompt-tokens "$tokens" --new-tokens 10 --ignore-eos --quiet --ranks "$p" \
      --threads "$THREADS" --method tree,ring-kv,single --timeout-ms 0 "${extra[@]}" \
      --json "$OUT/p${n}_${p}.json" 2>&1 | grep -v "^prefill: layer" | tee -a "$OUT/log.txt"
  done
done

python3 - "$OUT" <<'PY'
import glob, json, os, sys
out = sys.argv[1]
rows = []
for f in sorted(glob.glob(os.path.join(out, "p*_*.json"))):
    j = json.load(open(f))
    m = {x["method"]: x for x in j["methods"]}
    rows.append((len(j["prompt_tokens"]), j["ranks"], j["prefill_ms"] / 1e3, j.get("synthetic_kv", False), m))
rows.sort(key=lambda r: (r[1], r[0]))
lines = ["| prompt | ranks | prefill s | decode ms/token p50: tree / ring-kv / single | tree vs ring-kv (decode) | end-to-end s (prefill + 10): tree / ring-kv / single | tree vs ring-kv (end-to-end) | sent/rank/token: tree / ring-kv |",
         "|---|---|---|---|---|---|---|---|"]
dat = []
for n, p, pre, syn, m in rows:
    t, r, s = m["tree"], m["ring-kv"], m["single"]
    lines.append("| %dk | %d | %s | %.1f / %.1f / %.1f | %.2fx | %.2f / %.2f / %.2f | %.2fx | %.1f KiB / %.1f MiB |" % (
        n // 1024, p, "synthetic" if syn else "%.1f" % pre,
        t["decode_ms_p50"], r["decode_ms_p50"], s["decode_ms_p50"],
        r["decode_ms_p50"] / t["decode_ms_p50"],
        t["end_to_end_s"], r["end_to_end_s"], s["end_to_end_s"],
        r["end_to_end_s"] / t["end_to_end_s"],
        t["bytes_sent_per_rank_per_token"] / 1024, r["bytes_sent_per_rank_per_token"] / 2**20))
    dat.append("%d %d %.3f %.3f %.3f" % (n, p, t["decode_ms_p50"], r["decode_ms_p50"], s["decode_ms_p50"]))
open(os.path.join(out, "table.md"), "w").write("\n".join(lines) + "\n")
open(os.path.join(out, "decode.dat"), "w").write("\n".join(dat) + "\n")
print("\n".join(lines))
PY

if command -v gnuplot >/dev/null 2>&1; then
  gnuplot <<EOF || true
set terminal png size 900,500
set output "$OUT/paper.png"
set title "SmolLM2-135M decode ms/token (p50) vs prompt, tree vs ring-kv vs single"
set xlabel "prompt tokens"; set ylabel "ms per token"; set logscale x 2; set key left top
plot for [p in "$RANKS"] "< awk '\$2==".p."' $OUT/decode.dat" using 1:3 with linespoints title "tree P=".p, \
     for [p in "$RANKS"] "< awk '\$2==".p."' $OUT/decode.dat" using 1:4 with linespoints title "ring-kv P=".p, \
     for [p in "$RANKS"] "< awk '\$2==".p."' $OUT/decode.dat" using 1:5 with linespoints title "single P=".p
EOF
  echo "plot: $OUT/paper.png"
fi
