#!/usr/bin/env bash
# Runs the benchmarks behind the headline tables and writes docs/results.md from their JSON.
#   tools/results.sh [--quick] [--out FILE] [--keep DIR]
#     --quick    small sizes: a few minutes in all
#     --out      where to write (default docs/results.md)
#     --keep     keep every benchmark's JSON and log in DIR (default: a temporary folder)
# The build is $TREEATTN_BUILD (default build/release; tools/build.sh builds it). A benchmark
# whose binary, model or peer is missing is listed as not run, with the reason; the others run.
# What each section measures and how: docs/performance.md.
set -uo pipefail
cd "$(dirname "$0")/.."
root=$PWD
quick=0
out=docs/results.md
keep=""
while [ $# -gt 0 ]; do
  case "$1" in
    --quick) quick=1 ;;
    --out) out="$2"; shift ;;
    --keep) keep="$2"; shift ;;
    -h|--help) sed -n '2,8p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
    *) echo "results.sh: unknown argument '$1' (see --help)" >&2; exit 2 ;;
  esac
  shift
done
build="${TREEATTN_BUILD:-build/release}"
case "$build" in /*) ;; *) build="$root/$build" ;; esac
B="$build/cli/treeattn"
if [ ! -x "$B" ]; then
  echo "results.sh: $B not found; build it first (tools/build.sh) or set TREEATTN_BUILD" >&2
  exit 2
fi
if [ -n "$keep" ]; then mkdir -p "$keep"; work="$(cd "$keep" && pwd)"; else
  work="$(mktemp -d)"; trap 'rm -rf "$work"' EXIT; fi
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
status="$work/status.txt"
: > "$status"

# step NAME COMMAND...: runs one benchmark, its output in NAME.log, its result in status.txt.
step() {
  local name="$1"; shift
  echo "== $name: $*" >&2
  if "$@" > "$work/$name.log" 2>&1; then echo "$name ok" >> "$status"
  else echo "$name failed (exit $?; last lines of its log below)" >> "$status"
    tail -5 "$work/$name.log" | sed 's/^/    /' >> "$status"; fi
}
skip() { echo "$1 not run: $2" >> "$status"; echo "== $1 not run: $2" >&2; }

if [ "$quick" = 1 ]; then
  step main "$B" run --ranks 2 --seq 32k --warmup 1 --steps 3 --json "$work/main.json"
  step kernel "$B" bench --kernel --seq 64k --dtype bf16,f16 --repeats 2 --threads 1 --no-peer \
    --json "$work/kernel.json"
  step treering "$B" bench --ranks 2 --seq 16k,64k --methods tree,tree-paper,ring-kv,allgather,single \
    --warmup 1 --iters 3 --json "$work/treering.json"
  contexts="512"
  validate=(--cluster 1x2 --link none --seq-list 8k --warmup 1 --iters 3)
  load=(--workload a --concurrency 1,2 --requests-per-client 1 --prompt-tokens 128 --max-tokens 16)
else
  step main "$B" run --json "$work/main.json"
  step kernel "$B" bench --kernel --kernel-cases --dtype f32,bf16,f16,fp8,int8 --repeats 7 \
    --json "$work/kernel.json"
  step treering "$B" bench --ranks 4 --seq 64k,256k,1M --methods all --warmup 1 --iters 5 \
    --json "$work/treering.json"
  contexts="512,4096,16384"
  validate=(--cluster 1x2,1x4 --link none)
  if ip netns add "treeattn-results-$$" 2>/dev/null; then
    ip netns del "treeattn-results-$$"; validate=()  # every configuration, emulated hosts too
  fi
  load=(--workload a,b --concurrency 1,4,16 --requests-per-client 1 --doc-tokens 2000 --questions 8)
fi
step sweep "$B" plan --sweep --json "$work/sweep.json"
step validate "$B" plan --validate "${validate[@]}" --json "$work/validate.json"

# The model: decode and prefill of the default file, against llama.cpp where it was built.
model="$(tools/model-path.sh smollm2-135m 2>/dev/null || true)"
if ! "$B" generate --help > /dev/null 2>&1; then
  skip model "this build has no generate (tools/build.sh builds it)"
elif [ -z "$model" ] || [ ! -f "$model" ]; then
  skip model "no model file (tools/fetch-model.sh smollm2-135m)"
else
  i=0
  for ctx in ${contexts//,/ }; do
    step "model_$ctx" "$B" generate --model "$model" --prompt-tokens "$ctx" --new-tokens 17 \
      --ignore-eos --quiet --threads 1 --json "$work/model_$ctx.json"
    i=$((i + 1))
  done
  server="$build/../llama-server/bin/llama-server"
  [ -x "$server" ] || server="$root/build/llama-server/bin/llama-server"
  if [ -x "$server" ]; then
    step vsllamacpp "$(tools/ref-venv.sh)" bench/model/vs_llamacpp.py --treeattn "$B" --model "$model" \
      --threads 1 --contexts "$contexts" --repeats 1 --llama-server "$server" \
      --json "$work/vsllamacpp.json"
  else
    skip vsllamacpp "llama-server not built (tools/build-llama-server.sh)"
  fi
  venv_py="$root/build/serve-venv/bin/python"
  if [ -x "$venv_py" ]; then
    port=$((18600 + $$ % 300))
    "$B" serve --model "$model" --ranks 2 --port "$port" > "$work/serve.log" 2>&1 &
    spid=$!
    for _ in $(seq 1 240); do
      curl -sf "http://127.0.0.1:$port/health" > /dev/null 2>&1 && break
      kill -0 "$spid" 2>/dev/null || break
      sleep 0.5
    done
    step load "$venv_py" bench/serve/loadgen.py --target "treeattn=http://127.0.0.1:$port" \
      "${load[@]}" --json "$work/load.json"
    kill -TERM "$spid" 2>/dev/null; wait "$spid" 2>/dev/null
  else
    skip load "no build/serve-venv (tools/serve-venv.sh)"
  fi
fi

# The served merge, method by method, on emulated hosts (root: network namespaces). Full mode
# runs it; --quick takes the last run of bench/engine/merge_methods.sh (out/merge_methods) when
# there is one, and says so.
if [ "$quick" = 0 ] && [ "$(id -u)" = 0 ]; then
  step merge_methods bench/engine/merge_methods.sh --out "$work/merge_methods_run"
  cp "$work/merge_methods_run/merge_methods.json" "$work/merge_methods.json" 2>/dev/null
elif [ -f out/merge_methods/merge_methods.json ]; then
  cp out/merge_methods/merge_methods.json "$work/merge_methods.json"
  echo "merge_methods from out/merge_methods/merge_methods.json (bench/engine/merge_methods.sh)" >> "$status"
else
  skip merge_methods "--quick without an earlier bench/engine/merge_methods.sh run (needs root)"
fi

# KV capacity (bench/engine/kv_capacity.sh: a server under 8 long chats, then the KV page types).
# Full mode runs it; --quick takes the last run (out/kv_capacity) when there is one.
if [ "$quick" = 0 ]; then
  step kv_capacity bench/engine/kv_capacity.sh --out "$work/kv_capacity_run"
  cp "$work/kv_capacity_run/capacity.json" "$work/kv_capacity_run/kv_dtype.log" "$work/" 2>/dev/null
elif [ -f out/kv_capacity/capacity.json ]; then
  cp out/kv_capacity/capacity.json out/kv_capacity/kv_dtype.log "$work/" 2>/dev/null
  echo "kv_capacity from out/kv_capacity (bench/engine/kv_capacity.sh)" >> "$status"
else
  skip kv_capacity "--quick without an earlier bench/engine/kv_capacity.sh run"
fi

# Every shipped model against llama.cpp (bench/model/vs_llamacpp_models.sh). Full mode runs it
# where llama-server is built; --quick takes the last run (out/vs_llamacpp_models) when there is one.
if [ "$quick" = 0 ] && [ -x "$root/build/llama-server/bin/llama-server" ]; then
  step vs_llamacpp_models bench/model/vs_llamacpp_models.sh --out "$work/vs_llamacpp_models_run"
  cp "$work/vs_llamacpp_models_run/models.json" "$work/vs_llamacpp_models.json" 2>/dev/null
elif [ -f out/vs_llamacpp_models/models.json ]; then
  cp out/vs_llamacpp_models/models.json "$work/vs_llamacpp_models.json"
  echo "vs_llamacpp_models from out/vs_llamacpp_models (bench/model/vs_llamacpp_models.sh)" >> "$status"
else
  skip vs_llamacpp_models "no earlier bench/model/vs_llamacpp_models.sh run and llama-server not built"
fi

# The dense layers split over the ranks (bench/engine/dense_split.sh: generate at 1 rank and 2
# ranks replicated and split, resident weights at 2 and 4 ranks). Full mode runs it; --quick
# takes the last run (out/dense_split) when there is one.
if [ "$quick" = 0 ]; then
  step dense_split bench/engine/dense_split.sh --out "$work/dense_split_run"
  cp "$work/dense_split_run/dense_split.json" "$work/" 2>/dev/null
elif [ -f out/dense_split/dense_split.json ]; then
  cp out/dense_split/dense_split.json "$work/"
  echo "dense_split from out/dense_split (bench/engine/dense_split.sh)" >> "$status"
else
  skip dense_split "--quick without an earlier bench/engine/dense_split.sh run"
fi

# Window pages (bench/engine/window_pages.sh: Gemma-3-270M at a 32k context, with and without).
# Full mode runs it; --quick takes the last run (out/window_pages) when there is one.
if [ "$quick" = 0 ]; then
  step window_pages bench/engine/window_pages.sh --out "$work/window_pages_run"
  cp "$work/window_pages_run/window.json" "$work/window_pages_run/all.json" "$work/" 2>/dev/null
elif [ -f out/window_pages/window.json ]; then
  cp out/window_pages/window.json out/window_pages/all.json "$work/" 2>/dev/null
  echo "window_pages from out/window_pages (bench/engine/window_pages.sh)" >> "$status"
else
  skip window_pages "--quick without an earlier bench/engine/window_pages.sh run"
fi

mode=$([ "$quick" = 1 ] && echo quick || echo full)
if ! python3 tools/results_render.py --work "$work" --build "$build" --mode "$mode" --out "$out"; then
  echo "results.sh: rendering $out failed (tools/results_render.py above)" >&2
  exit 1
fi
echo "results.sh: wrote $out" >&2
