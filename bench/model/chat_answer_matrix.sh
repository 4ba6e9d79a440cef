#!/usr/bin/env bash
# The chat question on every generate path x KV cache type x rank count, one line each: whether a
# model's answer survives the float rounding that differs between them (a near tie does not).
#   bench/model/chat_answer_matrix.sh [MODEL] [generate flags, e.g. --matmul int8-ffn]
# MODEL: a known name or a file (default smollm2-135m). Not part of the test suite.
set -uo pipefail
cd "$(dirname "$0")/../.."
B=build/release/cli/treeattn
model="${1:-smollm2-135m}"; shift || true
for path in engine session; do
  for kv in f16 f32 bf16; do
    for r in 1 2 4; do
      flags=(--model "$model" --chat --prompt "What is the capital of France?" --new-tokens 8
             --ranks "$r" --kv-dtype "$kv" "$@")
      [ "$path" = session ] && flags+=(--session)
      answer="$("$B" generate "${flags[@]}" 2>/dev/null | head -c 40 | tr '\n' ' ')"
      printf '%-8s %-5s ranks %d: %s\n' "$path" "$kv" "$r" "$answer"
    done
  done
done
