#!/usr/bin/env bash
# A real two-node SLURM cluster on this one machine, to try (and test) trident's SLURM path:
#   sudo scripts/slurm_cluster.sh start     # installs Debian's slurmd slurmctld slurm-client munge if missing
#   sudo scripts/slurm_cluster.sh status    # daemons and nodes; exit status 0 when both nodes take jobs
#   sudo scripts/slurm_cluster.sh stop      # cancels the jobs, stops the daemons
# Two slurmd daemons (nodes n1 and n2, one CPU each, ports 17001 and 17002 on 127.0.0.1) share this
# host with slurmctld and munge. Every command is idempotent: start leaves a running cluster alone.
# There is no accounting database (slurmdbd): `sacct` fails on this cluster (docs/scaling.md).
set -euo pipefail

CONF=${SLURM_CONF:-/etc/slurm/slurm.conf}
MARK="# trident two-node cluster on one machine, written by scripts/slurm_cluster.sh"
NODES=(n1 n2)
PORTS=(17001 17002)
STATE=/var/spool/slurmctld
LOGS=/var/log/slurm
PROLOG=$(dirname "$CONF")/trident-prolog.sh
PACKAGES=(slurmd slurmctld slurm-client munge)

die() { echo "error: $*" >&2; exit 2; }

need_root() { [ "$(id -u)" = 0 ] || die "run as root (it starts system daemons): sudo $0 $1"; }

# True when the process named in pid file $1 is alive.
alive() { [ -s "$1" ] && kill -0 "$(cat "$1")" 2>/dev/null; }

install_packages() {
  command -v slurmctld >/dev/null && command -v slurmd >/dev/null && command -v sbatch >/dev/null \
    && command -v munged >/dev/null && return
  command -v apt-get >/dev/null || die "SLURM is not installed and there is no apt-get: install ${PACKAGES[*]} yourself"
  echo "installing ${PACKAGES[*]}"
  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${PACKAGES[@]}" >/dev/null
}

write_config() {
  if [ -f "$CONF" ] && ! grep -qF "$MARK" "$CONF"; then
    die "$CONF belongs to another SLURM set-up: this script only manages its own test cluster"
  fi
  local host; host=$(hostname)
  mkdir -p "$(dirname "$CONF")"
  install -m 755 "$(dirname "$0")/slurm_prolog.sh" "$PROLOG"  # waits for a job's log directory
  cat > "$CONF.new" <<CONFIG
$MARK
ClusterName=trident
SlurmctldHost=$host(127.0.0.1)
SlurmUser=root
AuthType=auth/munge
StateSaveLocation=$STATE
SlurmctldPidFile=/run/slurmctld.pid
SlurmctldLogFile=$LOGS/slurmctld.log
# Two slurmd daemons on this host: every per-node path carries the node name (%n).
SlurmdSpoolDir=/var/spool/slurmd/%n
SlurmdPidFile=/run/slurmd-%n.pid
SlurmdLogFile=$LOGS/slurmd-%n.log
# No cgroups needed: processes are tracked by parentage, tasks are not bound to cores.
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SchedulerType=sched/builtin
MpiDefault=none
Prolog=$PROLOG
ReturnToService=2
# Seconds between SIGTERM and SIGKILL when a job is cancelled, requeued or preempted.
KillWait=30
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
NodeName=${NODES[0]} NodeHostname=$host NodeAddr=127.0.0.1 Port=${PORTS[0]} CPUs=1 State=UNKNOWN
NodeName=${NODES[1]} NodeHostname=$host NodeAddr=127.0.0.1 Port=${PORTS[1]} CPUs=1 State=UNKNOWN
PartitionName=debug Nodes=${NODES[0]},${NODES[1]} Default=YES MaxTime=INFINITE State=UP
CONFIG
  if cmp -s "$CONF.new" "$CONF"; then
    rm "$CONF.new"
  else
    mv "$CONF.new" "$CONF"
    stop_daemons  # a changed configuration needs fresh daemons
  fi
}

# The node names must resolve (Lightning's MASTER_ADDR under SLURM is the first node's name).
add_hosts() {
  local node
  for node in "${NODES[@]}"; do
    getent hosts "$node" >/dev/null || echo "127.0.0.1 $node  # scripts/slurm_cluster.sh" >> /etc/hosts
  done
}

start_munge() {
  if munge -n 2>/dev/null | unmunge >/dev/null 2>&1; then return; fi
  mkdir -p /run/munge /var/log/munge /var/lib/munge
  chown munge:munge /run/munge /var/log/munge /var/lib/munge
  [ -f /etc/munge/munge.key ] || runuser -u munge -- mungekey --create
  runuser -u munge -- /usr/sbin/munged
}

start_daemons() {
  mkdir -p "$STATE" "$LOGS"
  alive /run/slurmctld.pid || slurmctld
  local node
  for node in "${NODES[@]}"; do
    mkdir -p "/var/spool/slurmd/$node"
    alive "/run/slurmd-$node.pid" || slurmd -N "$node"
  done
}

nodes_ready() {
  [ "$(sinfo -h -N -o '%N %t' 2>/dev/null | grep -cE ' (idle|alloc|mix|comp)$')" = "${#NODES[@]}" ]
}

wait_for_nodes() {
  local i
  for i in $(seq 60); do
    nodes_ready && return
    # A node that was down when slurmctld last saw it stays down until told otherwise.
    [ $((i % 5)) = 0 ] && scontrol update NodeName="$(IFS=,; echo "${NODES[*]}")" State=RESUME 2>/dev/null || true
    sleep 1
  done
  sinfo -N >&2 || true
  die "the nodes did not come up: see $LOGS/slurmctld.log and $LOGS/slurmd-<node>.log"
}

stop_daemons() {
  local pidfile
  for pidfile in /run/slurmd-"${NODES[0]}".pid /run/slurmd-"${NODES[1]}".pid /run/slurmctld.pid; do
    if alive "$pidfile"; then
      kill "$(cat "$pidfile")"
      for _ in $(seq 20); do alive "$pidfile" || break; sleep 0.5; done
    fi
    rm -f "$pidfile"
  done
}

cancel_jobs() {
  local jobs
  jobs=$(squeue -h -o %A 2>/dev/null || true)
  [ -z "$jobs" ] && return
  # shellcheck disable=SC2086
  scancel $jobs || true
  for _ in $(seq 40); do [ -z "$(squeue -h -o %A 2>/dev/null)" ] && return; sleep 1; done
  echo "warning: jobs still listed after 40 s: $(squeue -h -o %A | tr '\n' ' ')" >&2
}

case "${1:-}" in
  start)
    need_root start
    install_packages
    write_config
    add_hosts
    start_munge
    start_daemons
    wait_for_nodes
    sinfo -N
    ;;
  stop)
    need_root stop
    if [ -f "$CONF" ] && grep -qF "$MARK" "$CONF"; then
      alive /run/slurmctld.pid && cancel_jobs
      stop_daemons
      if [ -s /run/munge/munged.pid ] && alive /run/munge/munged.pid; then kill "$(cat /run/munge/munged.pid)"; fi
    fi
    echo "stopped"
    ;;
  status)
    for pidfile in /run/slurmctld.pid /run/slurmd-"${NODES[0]}".pid /run/slurmd-"${NODES[1]}".pid; do
      if alive "$pidfile"; then echo "$(basename "$pidfile" .pid): running"; else echo "$(basename "$pidfile" .pid): stopped"; fi
    done
    nodes_ready && sinfo -N && exit 0
    echo "the cluster is not ready (start it with: sudo $0 start)"
    exit 1
    ;;
  *)
    echo "usage: $0 start|stop|status" >&2
    exit 2
    ;;
esac
