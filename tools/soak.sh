#!/usr/bin/env bash
# Fault soak: every fault `treeattn run --inject` can inject, N times each, at 2..8 ranks, and a
# table of how the runs ended. A trial is one `treeattn run` of a small decode (4k tokens, one
# strategy, 1 warm-up + 3 steps) in which one rank misbehaves:
#
#   never-arrive  the rank stops taking part at a step: the others must time out and name it
#   kill          the rank SIGKILLs itself at a step: the launcher must name it and the step
#   mismatch      the rank uses another head_dim: the set-up agreement must name it
#   nan           the rank's K holds a NaN: every rank must name it (the input check)
#   slow          the rank is late at every step, by a quarter of the timeout: the run must pass
#   pgkill        not an --inject fault: the job's mpirun process group is SIGKILLed while the
#                 ranks decode (as a user or a scheduler would end it): the launcher must name the
#                 ranks, end them and remove Open MPI's shared-memory segments from /dev/shm
#
# The rank count, the strategy, the faulty rank and the step vary from trial to trial (rank
# counts and strategies in turn, rank and step drawn from --seed). Columns: trials; hangs (no
# exit within start-up allowance + timeout + 5 s: the run is then killed); exits whose message
# names the faulty rank (for `slow`: runs that passed; for `pgkill`: the ranks named); exits with
# the expected code; trials that left processes (found by a marker in their environment, then
# killed), temporary files or /dev/shm segments (Open MPI's vader_segment.* files that appeared
# during the trial and are still there a second after it) behind; the longest trial.
#
# Usage: tools/soak.sh [--trials N] [--ranks 2,3,4,5,6,7,8] [--timeout-ms 2000] [--seed S]
#                      [--bin build/release/cli/treeattn] [--log FILE] [--faults a,b,...]
set -uo pipefail
cd "$(dirname "$0")/.."

trials=20
ranks_list=2,3,4,5,6,7,8
timeout_ms=2000
seed=12
bin=build/release/cli/treeattn
log=
faults_list=never-arrive,kill,mismatch,nan,slow,pgkill
startup_s=15  # mpirun and up to 8 ranks starting on a small machine
while [ $# -gt 0 ]; do
  case "$1" in
    --trials) trials=$2; shift 2 ;;
    --ranks) ranks_list=$2; shift 2 ;;
    --timeout-ms) timeout_ms=$2; shift 2 ;;
    --seed) seed=$2; shift 2 ;;
    --bin) bin=$2; shift 2 ;;
    --log) log=$2; shift 2 ;;
    --faults) faults_list=$2; shift 2 ;;
    -h|--help) sed -n '2,/^set -uo/p' "$0" | sed '$d; s/^# \{0,1\}//'; exit 0 ;;
    *) echo "soak.sh: unknown argument $1 (see --help)" >&2; exit 2 ;;
  esac
done
[ -x "$bin" ] || { echo "soak.sh: no treeattn at $bin (build it, or give --bin)" >&2; exit 2; }
[[ "$trials" =~ ^[1-9][0-9]*$ ]] || { echo "soak.sh: --trials must be >= 1" >&2; exit 2; }
[[ "$timeout_ms" =~ ^[1-9][0-9]*$ ]] || { echo "soak.sh: --timeout-ms must be >= 1" >&2; exit 2; }
IFS=, read -r -a rank_counts <<<"$ranks_list"
IFS=, read -r -a faults <<<"$faults_list"
methods=(tree ring-state ring-kv allgather tree-paper gather-root tree2 hier)
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMP_NUM_THREADS=1
RANDOM=$seed
limit_s=$((startup_s + (timeout_ms + 999) / 1000 + 5))
warmup=1
steps=3
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
[ -n "$log" ] && : > "$log"

# pids of processes whose environment carries the marker
marked_pids() {
  local p
  for p in /proc/[0-9]*; do
    grep -qz "^TREEATTN_SOAK_MARK=$1\$" "$p/environ" 2>/dev/null && echo "${p#/proc/}"
  done
}

now_ms() { date +%s%3N; }

shm_segments() { ls /dev/shm 2>/dev/null | grep '^vader_segment\.' | sort; }

declare -A n_trials n_hangs n_named n_code n_procs n_files n_shm max_ms
for f in "${faults[@]}"; do
  n_trials[$f]=0; n_hangs[$f]=0; n_named[$f]=0; n_code[$f]=0; n_procs[$f]=0; n_files[$f]=0
  n_shm[$f]=0; max_ms[$f]=0
done

t_start=$(now_ms)
for f in "${faults[@]}"; do
  for ((i = 0; i < trials; i++)); do
    p=${rank_counts[$((i % ${#rank_counts[@]}))]}
    m=${methods[$((i % ${#methods[@]}))]}
    r=$((RANDOM % p))
    s=$((RANDOM % (warmup + steps)))
    case "$f" in
      never-arrive) spec="never-arrive:$r@$s"; want=3; named="rank $r never arrived" ;;
      kill) spec="kill:$r@$s"; want=137; named="rank $r \\(pid [0-9]+\\) died without a message in .*, step $s" ;;
      mismatch) spec="mismatch:$r"; want=3; named="rank $r has head_dim=" ;;
      nan) spec="nan:$r"; want=2; named="rank $r brought a non-finite input" ;;
      slow) spec="slow:$r:$((timeout_ms / 4))"; want=0; named="^$m +$p .* ok$" ;;
      pgkill) spec=""; want=137; named="rank [0-9]+ \\(pid [0-9]+\\) died without a message" ;;
      *) echo "soak.sh: unknown fault $f" >&2; exit 2 ;;
    esac
    mark="soak$$-$f-$i"
    out="$work/out"
    shm_segments > "$work/shm-before"
    t0=$(now_ms)
    if [ "$f" = pgkill ]; then
      # Decode until killed: the job's mpirun process group gets SIGKILL once every rank runs.
      TREEATTN_SOAK_MARK=$mark "$bin" run --ranks "$p" --seq 4k --methods "$m" --warmup $warmup \
        --steps 100000 --no-append --timeout-ms "$timeout_ms" > "$out" 2>&1 &
      pid=$!
      for _ in $(seq $((startup_s * 10))); do
        [ "$(marked_pids "$mark" | wc -l)" -ge $((p + 2)) ] && grep -q "round robin" "$out" && break
        sleep 0.1
      done
      sleep 0.$((RANDOM % 10))
      mp=$(pgrep -P "$pid" mpirun)
      [ -n "$mp" ] && kill -KILL -- "-$mp" 2>/dev/null
    else
      TREEATTN_SOAK_MARK=$mark "$bin" run --ranks "$p" --seq 4k --methods "$m" --warmup $warmup \
        --steps $steps --timeout-ms "$timeout_ms" --inject "$spec" > "$out" 2>&1 &
      pid=$!
    fi
    hang=0
    while kill -0 "$pid" 2>/dev/null; do
      if [ $(($(now_ms) - t0)) -gt $((limit_s * 1000)) ]; then
        hang=1
        kill -KILL "$pid" 2>/dev/null
        break
      fi
      sleep 0.1
    done
    wait "$pid"
    rc=$?
    ms=$(($(now_ms) - t0))
    # Anything of this trial still alive a moment later is left over (and is killed here).
    sleep 0.5
    left=$(marked_pids "$mark")
    if [ -n "$left" ]; then
      sleep 2
      left=$(marked_pids "$mark")
      [ -n "$left" ] && kill -KILL $left 2>/dev/null
    fi
    files=$(ls /tmp | grep -cE "^treeattn-[a-z]+-$pid-" || true)
    sleep 0.5
    shm_left=$(shm_segments | comm -13 "$work/shm-before" - | wc -l)
    rm -rf /tmp/treeattn-*-"$pid"-* 2>/dev/null
    n_trials[$f]=$((n_trials[$f] + 1))
    [ $hang = 1 ] && n_hangs[$f]=$((n_hangs[$f] + 1))
    is_named=0
    grep -qE -- "$named" "$out" && is_named=1
    [ $is_named = 1 ] && n_named[$f]=$((n_named[$f] + 1))
    [ "$rc" = "$want" ] && n_code[$f]=$((n_code[$f] + 1))
    [ -n "$left" ] && n_procs[$f]=$((n_procs[$f] + 1))
    [ "$files" -gt 0 ] && n_files[$f]=$((n_files[$f] + 1))
    [ "$shm_left" -gt 0 ] && n_shm[$f]=$((n_shm[$f] + 1))
    [ "$ms" -gt "${max_ms[$f]}" ] && max_ms[$f]=$ms
    line="$f trial $i: ranks $p method $m inject $spec: exit $rc (want $want), $ms ms, named $is_named, hang $hang, procs left $(wc -w <<<"$left"), files left $files, shm segments left $shm_left"
    if [ -n "$log" ]; then
      { echo "== $line"; cat "$out"; } >> "$log"
    fi
    if [ $hang = 1 ] || [ $is_named = 0 ] || [ "$rc" != "$want" ] || [ -n "$left" ] || [ "$files" -gt 0 ] ||
       [ "$shm_left" -gt 0 ]; then
      echo "UNEXPECTED: $line" >&2
      tail -5 "$out" | sed 's/^/    /' >&2
    fi
  done
done
t_end=$(now_ms)

echo
echo "treeattn fault soak: $trials trials per fault at ${ranks_list//,/, } ranks in turn, strategies in turn, 4k tokens, $warmup warm-up + $steps steps, --timeout-ms $timeout_ms; hang = no exit within ${limit_s} s (${startup_s} s start-up + timeout + 5 s); $(( (t_end - t_start) / 1000 )) s in all"
echo
printf '| %-12s | %6s | %5s | %-28s | %13s | %14s | %15s | %14s | %8s |\n' fault trials hangs "exits naming the faulty rank" "expected exit" "processes left" "temp files left" "/dev/shm left" "longest"
printf '|%s|%s|%s|%s|%s|%s|%s|%s|%s|\n' "--------------" "-------:" "------:" "------------------------------" "--------------:" "---------------:" "----------------:" "---------------:" "---------:"
total_bad=0
for f in "${faults[@]}"; do
  label="${n_named[$f]}"
  [ "$f" = slow ] && label="${n_named[$f]} (passed)"
  printf '| %-12s | %6d | %5d | %-28s | %13s | %14d | %15d | %14d | %7.1fs |\n' "$f" "${n_trials[$f]}" "${n_hangs[$f]}" "$label" \
    "${n_code[$f]}" "${n_procs[$f]}" "${n_files[$f]}" "${n_shm[$f]}" "$(awk "BEGIN{print ${max_ms[$f]}/1000}")"
  total_bad=$((total_bad + n_hangs[$f] + n_procs[$f] + n_files[$f] + n_shm[$f] + n_trials[$f] - n_named[$f] + n_trials[$f] - n_code[$f]))
done
[ "$total_bad" = 0 ]
