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
#      --matmul exact (no rows8 copy), int8 (with it) and int8 --no-rows8, against 1/p of the file.
#
#   3. With --cluster LINKS (root: tools/cluster), 2 emulated hosts x 1 rank over each link
#      (10gbit, 1gbit, veth = unshaped): 2 ranks replicated, split and auto in turn, one cluster
#      session per link, auto planning on the link's preset with one rank per host (emu-veth's
#      numbers for 10gbit and veth, emu-1gbit's for 1gbit), its prediction beside the figures.
#      Where tools/build-llama-server.sh built rpc-server, llama.cpp's multi-host mode on the same
#      two hosts and request (llama_rpc_itl.py: llama-server on host 0 holding the first half of
#      the layers and the head, rpc-server on host 1 the second half, one thread each, the same
#      prompt ids, flash attention, f16 KV) after treeattn's runs.
#
#   bench/engine/dense_split.sh [--quick] [--out DIR] [--models LIST] [--contexts LIST]
#                               [--rounds N] [--cluster LINKS] [--cluster-only] [--add] [--no-llama]
#     --quick     SmolLM2 only, 1 round (default: SmolLM2 and Qwen2.5-Coder-1.5B, 2 rounds)
#     --models    tools/models.txt names, comma-separated (absent files are skipped)
#     --contexts  prompt tokens, comma-separated (default 512; the prompt is prefilled for real,
#                 one thread per rank: 16384 tokens take tens of minutes on a 1.5B model)
#     --no-llama  no llama.cpp runs on the emulated hosts
#     --add       keep DIR's earlier runs, a run of the same name replacing its earlier one
#                 (--cluster-only implies it): a longer context or another link added to a table
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
keep=0
llama=1
while [ $# -gt 0 ]; do
  case $1 in
    --quick) models=smollm2-135m; rounds=1; shift ;;
    --out) out=$2; shift 2 ;;
    --models) models=$2; shift 2 ;;
    --contexts) contexts=$2; shift 2 ;;
    --rounds) rounds=$2; shift 2 ;;
    --cluster) links=$2; shift 2 ;;
    --cluster-only) own_runs=0; keep=1; shift ;;
    --add) keep=1; shift ;;
    --no-llama) llama=0; shift ;;
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
# --add and --cluster-only add their runs to DIR's earlier ones (their own replace those).
if [ "$keep" = 1 ]; then touch "$out/runs.txt"; else : > "$out/runs.txt"; fi

# unlisted NAME: NAME is not in the table; listed NAME: its run is, once.
unlisted() {
  grep -vxF -- "$1" "$out/runs.txt" > "$out/runs.txt.new" || true
  mv "$out/runs.txt.new" "$out/runs.txt"
}
listed() { unlisted "$1"; echo "$1" >> "$out/runs.txt"; }

# run NAME ARGS...: one generate run, its JSON in NAME.json, listed in runs.txt.
run() {
  local name=$1; shift
  echo "== $name: $B generate $*" >&2
  "$B" generate --engine --quiet --ignore-eos --json "$out/$name.json" "$@" > "$out/$name.log" 2>&1 \
    || { echo "dense_split.sh: $name failed (see $out/$name.log)" >&2; tail -3 "$out/$name.log" >&2; exit 1; }
  listed "$name"
}

if [ "$own_runs" = 1 ]; then
  for m in ${models//,/ }; do
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
      for mm in exact int8 int8-norows8; do
        flags=(--matmul "${mm%-norows8}")
        [ "$mm" = int8-norows8 ] && flags+=(--no-rows8)
        run "rss_${m}_${p}_${mm}" --model "$path" --prompt-tokens 256 --new-tokens 4 --threads 1 \
          --ranks "$p" --dense split "${flags[@]}"
      done
    done
  done
fi

# 2 emulated hosts x 1 rank per link: replicated, split and auto in one cluster session.
cluster=$root/tools/cluster/cluster.sh
lbin=$root/build/llama-server/bin
if [ "$llama" = 1 ] && [ -n "$links" ] && ! [ -x "$lbin/rpc-server" ]; then
  echo "dense_split.sh: $lbin/rpc-server is not built (tools/build-llama-server.sh): no llama.cpp runs" >&2
  llama=0
fi

# llama_rpc LINK MODEL PATH CONTEXT: llama.cpp's multi-host mode on the running cluster, the
# prompt ids of treeattn's replicated run, half the repeating layers on host 1's rpc-server.
[ "$llama" = 1 ] && [ -n "$links" ] && py=$("$root/tools/ref-venv.sh")  # gguf for llama_rpc_itl.py
llama_rpc() {
  local link=$1 m=$2 path=$3 c=$4 name rpc_pid
  name="host_${link}_${m}_${c}_llamarpc"
  echo "== $name (llama-server --rpc, half the layers on host 1)" >&2
  "$cluster" exec treeattn-h1 -- "$lbin/rpc-server" -H 10.213.0.2 -p 50052 -t 1 \
    > "$out/$name.rpc.log" 2>&1 &
  rpc_pid=$!
  sleep 2
  if "$cluster" exec treeattn-h0 -- "$py" "$root/bench/engine/llama_rpc_itl.py" \
       --llama-server "$lbin/llama-server" --model "$path" --rpc 10.213.0.2:50052 \
       --ids "$out/host_${link}_${m}_${c}_replicated.json" --steps "$new" --threads 1 \
       --json "$out/$name.json" >&2; then
    listed "$name"
  else
    echo "dense_split.sh: $name failed (see $out/$name.json.log)" >&2
    unlisted "$name"
  fi
  kill "$rpc_pid" 2> /dev/null || true  # cluster.sh exec execs into rpc-server: the same pid
  wait "$rpc_pid" 2> /dev/null || true
}
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
          || { echo "dense_split.sh: $name failed (see $out/$name.log)" >&2; unlisted "$name"; continue; }
        listed "$name"
      done
      [ "$llama" = 1 ] && [ -f "$out/host_${link}_${m}_${c}_replicated.json" ] &&
        llama_rpc "$link" "$m" "$path" "$c"
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
    if name.endswith("_llamarpc"):
        _, link, rest = name.split("_", 2)
        doc.setdefault("llama_rpc", []).append(dict(j, link=link, context=j["prompt_tokens"]))
        continue
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
