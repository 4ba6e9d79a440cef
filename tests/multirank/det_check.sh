#!/usr/bin/env bash
# Runs the tree-det program (det_main.cpp) at 1, 2, 3, 4, 5, 7 and 8 ranks and requires the same
# output hash for every case at every rank count. Usage: det_check.sh MPIEXEC PROGRAM [MPIFLAGS...]
set -euo pipefail
mpiexec=$1; prog=$2; shift 2
ref=""
for np in 1 2 3 4 5 7 8; do
  out=$("$mpiexec" -np "$np" "$@" "$prog" | grep '^case ' | sort) || { echo "FAILED at $np ranks"; exit 1; }
  echo "== $np ranks"; echo "$out"
  if [ -z "$ref" ]; then ref=$out; continue; fi
  if [ "$out" != "$ref" ]; then
    echo "FAILED: the hashes at $np ranks differ from those at 1 rank"
    diff <(echo "$ref") <(echo "$out") || true
    exit 1
  fi
done
echo "PASSED: identical output hashes at 1, 2, 3, 4, 5, 7 and 8 ranks"
