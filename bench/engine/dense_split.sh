#!/usr/bin/env bash
# The dense layers split over the ranks (--dense split, docs/architecture.md "The dense layers
# over the ranks") against replicated and one rank, with `treeattn generate --engine`:
#   1. Inter-token latency of one greedy request (--prompt-tokens C, --threads 1 per rank): 1 rank,
#      2 ranks replicated, 2 ranks split, in turn, --rounds times (each figure the best round's
#      p50), with each rank's time per decode step in the dense part, the attention and the
#      merge and all-gathers; the tokens and the logits hash (--hash-logits) of every run, and
#      auto's choice with its two predictions.
#   2. Resident weights per rank (weights_resident_bytes_by_rank: the model file's pages each rank
#      touched, from /proc/self/smaps, plus its own rows8 copy) with --dense split at 2 and 4 ranks,
#      --matmul exact (no rows8 copy) and int8 (with it), against 1/p of the file.
#
#   3. With --cluster LINKS (root: tools/cluster), 2 emulated hosts x 1 rank over each link
#      (10gbit, 1gbit, veth = unshaped): 2 ranks replicated, split and auto in turn, one cluster
#      session per link, auto planning on the link's preset with one rank per host (emu-veth's
#      numbers for 10gbit and veth, emu-1gbit's for 1gbit), its prediction beside the figures.
#
#   bench/engine/dense_split.sh [--quick] [--out DIR] [--models LIST] [--contexts LIST]
#                               [--rounds N] [--cluster LINKS] [--cluster-only]
#     --quick     SmolLM2 only, 1 round (default: SmolLM2 and Qwen2.5-Coder-1.5B, 2 rounds)
#     --models    tools/models.txt names, comma-separated (absent files are skipped)
#     --contexts  prompt tokens, comma-separated (default 512; the prompt is prefilled for real,
#                 one thread per rank: 16384 tokens take tens of minutes on a 1.5B model)
# Writes DIR/dense_split.json and each run's JSON and log (default out/dense_split);
# tools/results.sh renders it (results.md, "Dense split"). $TREEATTN_BUILD: the build
# (default build/release; tools/build.sh builds it).
set -euo pipefail
cd "$(dirname "$0")/../.."
root=$PWD
out=out/dense_split
models=smollm2-135m,qwen2.5-coder-1.5b
contexts=512
rounds=2
new=33
links=""
own_runs=1
while [ $# -gt 0 ]; do
  case $1 in
    --quick) models=smollm2-135m; rounds=1; shift ;;
    --out) out=$2; shift 2 ;;
    --models) models=$2; shift 2 ;;
    --contexts) contexts=$2; shift 2 ;;
    --rounds) rounds=$2; shift 2 ;;
    --cluster) links=$2; shift 2 ;;
    --cluster-only) own_runs=0; shift ;;
    *) echo "dense_split.sh: unknown option '$1'" >&2; exit 2 ;;
  esac
done
build="${TREEATTN_BUILD:-build/release}"
case "$build" in /*) ;; *) build="$root/$build" ;; esac
B=$build/cli/treeattn
[ -x "$B" ] || { echo "dense_split.sh: $B is not built (tools/build.sh)" >&2; exit 2; }
mkdir -p "$out"
out=$(cd "$out" && pwd)
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
# --cluster-only adds its runs to DIR's earlier ones (its own replace theirs).
if [ "$own_runs" = 1 ]; then
  : > "$out/runs.txt"
else
  touch "$out/runs.txt"
  sed -i '/^host_/d' "$out/runs.txt"
fi

# run NAME ARGS...: one generate run, its JSON in NAME.json, listed in runs.txt.
run() {
  local name=$1; shift
  echo "== $name: $B generate $*" >&2
  "$B" generate --engine --quiet --ignore-eos --json "$out/$name.json" "$@" > "$out/$name.log" 2>&1 \
    || { echo "dense_split.sh: $name failed (see $out/$name.log)" >&2; tail -3 "$out/$name.log" >&2; exit 1; }
  echo "$name" >> "$out/runs.txt"
}

for m in ${models//,/ }; do
  [ "$own_runs" = 1 ] || break
  path=$("$root/tools/model-path.sh" "$m" 2>/dev/null) || { echo "dense_split.sh: $m absent, skipped" >&2; continue; }
  for c in ${contexts//,/ }; do
    for r in $(seq 1 "$rounds"); do
      common=(--model "$path" --prompt-tokens "$c" --new-tokens "$new" --threads 1 --hash-logits)
      run "itl_${m}_${c}_1rank_r$r" "${common[@]}" --ranks 1
      run "itl_${m}_${c}_2replicated_r$r" "${common[@]}" --ranks 2 --dense replicated
      run "itl_${m}_${c}_2split_r$r" "${common[@]}" --ranks 2 --dense split
    done
  done
  run "auto_${m}" --model "$path" --prompt-tokens 64 --new-tokens 2 --threads 1 --ranks 2
  for p in 2 4; do
    for mm in exact int8; do
      run "rss_${m}_${p}_${mm}" --model "$path" --prompt-tokens 256 --new-tokens 4 --threads 1 \
        --ranks "$p" --dense split --matmul "$mm"
    done
  done
done

# 2 emulated hosts x 1 rank per link: replicated, split and auto in one cluster session.
cluster=$root/tools/cluster/cluster.sh
for link in ${links//,/ }; do
  preset=emu-veth
  [ "$link" = 1gbit ] && preset=emu-1gbit
  # The preset's links with one rank per host (a preset places its ranks 2 to a node).
  "$B" topo --show "preset:$preset" | sed -n '/^{/,$p' | python3 -c '
import json, sys
t = json.load(sys.stdin)
t["name"], t["ranks_per_node"], t["nodes"] = sys.argv[1] + "-2x1", 1, 2
json.dump(t, open(sys.argv[2], "w"), indent=1)' "$preset" "$out/topo_$link.json"
  up=(up 2 --slots 1)
  [ "$link" != veth ] && up+=(--link "$link")
  "$cluster" down > /dev/null 2>&1 || true
  "$cluster" "${up[@]}" > /dev/null
  for m in ${models//,/ }; do
    path=$("$root/tools/model-path.sh" "$m" 2>/dev/null) || continue
    for c in ${contexts//,/ }; do
      for d in replicated split auto; do
        name="host_${link}_${m}_${c}_${d}"
        echo "== $name" >&2
        "$cluster" run --timeout 3600 -- -x OMP_NUM_THREADS=1 -np 2 "$B" generate --engine \
          --quiet --ignore-eos --model "$path" --prompt-tokens "$c" --new-tokens "$new" \
          --threads 1 --hash-logits --dense "$d" --topology "$out/topo_$link.json" \
          --json "$out/$name.json" > "$out/$name.log" 2>&1 \
          || { echo "dense_split.sh: $name failed (see $out/$name.log)" >&2; continue; }
        echo "$name" >> "$out/runs.txt"
      done
    done
  done
  "$cluster" down > /dev/null
done

python3 - "$out" "$(uptime)" <<'PY'
import json, os, sys
out, load = sys.argv[1], sys.argv[2].strip()
runs = [l.strip() for l in open(os.path.join(out, "runs.txt")) if l.strip()]
doc = {"load": load, "itl": [], "rss": [], "auto": [], "hosts": []}
for name in runs:
    j = json.load(open(os.path.join(out, name + ".json")))
    size = os.path.getsize(j["model"])
    base = {"model": os.path.basename(j["model"]), "ranks": j["ranks"], "dense": j["dense"],
            "matmul": j["matmul"], "isa": j["isa"], "file_bytes": size}
    if name.startswith("itl_"):
        base.update(context=len(j["prompt_tokens"]), round=int(name.rsplit("_r", 1)[1]),
                    itl_p50_ms=j["decode_ms_p50"], decode_ms_per_token=j["decode_ms_per_token"],
                    tokens=j["tokens"], logits_hash=j["logits_hash"],
                    bytes_sent_per_token=j["bytes_sent_per_rank_per_token"],
                    dense_ms=j["decode_dense_ms_by_rank"], attention_ms=j["decode_attention_ms_by_rank"],
                    comm_ms=j["decode_comm_ms_by_rank"])
        doc["itl"].append(base)
    elif name.startswith("host_"):
        base.update(link=name.split("_")[1], context=len(j["prompt_tokens"]),
                    itl_p50_ms=j["decode_ms_p50"], tokens=j["tokens"], logits_hash=j["logits_hash"],
                    dense_requested=j["dense_requested"], dense_ms=j["decode_dense_ms_by_rank"],
                    comm_ms=j["decode_comm_ms_by_rank"],
                    predicted_split_us=j["dense_predicted_split_us"],
                    predicted_replicated_us=j["dense_predicted_replicated_us"])
        doc["hosts"].append(base)
    elif name.startswith("rss_"):
        base.update(weights_resident_bytes_by_rank=j["weights_resident_bytes_by_rank"],
                    weight_bytes_rank0=j["weight_bytes_rank0"], rows8_bytes_rank0=j["rows8_bytes_rank0"])
        doc["rss"].append(base)
    else:
        base.update(how=j["dense_how"], predicted_split_us=j["dense_predicted_split_us"],
                    predicted_replicated_us=j["dense_predicted_replicated_us"])
        doc["auto"].append(base)
json.dump(doc, open(os.path.join(out, "dense_split.json"), "w"), indent=1)
print("dense_split.sh: wrote %s/dense_split.json" % out, file=sys.stderr)
PY
