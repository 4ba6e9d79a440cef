#!/usr/bin/env bash
# treeattn against llama.cpp on every shipped model (bench/model/vs_llamacpp.py, one process each,
# the same GGUF, prompt ids and threads, flash attention on, alternating): prefill of a 512-token
# prompt and decode after it for each model in its default matmul mode (tools/models.txt's
# matmul= column, else int8), and SmolLM2's decode at a 16k context. Gemma-3 runs treeattn's
# engine path (its sliding-window layers), the others `generate --session`. The kernel-issue targets:
# prefill of 512 >= 2x llama.cpp for every model, SmolLM2 decode at 16k >= 3x.
#
#   bench/model/vs_llamacpp_models.sh [--threads T] [--repeats N] [--models LIST] [--out DIR]
#     --threads   threads of both sides, prefill and decode (default: all cores)
#     --repeats   alternating runs per figure, the median shown (default 3)
#     --models    tools/models.txt names, comma-separated (default: every model; absent files skipped)
# Writes DIR/models.json (default out/vs_llamacpp_models); tools/results.sh renders it
# (results.md, "llama.cpp by model"). Needs build/llama-server/bin/llama-server
# (tools/build-llama-server.sh) and $TREEATTN_BUILD's treeattn (default build/release).
set -euo pipefail
cd "$(dirname "$0")/../.."
root=$PWD
out=out/vs_llamacpp_models
threads=$(nproc)
repeats=3
models=$(awk '$1 == "model" {print $2}' tools/models.txt | paste -sd,)
while [ $# -gt 0 ]; do
  case $1 in
    --threads) threads=$2; shift 2 ;;
    --repeats) repeats=$2; shift 2 ;;
    --models) models=$2; shift 2 ;;
    --out) out=$2; shift 2 ;;
    *) echo "vs_llamacpp_models.sh: unknown option '$1'" >&2; exit 2 ;;
  esac
done
build="${TREEATTN_BUILD:-build/release}"
case "$build" in /*) ;; *) build="$root/$build" ;; esac
B=$build/cli/treeattn
server=$root/build/llama-server/bin/llama-server
[ -x "$B" ] || { echo "vs_llamacpp_models.sh: $B is not built (tools/build.sh)" >&2; exit 2; }
[ -x "$server" ] || { echo "vs_llamacpp_models.sh: $server is not built (tools/build-llama-server.sh)" >&2; exit 2; }
py=$("$root/tools/ref-venv.sh")  # numpy and gguf for vs_llamacpp.py
mkdir -p "$out"
out=$(cd "$out" && pwd)
: > "$out/runs.txt"
for m in ${models//,/ }; do
  path=$("$root/tools/model-path.sh" "$m" 2>/dev/null) || { echo "vs_llamacpp_models.sh: $m absent, skipped" >&2; continue; }
  mode=$(awk -v m="$m" '$1 == "model" && $2 == m {for (i = 6; i <= NF; i++) if ($i ~ /^matmul=/) print substr($i, 8)}' tools/models.txt)
  contexts=512
  [ "$m" = smollm2-135m ] && contexts=512,16384
  path_flag=()  # generate --session, the cache filled synthetically above 4k (decode reads it alike)
  case $m in gemma*) path_flag=(--engine) ;; esac  # sliding windows: the engine path
  echo "== $m ($path), matmul ${mode:-int8}, contexts $contexts, $threads thread(s)" >&2
  "$py" bench/model/vs_llamacpp.py --treeattn "$B" --model "$path" --threads "$threads" \
    --contexts "$contexts" --repeats "$repeats" --matmul "${mode:-int8}" --llama-server "$server" \
    "${path_flag[@]}" --json "$out/$m.json" | tee "$out/$m.log" >&2
  echo "$m" >> "$out/runs.txt"
done
"$py" - "$out" "$(uptime)" "$threads" <<'PY'
import json, os, sys
out, load, threads = sys.argv[1], sys.argv[2].strip(), int(sys.argv[3])
doc = {"load": load, "threads": threads, "models": []}
for name in (l.strip() for l in open(os.path.join(out, "runs.txt")) if l.strip()):
    j = json.load(open(os.path.join(out, name + ".json")))
    doc["models"].append({"name": name, **j})
json.dump(doc, open(os.path.join(out, "models.json"), "w"), indent=1)
print("vs_llamacpp_models.sh: wrote %s/models.json" % out, file=sys.stderr)
PY
