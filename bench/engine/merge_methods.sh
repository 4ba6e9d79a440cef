#!/usr/bin/env bash
# The served path's merge, method by method, on emulated hosts (tools/cluster): for each setting
# (hosts x ranks per host, link), the per-layer merge alone at B = 1, 4, 16 decode rows, and the
# decode inter-token latency of the serving engine for one long request and for 16 concurrent
# ones, for each of --methods (tree, hier, allgather, auto by default). Every method of a setting
# runs in the same cluster session, back to back, so the ratios between them are of one run.
#
#   bench/engine/merge_methods.sh [--quick] [--long N] [--out DIR] [--append]
#                                 [--methods tree,hier,allgather,auto]
#
# Writes DIR/merge_methods.json (every point) and prints a table with, per setting and case,
# auto's latency against the best measured method, and the 2-host 1 Gbit ITL against 4 ranks on
# one host. Needs root (network namespaces), the built tree (tools/build.sh) and the model
# (tools/fetch-model.sh). --long N: the single request's context (default 32768); --quick: 4096
# and 256-token prompts, fewer tokens. --append: add this run to DIR's earlier ones (the tables
# take each method's best round: run-to-run noise on shared cores is larger than the merges'
# differences).
set -euo pipefail
cd "$(dirname "$0")/../.."
root=$PWD
out=out/merge_methods
methods=tree,hier,allgather,auto
long=32768 short=512 new=32 append=0
while [ $# -gt 0 ]; do
  case $1 in
    --quick) long=4096 short=256 new=16; shift ;;
    --out) out=$2; shift 2 ;;
    --long) long=$2; shift 2 ;;
    --append) append=1; shift ;;
    --methods) methods=$2; shift 2 ;;
    *) echo "merge_methods.sh: unknown option '$1'" >&2; exit 2 ;;
  esac
done
bench=$root/build/release/bench/treeattn_engine_bench
[ -x "$bench" ] || { echo "merge_methods.sh: $bench is not built (tools/build.sh)" >&2; exit 2; }
model=$("$root/tools/model-path.sh") || { echo "merge_methods.sh: no model (tools/fetch-model.sh)" >&2; exit 2; }
mkdir -p "$out"
log=$out/merge_methods.log
[ "$append" = 1 ] || : > "$log"
cluster=$root/tools/cluster/cluster.sh
common=(--model "$model" --threads 1 --kv-gib 1)

# run SETTING HOSTS SLOTS LINK: every method's merge-alone and throughput points, one session.
run_setting() {
  local name=$1 hosts=$2 slots=$3 link=$4
  local np=$((hosts * slots))
  local -a launch
  if [ "$hosts" -eq 1 ]; then
    launch=(mpirun --allow-run-as-root --oversubscribe --bind-to none --mca mpi_yield_when_idle 1
            -x OMP_NUM_THREADS=1 -np "$np")
  else
    local -a up=(up "$hosts" --slots "$slots")
    [ "$link" != veth ] && up+=(--link "$link")
    "$cluster" down > /dev/null 2>&1 || true
    "$cluster" "${up[@]}" > /dev/null
    launch=("$cluster" run --timeout 1800 -- -x OMP_NUM_THREADS=1 -np "$np")
  fi
  echo "== $name: $hosts host(s) x $slots rank(s), link $link ==" | tee -a "$log"
  # One point: its lines tagged with the setting; a failed point is logged and the rest go on.
  point() {
    if ! OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 "${launch[@]}" "$@" \
         > "$out/point.log" 2>&1; then
      echo "FAILED ($name): $*" | tee -a "$log"
      tail -5 "$out/point.log" | tee -a "$log"
    fi
    sed -e "s/^MERGE {/MERGE {\"setting\": \"$name\", /" \
        -e "s/^RESULT {/RESULT {\"setting\": \"$name\", /" "$out/point.log" | tee -a "$log"
  }
  point "$bench" merge
  local m
  for m in ${methods//,/ }; do
    point "$bench" "${common[@]}" --merge "$m" throughput --context "$long" --concurrency 1 \
      --new "$new"
    point "$bench" "${common[@]}" --merge "$m" throughput --context "$short" --concurrency 16 \
      --new "$new"
  done
  [ "$hosts" -gt 1 ] && "$cluster" down > /dev/null
  return 0
}

run_setting "1x4 local" 1 4 none
run_setting "2x2 1gbit" 2 2 1gbit
run_setting "4x1 1gbit" 4 1 1gbit
run_setting "2x2 veth" 2 2 veth
run_setting "4x1 veth" 4 1 veth

python3 - "$log" "$out/merge_methods.json" <<'EOF'
import json, sys
rows, merges = [], []
for line in open(sys.argv[1]):
    if line.startswith("RESULT "): rows.append(json.loads(line[7:]))
    if line.startswith("MERGE "): merges.append(json.loads(line[6:]))
json.dump({"decode": rows, "merge_alone": merges}, open(sys.argv[2], "w"), indent=1)
EOF
# The table tools/results.sh puts in docs/results.md (each method's best round).
python3 "$root/tools/results_render.py" --work "$out" --only merge_methods
