#!/usr/bin/env bash
# The serving page's first block, run with a free port: start `treeattn serve --ranks 2`, wait
# for /health, ask one chat completion and read /metrics, then stop the server with SIGTERM.
# Usage: serve_smoke.sh /path/to/treeattn
set -euo pipefail
b="$1"
port=$((19000 + $$ % 500))
log="$(mktemp)"
"$b" serve --ranks 2 --port "$port" > "$log" 2>&1 &
pid=$!
trap 'kill -TERM "$pid" 2>/dev/null || true; wait "$pid" 2>/dev/null || true; rm -f "$log"' EXIT
for _ in $(seq 1 240); do
  curl -sf "http://127.0.0.1:$port/health" > /dev/null 2>&1 && break
  if ! kill -0 "$pid" 2>/dev/null; then cat "$log"; exit 1; fi
  sleep 0.5
done
# Whole responses first: grep -q closing the pipe early would fail curl (exit 23).
answer=$(curl -sf "http://127.0.0.1:$port/v1/chat/completions" -H 'Content-Type: application/json' \
  -d '{"model":"smollm2","messages":[{"role":"user","content":"What is the capital of France?"}],"max_tokens":8}')
grep -q '"choices"' <<< "$answer"
metrics=$(curl -sf "http://127.0.0.1:$port/metrics")
grep -q treeattn_kv_pages <<< "$metrics"
