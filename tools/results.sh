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
  if ! [ -x "$server" ]; then
    skip vsllamacpp "llama-server not built (tools/build-llama-server.sh)"
  elif ! ref_py="$(tools/ref-venv.sh)"; then
    skip vsllamacpp "no reference venv (tools/ref-venv.sh failed)"
  else
    step vsllamacpp "$ref_py" bench/model/vs_llamacpp.py --treeattn "$B" --model "$model" \
      --threads 1 --contexts "$contexts" --repeats 1 --llama-server "$server" \
      --json "$work/vsllamacpp.json"
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

# from_run NAME SCRIPT CAN WHY FILE[:AS]...: a benchmark with a runner of its own. Full mode runs
# SCRIPT --out into the work directory where CAN is 1; otherwise (--quick, or a run it cannot make
# here) the last run in out/NAME is taken when there is one (its first FILE), and the status says
# so; else the section is skipped with WHY. Each FILE is copied to the work directory (as AS).
from_run() {
  local name=$1 script=$2 can=$3 why=$4 dir f
  shift 4
  if [ "$quick" = 0 ] && [ "$can" = 1 ]; then
    dir="$work/${name}_run"
    step "$name" "$script" --out "$dir"
  elif [ -f "out/$name/${1%%:*}" ]; then
    dir="out/$name"
    echo "$name from out/$name ($script)" >> "$status"
  else
    skip "$name" "$why"
    return 0
  fi
  for f in "$@"; do cp "$dir/${f%%:*}" "$work/${f#*:}" 2>/dev/null || true; done
}
is_root=$([ "$(id -u)" = 0 ] && echo 1 || echo 0)
has_llama=$([ -x "$root/build/llama-server/bin/llama-server" ] && echo 1 || echo 0)

# The served merge, method by method, on emulated hosts (root: network namespaces).
from_run merge_methods bench/engine/merge_methods.sh "$is_root" \
  "--quick without an earlier bench/engine/merge_methods.sh run (needs root)" merge_methods.json
# KV capacity: a server under 8 long chats, then the KV page types.
from_run kv_capacity bench/engine/kv_capacity.sh 1 \
  "--quick without an earlier bench/engine/kv_capacity.sh run" capacity.json kv_dtype.log
# Every shipped model against llama.cpp, where llama-server is built.
from_run vs_llamacpp_models bench/model/vs_llamacpp_models.sh "$has_llama" \
  "no earlier bench/model/vs_llamacpp_models.sh run and llama-server not built" \
  models.json:vs_llamacpp_models.json
# The dense layers split over the ranks: generate at 1 rank and 2 ranks replicated and split,
# resident weights at 2 and 4 ranks.
from_run dense_split bench/engine/dense_split.sh 1 \
  "--quick without an earlier bench/engine/dense_split.sh run" dense_split.json
# Window pages: Gemma-3-270M at a 32k context, with and without.
from_run window_pages bench/engine/window_pages.sh 1 \
  "--quick without an earlier bench/engine/window_pages.sh run" window.json all.json

mode=$([ "$quick" = 1 ] && echo quick || echo full)
if ! python3 tools/results_render.py --work "$work" --build "$build" --mode "$mode" --out "$out"; then
  echo "results.sh: rendering $out failed (tools/results_render.py above)" >&2
  exit 1
fi
echo "results.sh: wrote $out" >&2
