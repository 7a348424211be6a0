#!/usr/bin/env bash
# A private single-node SLURM cluster for tests: `cluster.sh start DIR` writes DIR/slurm.conf,
# starts munged, slurmctld and slurmd, all with their sockets, state and logs inside DIR, and
# waits until the node is idle; `cluster.sh stop DIR` stops them. Use it with
# `export SLURM_CONF=DIR/slurm.conf`. It leaves the machine's own munge and SLURM alone.
set -euo pipefail
command="${1:?usage: cluster.sh start|stop DIR}"
dir="$(realpath -m "${2:?usage: cluster.sh start|stop DIR}")"

stop() {
    # Cancel this cluster's jobs first, so no job step outlives its slurmd.
    if [ -f "$dir/slurm.conf" ] && [ -f "$dir/slurmctld.pid" ]; then
        SLURM_CONF="$dir/slurm.conf" timeout 10 scancel --quiet --user="$(id -un)" 2>/dev/null || true
        sleep 1
    fi
    for name in slurmd slurmctld munged; do
        if [ -f "$dir/$name.pid" ]; then
            kill "$(cat "$dir/$name.pid")" 2>/dev/null || true
        fi
    done
    sleep 1
    for name in slurmd slurmctld munged; do
        if [ -f "$dir/$name.pid" ]; then
            kill -9 "$(cat "$dir/$name.pid")" 2>/dev/null || true
            rm -f "$dir/$name.pid"
        fi
    done
    # Daemons whose pid file is gone are found by this cluster's files on their command line.
    pkill -9 -f -- "-f $dir/slurm.conf" 2>/dev/null || true
    pkill -9 -f -- "--socket=$dir/munge/socket" 2>/dev/null || true
}

free_ports() {  # two distinct free ports, both held until both are known
    python3 -c 'import socket
socks = [socket.socket() for _ in range(2)]
for s in socks:
    s.bind(("127.0.0.1", 0))
print(*(s.getsockname()[1] for s in socks))'
}

if [ "$command" = stop ]; then
    stop
    exit 0
fi
[ "$command" = start ] || { echo "usage: cluster.sh start|stop DIR" >&2; exit 2; }
for tool in munged slurmctld slurmd sinfo; do
    command -v "$tool" >/dev/null || { echo "cluster.sh: $tool not found (scripts/slurm/install.sh)" >&2; exit 3; }
done

mkdir -p "$dir/state" "$dir/spool" "$dir/munge"
chmod 700 "$dir/munge"
dd if=/dev/urandom of="$dir/munge/munge.key" bs=1024 count=1 status=none
chmod 400 "$dir/munge/munge.key"
trap 'stop' ERR
munged --force --socket="$dir/munge/socket" --key-file="$dir/munge/munge.key" \
    --pid-file="$dir/munged.pid" --log-file="$dir/munged.log" --seed-file="$dir/munge/seed"

node="$(hostname -s)"
read -r controller_port node_port < <(free_ports)
cpus="$(nproc)"
memory_mb="$(awk '/MemTotal/ {print int($2 / 1024 * 0.9)}' /proc/meminfo)"
cat >"$dir/slurm.conf" <<CONF
ClusterName=lmuscale-test
SlurmctldHost=$node(127.0.0.1)
SlurmctldPort=$controller_port
SlurmdPort=$node_port
SlurmUser=$(id -un)
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket=$dir/munge/socket
StateSaveLocation=$dir/state
SlurmdSpoolDir=$dir/spool
SlurmctldPidFile=$dir/slurmctld.pid
SlurmdPidFile=$dir/slurmd.pid
SlurmctldLogFile=$dir/slurmctld.log
SlurmdLogFile=$dir/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
SchedulerType=sched/builtin
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
ReturnToService=2
MpiDefault=none
NodeName=$node NodeAddr=127.0.0.1 CPUs=$cpus RealMemory=$memory_mb State=UNKNOWN
PartitionName=test Nodes=ALL Default=YES MaxTime=INFINITE State=UP
CONF
export SLURM_CONF="$dir/slurm.conf"
slurmctld -f "$dir/slurm.conf"
slurmd -f "$dir/slurm.conf" -N "$node"
for _ in $(seq 60); do
    state="$(sinfo -h -n "$node" -o %t 2>/dev/null || true)"
    if [ "$state" = idle ]; then
        echo "cluster.sh: node $node idle; export SLURM_CONF=$dir/slurm.conf"
        exit 0
    fi
    sleep 0.5
done
echo "cluster.sh: the node did not become idle (state '${state:-?}'); logs in $dir" >&2
tail -20 "$dir/slurmctld.log" "$dir/slurmd.log" >&2 || true
stop
exit 1
