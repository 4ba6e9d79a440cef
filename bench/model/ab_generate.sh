#!/bin/bash
# Two treeattn binaries' decode steps, alternating, on the same file and threads: each round runs
# `generate --engine` with a 64-token prompt and 33 new tokens with binary A, then B, and prints
# the median and the fastest decode step of each (the machine is shared: compare within a round).
#   bench/model/ab_generate.sh BINARY_A BINARY_B MODEL THREADS ROUNDS
# e.g. copy build/release/cli/treeattn to /tmp before and after a change and pass the two copies.
set -euo pipefail
A=$1 B=$2 M=$3 T=$4 R=$5
out=$(mktemp)
trap 'rm -f "$out"' EXIT
for _ in $(seq "$R"); do
  for b in "$A" "$B"; do
    "$b" generate --model "$M" --prompt-tokens 64 --new-tokens 33 --ignore-eos --quiet \
      --threads "$T" --json "$out" --matmul int8 --engine >/dev/null 2>&1
    python3 -c "
import json, statistics, sys
d = json.load(open(sys.argv[1]))['decode_ms']
print('%-40s median %.1f ms  min %.1f' % (sys.argv[2], statistics.median(d), min(d)))" "$out" "$b"
  done
done
