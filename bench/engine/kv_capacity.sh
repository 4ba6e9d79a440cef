#!/usr/bin/env bash
# KV memory under load, the serving engine's side of it (issue targets of pages on demand and
# quantized KV pages), in one script:
#   1. `treeattn serve --ranks 2 --context 32768 --kv-memory 1440M` (a pool of 65,536 tokens of
#      SmolLM2's f16 KV per rank) and bench/serve/capacity.py: 8 concurrent chat requests of
#      ~1k-token prompts without max_tokens; how many run at once, KV usage, all finished.
#   2. treeattn_engine_bench kv-dtype: f16, int8 and fp8 KV pages at equal memory (2 GiB per
#      rank), 2 ranks: the longest sequence the pools hold, the decode inter-token latency at a
#      --context-token prompt (best of 2 rounds), tokens and first logits against f16's.
#
#   bench/engine/kv_capacity.sh [--quick] [--out DIR]
#     --quick   a 4096-token context for part 2 (default 16384)
# Writes DIR/capacity.json and DIR/kv_dtype.log (default out/kv_capacity); tools/results.sh
# renders them (results.md, "KV capacity"). Needs the built tree (tools/build.sh) and the model.
set -euo pipefail
cd "$(dirname "$0")/../.."
root=$PWD
out=out/kv_capacity
context=16384
while [ $# -gt 0 ]; do
  case $1 in
    --quick) context=4096; shift ;;
    --out) out=$2; shift 2 ;;
    *) echo "kv_capacity.sh: unknown option '$1'" >&2; exit 2 ;;
  esac
done
B=$root/build/release/cli/treeattn
bench=$root/build/release/bench/treeattn_engine_bench
for x in "$B" "$bench"; do
  [ -x "$x" ] || { echo "kv_capacity.sh: $x is not built (tools/build.sh)" >&2; exit 2; }
done
model=$("$root/tools/model-path.sh") || { echo "kv_capacity.sh: no model (tools/fetch-model.sh)" >&2; exit 2; }
mkdir -p "$out"
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1

port=$((18700 + $$ % 200))
"$B" serve --model "$model" --ranks 2 --port "$port" --context 32768 --kv-memory 1440M \
  > "$out/serve.log" 2>&1 &
spid=$!
trap 'kill -TERM "$spid" 2>/dev/null || true' EXIT
for _ in $(seq 1 240); do
  curl -sf "http://127.0.0.1:$port/health" > /dev/null 2>&1 && break
  kill -0 "$spid" 2>/dev/null || { echo "kv_capacity.sh: serve exited (see $out/serve.log)" >&2; exit 1; }
  sleep 0.5
done
python3 bench/serve/capacity.py --url "http://127.0.0.1:$port" --clients 8 --json "$out/capacity.json"
kill -TERM "$spid" 2>/dev/null || true
wait "$spid" 2>/dev/null || true
trap - EXIT

mpirun --allow-run-as-root --oversubscribe --bind-to none --mca mpi_yield_when_idle 1 -np 2 \
  "$bench" --model "$model" --kv-gib 2 kv-dtype --context "$context" --new 48 --rounds 2 \
  | tee "$out/kv_dtype.log"
