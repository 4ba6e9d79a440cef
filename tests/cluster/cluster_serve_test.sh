#!/usr/bin/env bash
# One case of `treeattn serve` across emulated hosts (cluster_serve.py): 2 hosts x 2 ranks
# (tools/cluster/cluster.sh, network namespaces joined by a 1 Gbit shaped link), the official
# openai client inside host treeattn-h0 pointed at rank 0's address there. Exit 77 (ctest:
# skipped) with a message when the model, the openai package, root or namespaces are missing.
# Usage: cluster_serve_test.sh TREEATTN CASE
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
root="$(cd "$here/../.." && pwd)"
bin=$1 case=$2
if [ "$(id -u)" -ne 0 ]; then
  echo "SKIP: emulated hosts are network namespaces: run as root"
  exit 77
fi
if ! command -v ip > /dev/null || ! command -v tc > /dev/null || ! unshare --net true 2> /dev/null; then
  echo "SKIP: cannot create network namespaces here (iproute2, tc and CAP_SYS_ADMIN needed)"
  exit 77
fi
if ! command -v mpirun > /dev/null; then
  echo "SKIP: mpirun is missing"
  exit 77
fi
if ! model="$("$root/tools/model-path.sh")"; then
  echo "SKIP: the real model is not here (tools/fetch-model.sh fetches it)"
  exit 77
fi
if ! py="$("$root/tools/serve-venv.sh")"; then
  echo "SKIP: the openai Python client cannot be installed (tools/serve-venv.sh: no PyPI?)"
  exit 77
fi
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
export NO_PROXY="127.0.0.1,localhost,10.213.0.1${NO_PROXY:+,$NO_PROXY}"
export no_proxy="$NO_PROXY"
exec "$py" "$here/cluster_serve.py" "$bin" "$model" "$case"
