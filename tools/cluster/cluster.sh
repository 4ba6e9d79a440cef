#!/usr/bin/env bash
# An emulated multi-host cluster on one machine, for running Open MPI jobs across "hosts".
#
# Each host is a network namespace (treeattn-h0, treeattn-h1, ...). Two hosts are joined by one
# veth pair; more hosts hang off a bridge that lives in its own namespace (treeattn-br). Every
# host gets an address in a private /24 (default 10.213.0.0/24) that exists only inside these
# namespaces: nothing is configured in the root namespace and no traffic leaves the machine.
# `--link RATE` shapes each host's eth0 with `tc tbf` (no delay emulation: sch_netem is not in
# this kernel). `--tcp-retries N` (default 4: about 6 s) is each host's net.ipv4.tcp_retries2:
# how long TCP retransmits to a host that stopped answering before the connection fails, so that
# mpirun, ending a job, gives up on the daemon of a host whose link went down within seconds
# instead of the kernel default's 15 minutes. mpirun runs inside treeattn-h0 with a hostname of
# its own; remote daemons are started through rsh-agent.sh (`ip netns exec HOST unshare
# --uts ...`), so each namespace looks like a separate node to Open MPI: ranks on one host use
# shared memory, ranks on different hosts use TCP over the (shaped) link, and
# MPI_COMM_TYPE_SHARED groups ranks per host.
#
# Usage (as root):
#   cluster.sh up K [--link RATE] [--slots S] [--subnet A.B.C] [--tcp-retries N]
#                                                                create K hosts (2 <= K <= 16)
#   cluster.sh run [--timeout SEC] -- MPIRUN_ARGS...             mpirun inside treeattn-h0
#   cluster.sh session K [up options] -- MPIRUN_ARGS...          up, run, always down
#   cluster.sh exec HOST -- CMD...                               a command inside one host
#   cluster.sh status                                            what exists now
#   cluster.sh down                                              remove everything
#
# Sessions wait for each other (up to TREEATTN_CLUSTER_LOCK_WAIT seconds, default 600): two test
# runs on one machine take turns instead of failing. A session's cluster records its owner; one
# left behind by a session that died (SIGKILL, a machine that stopped mid-test) is removed by the
# next session, with a message. A cluster made by `up` is never removed by a session.
#
# Example:
#   tools/cluster/cluster.sh session 2 --slots 2 --link 1gbit -- -np 4 hostname
set -euo pipefail

readonly PREFIX="treeattn"
readonly BRIDGE_NS="${PREFIX}-br"
readonly STATE_DIR="${TREEATTN_CLUSTER_DIR:-/run/${PREFIX}-cluster}"
# Sessions on one machine take turns through this lock. The namespaces are machine-wide, so the
# lock is too, whatever TREEATTN_CLUSTER_DIR says.
readonly LOCK_FILE="/run/${PREFIX}-cluster.lock"
# Set by cmd_session only (never taken from the environment).
CLUSTER_OWNER=""
LOCK_FD=""
readonly MAX_HOSTS=16
readonly SELF_DIR="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"

die() { echo "cluster.sh: $*" >&2; exit 1; }
log() { echo "cluster.sh: $*" >&2; }

host_name() { echo "${PREFIX}-h$1"; }

require_root() {
  [[ $(id -u) -eq 0 ]] || die "must run as root (network namespaces need CAP_NET_ADMIN)"
  command -v ip >/dev/null || die "'ip' (iproute2) not found"
}

# Namespaces this tool owns that exist now (our naming pattern only).
our_namespaces() {
  ip netns list 2>/dev/null | awk '{print $1}' | grep -E "^${PREFIX}-(h[0-9]+|br)$" || true
}

# Kill processes still running inside one of our namespaces (bounded: 3 attempts).
kill_ns_pids() {
  local ns=$1 attempt pids
  for attempt in 1 2 3; do
    pids=$(ip netns pids "$ns" 2>/dev/null || true)
    [[ -z $pids ]] && return 0
    if [[ $attempt -lt 3 ]]; then kill -TERM $pids 2>/dev/null || true; else kill -KILL $pids 2>/dev/null || true; fi
    sleep 0.5
  done
}

cmd_down() {
  require_root
  local ns removed=0
  for ns in $(our_namespaces); do
    kill_ns_pids "$ns"
    ip netns del "$ns" 2>/dev/null || log "warning: could not delete namespace $ns"
    removed=$((removed + 1))
  done
  rm -rf "$STATE_DIR"
  log "down: removed $removed namespace(s)"
}

write_agent() {
  # Open MPI calls the agent like ssh: `AGENT HOST COMMAND...`, where COMMAND is a shell line.
  cat >"$STATE_DIR/rsh-agent.sh" <<'AGENT'
#!/bin/sh
# rsh agent for Open MPI (plm_rsh_agent): runs the daemon's command line inside the network
# namespace named HOST, with its own UTS namespace whose hostname is HOST.
host="$1"; shift
case "$host" in treeattn-h[0-9]*) ;; *) echo "rsh-agent: unknown host '$host'" >&2; exit 255;; esac
exec ip netns exec "$host" unshare --uts -- sh -c "hostname $host && exec $*"
AGENT
  chmod +x "$STATE_DIR/rsh-agent.sh"
}

cmd_up() {
  require_root
  local k="" rate="" slots=2 subnet="10.213.0" tcp_retries=4
  while [[ $# -gt 0 ]]; do
    case $1 in
      --link) rate=${2:?--link needs a rate, e.g. 1gbit}; shift 2 ;;
      --slots) slots=${2:?--slots needs a number}; shift 2 ;;
      --subnet) subnet=${2:?--subnet needs A.B.C}; shift 2 ;;
      --tcp-retries) tcp_retries=${2:?--tcp-retries needs a number}; shift 2 ;;
      -*) die "up: unknown option '$1'" ;;
      *) [[ -z $k ]] || die "up: unexpected argument '$1'"; k=$1; shift ;;
    esac
  done
  [[ $k =~ ^[0-9]+$ ]] && ((k >= 2 && k <= MAX_HOSTS)) ||
    die "up: host count must be an integer in [2, $MAX_HOSTS], got '${k}'"
  [[ $slots =~ ^[0-9]+$ ]] && ((slots >= 1 && slots <= 64)) ||
    die "up: --slots must be an integer in [1, 64], got '$slots'"
  [[ $tcp_retries =~ ^[0-9]+$ ]] && ((tcp_retries >= 1 && tcp_retries <= 15)) ||
    die "up: --tcp-retries must be an integer in [1, 15], got '$tcp_retries'"
  [[ $subnet =~ ^(10|192\.168|172\.(1[6-9]|2[0-9]|3[01]))(\.[0-9]+){0,2}$ ]] &&
    [[ $(tr -cd . <<<"$subnet" | wc -c) -eq 2 ]] ||
    die "up: --subnet must be the first three octets of a private /24, e.g. 10.213.0, got '$subnet'"
  if [[ -n $(our_namespaces) || -e $STATE_DIR ]]; then
    die "up: a cluster already exists (see 'cluster.sh status'); run 'cluster.sh down' first"
  fi
  command -v mpirun >/dev/null || log "warning: mpirun not found; 'run' will fail"

  # Roll back whatever was created if any step fails.
  trap 'log "up failed; cleaning up"; cmd_down' ERR
  mkdir -p "$STATE_DIR"
  echo "${CLUSTER_OWNER:-manual}" >"$STATE_DIR/owner"
  local i h
  for ((i = 0; i < k; i++)); do
    h=$(host_name "$i")
    ip netns add "$h"
    ip -n "$h" link set lo up
  done
  if ((k == 2)); then
    ip link add "${PREFIX}-v0" type veth peer name "${PREFIX}-v1"
    ip link set "${PREFIX}-v0" netns "$(host_name 0)"
    ip link set "${PREFIX}-v1" netns "$(host_name 1)"
    ip -n "$(host_name 0)" link set "${PREFIX}-v0" name eth0
    ip -n "$(host_name 1)" link set "${PREFIX}-v1" name eth0
  else
    ip netns add "$BRIDGE_NS"
    ip -n "$BRIDGE_NS" link set lo up
    ip -n "$BRIDGE_NS" link add br0 type bridge
    ip -n "$BRIDGE_NS" link set br0 up
    for ((i = 0; i < k; i++)); do
      h=$(host_name "$i")
      ip link add "${PREFIX}-e$i" type veth peer name "${PREFIX}-p$i"
      ip link set "${PREFIX}-e$i" netns "$h"
      ip link set "${PREFIX}-p$i" netns "$BRIDGE_NS"
      ip -n "$h" link set "${PREFIX}-e$i" name eth0
      ip -n "$BRIDGE_NS" link set "${PREFIX}-p$i" master br0
      ip -n "$BRIDGE_NS" link set "${PREFIX}-p$i" up
    done
  fi
  : >"$STATE_DIR/hostfile"
  for ((i = 0; i < k; i++)); do
    h=$(host_name "$i")
    ip -n "$h" addr add "${subnet}.$((i + 1))/24" dev eth0
    ip -n "$h" link set eth0 up
    # How long TCP keeps retransmitting to a silent peer (per namespace): 4 retries give up
    # after about 6 s (the kernel's 15: about 15 minutes). mpirun ending a job must reach every
    # host's daemon; one whose link went down holds it until this gives up.
    ip netns exec "$h" sh -c "echo $tcp_retries > /proc/sys/net/ipv4/tcp_retries2"
    if [[ -n $rate ]]; then
      # burst 64kb: a larger burst lets 32-256 KiB messages through at twice the rate.
      ip netns exec "$h" tc qdisc replace dev eth0 root tbf rate "$rate" burst 64kb latency 50ms
    fi
    echo "$h slots=$slots" >>"$STATE_DIR/hostfile"
  done
  write_agent
  cat >"$STATE_DIR/config" <<EOF
hosts=$k
slots=$slots
subnet=${subnet}.0/24
link=${rate:-unshaped}
tcp_retries=$tcp_retries
EOF
  # Every host's link must be up before we call it up (bounded: 30 x 0.1 s per host); with
  # ping available, host 0 must also reach every other host.
  for ((i = 0; i < k; i++)); do
    local ok=0 try
    h=$(host_name "$i")
    for try in $(seq 1 30); do
      if ip -n "$h" link show eth0 | grep -q 'LOWER_UP'; then
        if ((i == 0)) || ! command -v ping >/dev/null ||
          ip netns exec "$(host_name 0)" ping -c 1 -W 1 "${subnet}.$((i + 1))" >/dev/null 2>&1; then
          ok=1; break
        fi
      fi
      sleep 0.1
    done
    ((ok)) || { log "host $h (${subnet}.$((i + 1))): link not up or unreachable"; false; }
  done
  trap - ERR
  log "up: $k hosts x $slots slots, subnet ${subnet}.0/24, link ${rate:-unshaped}"
}

read_config() {
  [[ -f $STATE_DIR/config ]] || die "no cluster is up (run 'cluster.sh up K' first)"
  # shellcheck disable=SC1091
  source "$STATE_DIR/config"
}

cmd_run() {
  require_root
  local timeout_s=600
  while [[ $# -gt 0 && $1 != "--" ]]; do
    case $1 in
      --timeout) timeout_s=${2:?--timeout needs seconds}; shift 2 ;;
      *) die "run: unknown option '$1' (mpirun arguments go after --)" ;;
    esac
  done
  [[ ${1:-} == "--" ]] || die "run: expected -- before the mpirun arguments"
  shift
  [[ $# -gt 0 ]] || die "run: no mpirun arguments (e.g. -- -np 4 hostname)"
  read_config
  local h0
  h0=$(host_name 0)
  export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
  # --bind-to none: otherwise every emulated host pins its first rank to core 0 (~4 ms per
  # message). yield_when_idle: ranks outnumber cores. Only our subnet for OOB and TCP BTL.
  local -a mca=(
    --hostfile "$STATE_DIR/hostfile"
    --mca plm_rsh_agent "$STATE_DIR/rsh-agent.sh"
    --mca plm_rsh_no_tree_spawn 1
    --mca oob_tcp_if_include "$subnet"
    --mca btl_tcp_if_include "$subnet"
    --mca btl self,vader,tcp
    --mca mpi_yield_when_idle 1
    --bind-to none --oversubscribe --allow-run-as-root
  )
  # The job does not inherit a session's lock: when the session dies, the next one must get the
  # lock at once (and remove what is left), not wait for orphaned ranks.
  without_lock timeout --kill-after=10 "$timeout_s" \
    ip netns exec "$h0" unshare --uts -- \
    bash -c 'hostname "$0" && exec "$@"' "$h0" mpirun "${mca[@]}" "$@"
}

without_lock() {
  if [[ -n ${LOCK_FD:-} ]]; then "$@" {LOCK_FD}>&-; else "$@"; fi
}

# "session PID START": START is the process's start time in clock ticks after boot (field 22 of
# /proc/PID/stat), so a recycled PID does not pass for the session that made the cluster.
session_owner() {
  local pid=$1 stat
  stat=$(cat "/proc/$pid/stat" 2>/dev/null) || return 1
  stat=${stat##*) }  # the fields after the command name, which may contain spaces
  echo "session $pid $(awk '{print $20}' <<<"$stat")"
}

# Under the lock: a cluster whose owner is a session that no longer runs is left over; remove it.
remove_dead_session_cluster() {
  [[ -n $(our_namespaces) || -e $STATE_DIR ]] || return 0
  local owner="" kind pid start
  [[ -f $STATE_DIR/owner ]] && owner=$(<"$STATE_DIR/owner")
  read -r kind pid start <<<"$owner" || true
  case $kind in
    manual) return 0 ;;  # made by `up`: it belongs to someone; cmd_up says so and stops
    session)
      if [[ $(session_owner "$pid" 2>/dev/null) == "$owner" ]]; then
        die "session: the cluster of running session $pid holds the namespaces despite the lock"
      fi
      log "session: removing a cluster left by session $pid, which no longer runs" ;;
    *)
      # No owner: a session killed before it recorded one (it started no job yet) or an older
      # cluster.sh. Only an idle one is removed; one with processes may be someone's live job.
      local ns
      for ns in $(our_namespaces); do
        [[ -z $(ip netns pids "$ns" 2>/dev/null) ]] ||
          die "session: a cluster that records no owner has processes in $ns (someone's job?); see 'cluster.sh status', then 'cluster.sh down'"
      done
      log "session: removing an idle cluster that records no owner (left by a session killed before it recorded one, or by an older cluster.sh)" ;;
  esac
  cmd_down
}

cmd_session() {
  local -a up_args=()
  while [[ $# -gt 0 && $1 != "--" ]]; do up_args+=("$1"); shift; done
  [[ ${1:-} == "--" ]] || die "session: expected -- before the mpirun arguments"
  shift
  require_root
  local timeout_s=${TREEATTN_CLUSTER_TIMEOUT:-600}
  local wait_s=${TREEATTN_CLUSTER_LOCK_WAIT:-600}
  [[ $wait_s =~ ^[0-9]+$ ]] || die "session: TREEATTN_CLUSTER_LOCK_WAIT must be seconds, got '$wait_s'"
  command -v flock >/dev/null || die "session: 'flock' (util-linux) not found"
  exec {LOCK_FD}>"$LOCK_FILE" || die "session: cannot open the lock file $LOCK_FILE"
  if ! flock -n "$LOCK_FD"; then
    log "session: another session is running on this machine; waiting up to ${wait_s} s for it"
    flock -w "$wait_s" "$LOCK_FD" ||
      die "session: another session still held $LOCK_FILE after ${wait_s} s"
  fi
  remove_dead_session_cluster
  CLUSTER_OWNER=$(session_owner $$) || die "session: cannot read /proc/$$/stat"
  cmd_up "${up_args[@]}"
  # Whatever happens from here on (failure, Ctrl-C, timeout), the cluster goes away.
  trap 'cmd_down' EXIT
  trap 'exit 130' INT TERM
  cmd_run --timeout "$timeout_s" -- "$@"
}

cmd_exec() {
  require_root
  local h=${1:-}
  [[ $h =~ ^${PREFIX}-h[0-9]+$ ]] || die "exec: expected a host name like $(host_name 0), got '$h'"
  shift
  [[ ${1:-} == "--" ]] && shift
  [[ $# -gt 0 ]] || die "exec: no command"
  ip netns list | awk '{print $1}' | grep -qx "$h" || die "exec: host '$h' does not exist"
  exec ip netns exec "$h" unshare --uts -- bash -c 'hostname "$0" && exec "$@"' "$h" "$@"
}

cmd_status() {
  require_root
  local ns
  local -a all
  mapfile -t all < <(our_namespaces)
  if [[ ${#all[@]} -eq 0 ]]; then
    echo "no emulated cluster"
    [[ -e $STATE_DIR ]] && echo "(stale state directory $STATE_DIR; run 'cluster.sh down')"
    return 0
  fi
  [[ -f $STATE_DIR/config ]] && sed 's/^/  /' "$STATE_DIR/config"
  for ns in "${all[@]}"; do
    [[ $ns == "$BRIDGE_NS" ]] && { echo "$ns: bridge"; continue; }
    local addr qdisc
    addr=$(ip -n "$ns" -4 -o addr show dev eth0 2>/dev/null | awk '{print $4}')
    qdisc=$(ip netns exec "$ns" tc qdisc show dev eth0 2>/dev/null | head -n 1)
    echo "$ns: eth0 ${addr:-?}; ${qdisc:-no qdisc}"
  done
}

main() {
  local cmd=${1:-}
  [[ -n $cmd ]] && shift
  case $cmd in
    up) cmd_up "$@" ;;
    run) cmd_run "$@" ;;
    session) cmd_session "$@" ;;
    exec) cmd_exec "$@" ;;
    status) cmd_status ;;
    down) cmd_down ;;
    -h | --help | help) sed -n '2,25p' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//' ;;
    *) die "unknown command '${cmd}' (up, run, session, exec, status, down; --help)" ;;
  esac
}

main "$@"
