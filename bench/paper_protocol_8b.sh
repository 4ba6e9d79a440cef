#!/usr/bin/env bash
# The paper's protocol at Llama 3.1-8B's shape on CPU ranks: a prompt, its prefill, 10 new
# tokens, batch 1, tree vs ring-kv vs single, for each rank count and context length.
#
# The model is tools/make-llama8b-shape.py's file (random Q4_0 weights in the 8B shape, written
# into models/ if missing, ~45 s). The prompt's KV cache is filled with seeded values
# (--synthetic-kv) instead of a prefill computed at this shape (51 s for 64 tokens on 2 cores):
# decode speed is real, the text is noise. The three methods decode in one process, each from the
# same cache, one after another (the comma list), so a shared machine's load falls on all three;
# `uptime` is recorded before and after each run.
#
# Usage: bench/paper_protocol_8b.sh          (RANKS="2 4" CTX="8192 32768" by default)
#        RANKS=2 CTX=8192 OUT=out/paper8b bench/paper_protocol_8b.sh
# A run whose JSON is already in OUT is not repeated (delete it to rerun); a run that
# `treeattn generate` refuses for memory is reported as refused. Prints a Markdown table.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
RANKS="${RANKS:-2 4}"
CTX="${CTX:-8192 32768}"
OUT="${OUT:-out/paper8b}"
NEW="${NEW:-10}"
METHODS="${METHODS:-tree,ring-kv,single}"
FALLBACK_METHODS="${FALLBACK_METHODS:-tree,ring-kv}"
CLI="${TREEATTN:-build/release/cli/treeattn}"
MODEL="${MODEL:-models/Llama-3.1-8B-shape-random.Q4_0.gguf}"

if [ ! -x "$CLI" ]; then
  echo "paper_protocol_8b: $CLI is missing (cmake --build build/release --target treeattn_cli)" >&2
  exit 2
fi
if [ ! -f "$MODEL" ]; then
  py="$(tools/ref-venv.sh)" || { echo "paper_protocol_8b: no python with gguf" >&2; exit 3; }
  "$py" tools/make-llama8b-shape.py --out "$MODEL"
fi
mkdir -p "$OUT"
echo "# $(date -u '+%Y-%m-%d %H:%M UTC'), $(nproc) cores, $(grep -m1 'model name' /proc/cpuinfo |
  cut -d: -f2 | xargs), ISA: $(grep -qw avx512f /proc/cpuinfo && echo AVX-512 || echo 'AVX2, no AVX-512')"

for ctx in $CTX; do
  for r in $RANKS; do
    base="$OUT/r${r}_ctx${ctx}"
    if [ -f "$base.json" ]; then
      echo "# ranks $r, $ctx tokens: kept $base.json"
      continue
    fi
    uptime >"$base.uptime"
    : >"$base.log"
    # Each method keeps its own cache (single: the whole prompt on rank 0), so the list can be
    # refused for memory where a shorter one fits: then FALLBACK_METHODS, with the refusal kept.
    for methods in "$METHODS" "$FALLBACK_METHODS"; do
      cmd=("$CLI" generate --session --model "$MODEL" --prompt-tokens "$ctx" --synthetic-kv
           --new-tokens "$NEW" --ignore-eos --quiet --ranks "$r" --method "$methods"
           --json "$base.json.partial")
      echo "# ${cmd[*]}" | tee -a "$base.log"
      rc=0
      "${cmd[@]}" >>"$base.log" 2>&1 || rc=$?
      if [ "$rc" -eq 0 ] || ! grep -q "out of memory" "$base.log" ||
         [ "$methods" = "$FALLBACK_METHODS" ]; then
        break
      fi
      echo "# refused for memory: $(grep -m1 'out of memory' "$base.log"); retrying with $FALLBACK_METHODS"
    done
    uptime >>"$base.uptime"
    if [ "$rc" -eq 0 ]; then
      mv "$base.json.partial" "$base.json"
    else
      rm -f "$base.json.partial"
      echo "# ranks $r, $ctx tokens: exit $rc: $(grep -m1 -i 'error\|needs about' "$base.log" || tail -1 "$base.log")"
    fi
  done
done

METHODS="$METHODS" python3 - "$OUT" "$RANKS" "$CTX" <<'EOF'
import json, os, re, sys
out, ranks, ctxs = sys.argv[1], sys.argv[2].split(), sys.argv[3].split()
def load(base):
    la = [re.search(r"load average: ([\d.]+)", l).group(1)
          for l in open(base + ".uptime") if "load average" in l] if os.path.exists(base + ".uptime") else []
    return la
print("| ranks | context | method | decode ms/token p50 (p99) | sent/rank/token | peak RSS per rank | load before/after |")
print("|---|---|---|---|---|---|---|")
fmt = lambda b: f"{b / 2**30:.2f} GiB" if b >= 2**30 else f"{b / 2**20:.1f} MiB" if b >= 2**20 else f"{b / 2**10:.0f} KiB"
for ctx in ctxs:
    for r in ranks:
        base = f"{out}/r{r}_ctx{ctx}"
        la = "/".join(load(base)) or "?"
        if not os.path.exists(base + ".json"):
            why = "not run"
            if os.path.exists(base + ".log"):
                lines = open(base + ".log").read().strip().splitlines()
                why = "refused: " + next((l for l in lines if "needs about" in l), lines[-1] if lines else "?")[:160]
            print(f"| {r} | {ctx} | - | {why} | | | {la} |")
            continue
        d = json.load(open(base + ".json"))
        log = open(base + ".log").read() if os.path.exists(base + ".log") else ""
        oom = re.search(r"needs about ([\d.]+ GiB)[^;]*; this machine has ([\d.]+ GiB)", log)
        if oom:
            ran = {m["method"] for m in d["methods"]}
            left = [m for m in os.environ.get("METHODS", "tree,ring-kv,single").split(",") if m not in ran]
            print(f"| {r} | {ctx} | {','.join(left)} | refused: the whole list was estimated at "
                  f"{oom.group(1)} with {oom.group(2)} available; the rows below ran without it | | | |")
        rss = " / ".join(fmt(b) for b in d["peak_rss_bytes_by_rank"])
        for m in d["methods"]:
            print(f"| {r} | {ctx} | {m['method']} | {m['decode_ms_p50']:.0f} ({m['decode_ms_p99']:.0f}), "
                  f"{m['decode_steps']} steps | {fmt(m['bytes_sent_per_rank_per_token'])} | {rss} | {la} |")
EOF
