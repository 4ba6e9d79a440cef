#!/usr/bin/env bash
# Builds llama.cpp's llama-server from the llama.cpp source that the llama-cpp-python package on
# PyPI vendors (vendor/llama.cpp in its source distribution), for bench/serve/loadgen.py's
# comparison on the same GGUF. Result: build/llama-server/bin/llama-server and its multi-host
# worker build/llama-server/bin/rpc-server (GGML_RPC on: llama-server --rpc HOST:PORT puts layers
# on rpc-servers; bench/engine/dense_split.sh --cluster), and the version it was built from in
# build/llama-server/VERSION. Takes a long time on few cores (the whole of
# ggml and llama.cpp: about half an hour on 2 cores).
#
# Usage: tools/build-llama-server.sh [--version X.Y.Z] [--jobs N] [--isa native|avx2|avxvnni]
#   --version   the llama-cpp-python release (default: the newest on PyPI)
#   --jobs      parallel compile jobs (default: nproc)
#   --isa       native (default: GGML_NATIVE, this machine's ISA, into build/llama-server), or a
#               fixed x86 target into build/llama-server-ISA, to compare with treeattn's target of
#               the same name on a CPU that has more (`generate --isa avx2`): avx2 (AVX2 + FMA +
#               F16C + BMI2, maddubs integer dots), avxvnni (the same with AVX-VNNI's vpdpbusd)
# Needs cmake, a C++ compiler and pip; CPU only, no curl.
# Then, for example (same GGUF, same total threads as the treeattn server, slots and the prompt
# cache on, one KV pool shared by the slots):
#   build/llama-server/bin/llama-server -m models/SmolLM2-135M-Instruct.Q4_1.gguf \
#       --port 8081 -t 2 -np 16 -c 262144 --kv-unified --cache-reuse 64 -fa on
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
out="$root/build/llama-server"
isa=native
version=""
jobs="$(nproc)"
while [ $# -gt 0 ]; do
  case "$1" in
    --version) version=$2; shift 2 ;;
    --jobs) jobs=$2; shift 2 ;;
    --isa) isa=$2; shift 2 ;;
    -h|--help) sed -n '2,/^set -euo/p' "$0" | sed '$d; s/^# \{0,1\}//'; exit 0 ;;
    *) echo "build-llama-server: unknown argument $1 (see --help)" >&2; exit 2 ;;
  esac
done
case "$isa" in
  # AMX off: ggml's AMX matrix multiply (its extra buffer type for quantized weights) crashes with
  # SIGSEGV in ggml_backend_amx_mul_mat on the first graph of a Q4_1 model on an AMX CPU
  # (llama-cpp-python 0.3.36's llama.cpp, one thread); explicit -mno-amx-* outrank -march=native.
  native) isa_flags=(-DGGML_NATIVE=ON "-DCMAKE_C_FLAGS=-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
                     "-DCMAKE_CXX_FLAGS=-mno-amx-tile -mno-amx-int8 -mno-amx-bf16") ;;
  avx2|avxvnni)
    out="$root/build/llama-server-$isa"
    isa_flags=(-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON
               -DGGML_BMI2=ON -DGGML_AVX512=OFF "-DGGML_AVX_VNNI=$([ "$isa" = avxvnni ] && echo ON || echo OFF)")
    ;;
  *) echo "build-llama-server: --isa $isa: one of native, avx2, avxvnni" >&2; exit 2 ;;
esac
command -v cmake > /dev/null || { echo "build-llama-server: cmake is missing" >&2; exit 2; }
mkdir -p "$out/download"
spec="llama-cpp-python${version:+==$version}"
echo "== downloading the source distribution of $spec"
# --no-build-isolation with no build backend installed would fail; pip only downloads here.
python3 -m pip download --no-binary :all: --no-deps --no-cache-dir -d "$out/download" "$spec"
sdist=""
for f in "$out/download"/llama_cpp_python-*.tar.gz "$out/download"/llama-cpp-python-*.tar.gz; do
  if [ -f "$f" ] && { [ -z "$sdist" ] || [ "$f" -nt "$sdist" ]; }; then sdist=$f; fi
done
[ -n "$sdist" ] || { echo "build-llama-server: no sdist downloaded" >&2; exit 1; }
rm -rf "$out/src"
mkdir -p "$out/src"
tar -xzf "$sdist" -C "$out/src" --strip-components=1
src="$out/src/vendor/llama.cpp"
[ -f "$src/CMakeLists.txt" ] || { echo "build-llama-server: $sdist has no vendor/llama.cpp" >&2; exit 1; }
echo "== configuring llama.cpp from $(basename "$sdist")"
cmake -S "$src" -B "$out/build" -DCMAKE_BUILD_TYPE=Release -DBUILD_SHARED_LIBS=OFF \
  "${isa_flags[@]}" -DLLAMA_CURL=OFF -DLLAMA_BUILD_SERVER=ON -DLLAMA_BUILD_EXAMPLES=ON \
  -DLLAMA_BUILD_TOOLS=ON -DLLAMA_BUILD_TESTS=OFF -DGGML_RPC=ON > "$out/configure.log"
# the RPC worker's target: ggml-rpc-server in newer llama.cpp, rpc-server before
rpc_target=rpc-server
grep -q 'ggml-rpc-server' "$src/tools/rpc/CMakeLists.txt" 2> /dev/null && rpc_target=ggml-rpc-server
echo "== building llama-server and $rpc_target with $jobs jobs (log: $out/build.log)"
cmake --build "$out/build" --target llama-server "$rpc_target" -j "$jobs" > "$out/build.log" 2>&1 \
  || { tail -30 "$out/build.log"; exit 1; }
mkdir -p "$out/bin"
for b in llama-server:llama-server "$rpc_target":rpc-server; do
  built="$(find "$out/build" -name "${b%%:*}" -type f -perm -u+x | head -1)"
  [ -n "$built" ] || { echo "build-llama-server: no ${b%%:*} binary in $out/build" >&2; exit 1; }
  cp "$built" "$out/bin/${b#*:}"
done
basename "$sdist" .tar.gz > "$out/VERSION"
"$out/bin/llama-server" --version 2>&1 | head -2 || true
echo "build-llama-server: $out/bin/llama-server ($(cat "$out/VERSION"))"
