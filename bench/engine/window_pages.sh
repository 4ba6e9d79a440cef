#!/usr/bin/env bash
# Sliding-window layers' memory in the serving engine (Gemma-3-270M: 15 of its 18 layers have a
# 512-position window): one greedy request of a long prompt through `treeattn generate --engine`
# at 2 ranks, twice in one run: with window pages (--kv-window-pages -1, the default: those
# layers keep the pages their window still sees) and without (0: every position in every
# layer). Each run's JSON has the peak RSS of every rank, the most pages in use (full and
# window, over the ranks) with their bytes, and the tokens; the two runs must give the same
# tokens (dropping pages changes no bit).
#
#   bench/engine/window_pages.sh [--quick] [--out DIR]
#     --quick   an 8k-token prompt (default 32,000 of Gemma 3's 32,768-token context)
# Writes DIR/window.json and DIR/all.json (default out/window_pages); tools/results.sh renders
# them (results.md, "Window pages"). Needs the built tree ($TREEATTN_BUILD, default build/release;
# tools/build.sh builds it) and the model
# (tools/fetch-model.sh gemma-3-270m).
set -euo pipefail
cd "$(dirname "$0")/../.."
root=$PWD
out=out/window_pages
prompt=32000
while [ $# -gt 0 ]; do
  case $1 in
    --quick) prompt=8192; shift ;;
    --out) out=$2; shift 2 ;;
    *) echo "window_pages.sh: unknown option '$1'" >&2; exit 2 ;;
  esac
done
build="${TREEATTN_BUILD:-build/release}"
case "$build" in /*) ;; *) build="$root/$build" ;; esac
B=$build/cli/treeattn
[ -x "$B" ] || { echo "window_pages.sh: $B is not built (tools/build.sh)" >&2; exit 2; }
model=$("$root/tools/model-path.sh" gemma-3-270m) ||
  { echo "window_pages.sh: no gemma-3-270m (tools/fetch-model.sh gemma-3-270m)" >&2; exit 2; }
mkdir -p "$out"
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
for run in window:-1 all:0; do
  name=${run%%:*}
  "$B" generate --engine --model "$model" --ranks 2 --threads 1 --prompt-tokens "$prompt" \
    --new-tokens 16 --ignore-eos --kv-window-pages "${run#*:}" --quiet --json "$out/$name.json" \
    > "$out/$name.log" 2>&1 || { echo "window_pages.sh: the $name run failed:" >&2; tail -5 "$out/$name.log" >&2; exit 1; }
  tail -3 "$out/$name.log"
done
python3 - "$out" <<'PY'
import json, sys
w = json.load(open(sys.argv[1] + "/window.json"))
a = json.load(open(sys.argv[1] + "/all.json"))
same = w.get("tokens") == a.get("tokens")
print("window pages: peak RSS per rank %s MiB, window KV %.1f MiB, full KV %.1f MiB" % (
    [round(x / 2**20) for x in w["peak_rss_bytes_by_rank"]], w["kv_window_bytes_used_peak"] / 2**20,
    w["kv_bytes_used_peak"] / 2**20))
print("every position: peak RSS per rank %s MiB, KV %.1f MiB" % (
    [round(x / 2**20) for x in a["peak_rss_bytes_by_rank"]], a["kv_bytes_used_peak"] / 2**20))
print("same tokens: %s" % same)
sys.exit(0 if same else 1)
PY
