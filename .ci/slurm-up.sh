#!/usr/bin/env bash
# Bring up a single-node Slurm cluster on this host (munged + slurmctld + slurmd), as root.
# Idempotent: installs Debian's slurm-wlm and munge when missing, rewrites the config, and
# (re)starts the daemons only when they are not already answering. Exits 0 once `sinfo`
# shows the node idle; non-zero with a message on stderr otherwise.
#
# No systemd or cgroups are assumed (containers): processes are tracked by their parent
# chain (proctrack/linuxproc: it also finds torchrun's workers, which run in sessions of
# their own), tasks are not bound, and there is no slurmdbd. Finished jobs are recorded by
# jobcomp/filetxt, which `sacct --completion` reads.
set -euo pipefail

SLURM_STATE=/var/spool/slurm-dmuon
CONF=/etc/slurm/slurm.conf
JOBCOMP_LOG=/var/log/slurm/jobcomp.log

die() { echo "slurm-up: $*" >&2; exit 1; }

[ "$(id -u)" = 0 ] || die "must run as root (it installs packages and starts daemons)"

# One run at a time (parallel test workers may all call this).
# The daemons started below must not inherit fd 9: they would hold the lock for as long as
# they run, and every later call would wait on it forever.
exec 9>/run/dmuon-slurm-up.lock
flock -w 300 9 || die "another slurm-up.sh has held /run/dmuon-slurm-up.lock for 300 s"

if ! command -v slurmctld >/dev/null || ! command -v munged >/dev/null; then
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -q
    apt-get install -y -q --no-install-recommends slurm-wlm munge
fi

node="$(hostname -s)"
cpus="$(nproc)"
mem_mb=$(( $(awk '/MemTotal/ {print $2}' /proc/meminfo) / 1024 ))

mkdir -p /etc/slurm /var/log/slurm "$SLURM_STATE/ctld" "$SLURM_STATE/d" /run/munge
cat > "$CONF.new" <<CONFEOF
# Written by .ci/slurm-up.sh: a one-node cluster for the job service's Slurm tests.
ClusterName=dmuon
SlurmctldHost=${node}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
StateSaveLocation=${SLURM_STATE}/ctld
SlurmdSpoolDir=${SLURM_STATE}/d
SlurmctldPidFile=/run/slurmctld.pid
SlurmdPidFile=/run/slurmd.pid
SlurmctldLogFile=/var/log/slurm/slurmctld.log
SlurmdLogFile=/var/log/slurm/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SchedulerType=sched/backfill
SchedulerParameters=sched_interval=2
MpiDefault=none
ReturnToService=2
SlurmctldTimeout=30
SlurmdTimeout=60
KillWait=10
MinJobAge=300
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/filetxt
JobCompLoc=${JOBCOMP_LOG}
NodeName=${node} NodeAddr=127.0.0.1 CPUs=${cpus} RealMemory=${mem_mb} State=UNKNOWN
PartitionName=debug Nodes=${node} Default=YES MaxTime=INFINITE State=UP
CONFEOF

config_changed=1
if [ -f "$CONF" ] && cmp -s "$CONF" "$CONF.new"; then config_changed=0; fi
mv "$CONF.new" "$CONF"
touch "$JOBCOMP_LOG"

if [ ! -s /etc/munge/munge.key ]; then
    dd if=/dev/urandom bs=1 count=1024 of=/etc/munge/munge.key status=none
fi
chown -R munge:munge /etc/munge /run/munge /var/lib/munge /var/log/munge 2>/dev/null || true
chmod 0400 /etc/munge/munge.key
if ! munge -n </dev/null 2>/dev/null | unmunge >/dev/null 2>&1; then
    runuser -u munge -- /usr/sbin/munged --force 9>&-
    for _ in $(seq 50); do munge -n </dev/null 2>/dev/null | unmunge >/dev/null 2>&1 && break; sleep 0.2; done
    munge -n </dev/null 2>/dev/null | unmunge >/dev/null 2>&1 || die "munged did not start"
fi

# shellcheck source=daemons.sh
source "$(dirname "${BASH_SOURCE[0]}")/daemons.sh"
if [ "$config_changed" = 1 ]; then  # plugins change only with a restart
    stop /run/slurmd.pid slurmd
    stop /run/slurmctld.pid slurmctld
fi
running /run/slurmctld.pid slurmctld || { rm -f /run/slurmctld.pid; slurmctld 9>&-; }
running /run/slurmd.pid slurmd || { rm -f /run/slurmd.pid; slurmd 9>&-; }

state=""
for _ in $(seq 60); do
    state="$(timeout 5 sinfo --noheader --nodes="$node" --format=%T 2>/dev/null || true)"
    case "$state" in
        idle|mixed|allocated) exit 0 ;;
        down*|drain*) scontrol update NodeName="$node" State=RESUME >/dev/null 2>&1 || true ;;
    esac
    sleep 1
done
echo "slurm-up: node ${node} is '${state:-unknown}', not idle; last log lines:" >&2
tail -n 20 /var/log/slurm/slurmctld.log /var/log/slurm/slurmd.log >&2 || true
exit 1
