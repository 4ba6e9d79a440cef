#!/usr/bin/env bash
# Installs the Debian 12 packages treeattn needs, only those that are missing, then fetches the
# shipped model (SmolLM2, tools/fetch-model.sh) for the tests and `generate`.
#   tools/deps.sh              packages and the model (tools/test.sh)
#   tools/deps.sh --no-model   packages only (tools/quickstart.sh: the main job is the synthetic
#                              attention decode, which reads no model; ~100 MB less to download)
# Runs as root, or through sudo when not root. Safe to run again.
set -euo pipefail
fetch_model=1
if [ "${1:-}" = "--no-model" ]; then fetch_model=0; fi
fetch() { if [ "$fetch_model" = 1 ]; then "$(dirname "$0")/fetch-model.sh"; fi; }

packages=(
  build-essential cmake ninja-build pkg-config git
  libgtest-dev libgmock-dev libbenchmark-dev   # tests and microbenchmarks
  libopenmpi-dev openmpi-bin                   # the MPI communicator backend and mpirun
  libcli11-dev libfmt-dev nlohmann-json3-dev   # CLI flags, formatting, JSON reports/topologies
  libcpp-httplib-dev curl                      # treeattn serve's HTTP server; its tests use curl
  libopenblas-dev                              # the OpenBLAS peer kernel in benchmarks
  libssl-dev                                   # SHA-256 of results (output_sha256 in JSON)
  gnuplot-nox                                  # --plot
  python3 python3-numpy                        # tests recheck saved .npy cases with numpy
  python3-dev pybind11-dev python3-pybind11 python3-mpi4py  # python/ (no nanobind in Debian 12)
  iproute2                                     # emulated multi-host cluster (netns, tc)
  libpcre2-dev python3-pip                     # tokenizer regexes; pip fetches the real model
  clang libclang-rt-14-dev                     # fuzz/: libFuzzer targets (tools/test.sh runs them)
  libomp-14-dev                                # tools/sanitize.sh tsan: OpenMP visible to TSan (Archer)
)

missing=()
for p in "${packages[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ ${#missing[@]} -eq 0 ]; then
  echo "deps: all ${#packages[@]} packages present"
  fetch  # the real model for tests and generate (never fails)
  exit 0
fi
SUDO=""
if [ "$(id -u)" -ne 0 ]; then SUDO="sudo"; fi
echo "deps: installing ${missing[*]}"
$SUDO env DEBIAN_FRONTEND=noninteractive apt-get update -qq
$SUDO env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}"
fetch
