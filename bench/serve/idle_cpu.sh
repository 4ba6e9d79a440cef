#!/usr/bin/env bash
# CPU an idle `treeattn serve` uses: starts it (default 2 ranks), waits until /health answers and
# a few seconds more, then sums the user + system time of its processes (launcher, mpirun, ranks)
# over 10 s of idling and prints it as a share of one core.
#
# Usage: bench/serve/idle_cpu.sh [TREEATTN_BINARY] [RANKS]     (port: $PORT, default 18431)
set -euo pipefail
cd "$(dirname "$0")/../.."
bin=${1:-build/release/cli/treeattn}
ranks=${2:-2}
port=${PORT:-18431}
"$bin" serve --ranks "$ranks" --port "$port" > /tmp/treeattn-idle-serve.log 2>&1 &
launcher=$!
trap 'kill -TERM $launcher 2>/dev/null; wait $launcher 2>/dev/null || true' EXIT
for _ in $(seq 1 120); do curl -sf "localhost:$port/health" > /dev/null && break; sleep 0.5; done
sleep 3
pids=$(pgrep -f "serve --ranks $ranks --port $port" | tr '\n' ' ')
ticks() {
  local t=0 p
  for p in $pids; do
    [ -r "/proc/$p/stat" ] && t=$((t + $(awk '{print $14 + $15}' "/proc/$p/stat")))
  done
  echo "$t"
}
a=$(ticks); sleep 10; b=$(ticks)
python3 -c "print(f'idle treeattn serve, {$ranks} ranks: {($b - $a) / $(getconf CLK_TCK) / 10 * 100:.1f}% of one core over 10 s')"
