#!/usr/bin/env bash
# A private one-node Slurm on this machine, for testing the job templates (tests/e2e/test_slurm.py).
#
#   tools/slurm_cluster.sh COMMAND [ARGS...]   start it, run COMMAND with SLURM_CONF set, stop it
#   tools/slurm_cluster.sh                     start it, print "slurm_cluster: ready SLURM_CONF=...", wait for
#                                              SIGTERM or SIGINT, stop it
#
# Needs root and Debian's packages slurm-wlm and munge (slurmctld, slurmd, munged); nothing of the system's own
# Slurm or munge configuration is read or changed: the key, slurm.conf, state, logs and sockets live in a temporary
# folder (SLURM_CLUSTER_DIR to pick it; kept for reading the logs, removed when the script made it).  The cluster
# is a default Slurm in the ways that matter to the templates: MpiDefault=none (no PMI unless srun asks for
# one), task/none (no CPU binding) and proctrack/linuxproc (no cgroup.conf).  SLURM_CLUSTER_CPUS (default 8) CPUs
# are declared whatever the machine has (SlurmdParameters=config_overrides), so that a 4-rank job fits on 2 cores.
# Everything started here is stopped on exit, also on failure: jobs are cancelled, then the daemons and any
# process left over from a job (found by the SLURM_CONF in its environment) are killed.
set -euo pipefail

for tool in munged slurmctld slurmd sbatch squeue scancel; do
    command -v "$tool" >/dev/null || { echo "slurm_cluster: $tool not found (Debian: apt-get install slurm-wlm munge)" >&2; exit 2; }
done
[[ $(id -u) == 0 ]] || { echo "slurm_cluster: needs root (slurmd starts jobs as their users), running as uid $(id -u)" >&2; exit 2; }

made_dir=
if [[ -z ${SLURM_CLUSTER_DIR-} ]]; then
    SLURM_CLUSTER_DIR=$(mktemp -d /tmp/mpiopt-slurm.XXXXXX)
    made_dir=1
fi
dir=$(cd "$SLURM_CLUSTER_DIR" && pwd)
chmod 755 "$dir"  # munged wants its socket's folders open to all
mkdir -p "$dir/state" "$dir/spool" "$dir/log"
export SLURM_CONF="$dir/slurm.conf"
pids=()

stop() {
    local status=$?
    trap - EXIT INT TERM
    if [[ -n ${ctld_started-} ]]; then
        scancel --quiet --full --user="$(id -un)" 2>/dev/null || true
        for _ in $(seq 50); do  # up to 10 s for the jobs to end
            [[ -z $(squeue --noheader 2>/dev/null) ]] && break
            sleep 0.2
        done
    fi
    kill "${pids[@]}" 2>/dev/null || true
    wait "${pids[@]}" 2>/dev/null || true
    # Job processes outlive slurmd (slurmstepd re-parents them): they carry our SLURM_CONF.
    local env_file pid
    for env_file in /proc/[0-9]*/environ; do
        pid=${env_file#/proc/}; pid=${pid%/environ}
        [[ $pid == "$$" ]] && continue
        if { tr '\0' '\n' <"$env_file"; } 2>/dev/null | grep -qxF "SLURM_CONF=$SLURM_CONF"; then
            kill -9 "$pid" 2>/dev/null || true
        fi
    done
    if [[ -n $made_dir && $status == 0 ]]; then rm -rf "$dir"; fi
    exit "$status"
}
trap stop EXIT
trap 'exit 143' TERM
trap 'exit 130' INT

free_port() { python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'; }
host=$(hostname -s)

# ---- munge: a fresh key and a socket of our own ----------------------------------------------------------------
head -c 1024 /dev/urandom >"$dir/munge.key"
chmod 400 "$dir/munge.key"
munged --foreground --force --key-file="$dir/munge.key" --socket="$dir/munge.socket" \
    --pid-file="$dir/munged.pid" --log-file="$dir/log/munged.log" --seed-file="$dir/munged.seed" &
pids+=($!)

# ---- slurm.conf ----------------------------------------------------------------------------------------------
cat >"$SLURM_CONF" <<EOF
ClusterName=mpiopt-test
SlurmctldHost=$host(127.0.0.1)
SlurmctldPort=$(free_port)
SlurmdPort=$(free_port)
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
# cred_expire: how long a requeued job waits before it may start again (default 120 s).  Starting it sooner
# (scontrol update StartTime=now) races the revoked credential: "Killing non-startable batch job".
AuthInfo=socket=$dir/munge.socket,cred_expire=30
StateSaveLocation=$dir/state
SlurmdSpoolDir=$dir/spool
SlurmctldPidFile=$dir/slurmctld.pid
SlurmdPidFile=$dir/slurmd.pid
SlurmctldLogFile=$dir/log/slurmctld.log
SlurmdLogFile=$dir/log/slurmd.log
# Slurm's defaults where a site may not have more: no PMI unless asked, no binding, no cgroups.
MpiDefault=none
TaskPlugin=task/none
ProctrackType=proctrack/linuxproc
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
SwitchType=switch/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SlurmdParameters=config_overrides
ReturnToService=2
MailProg=/bin/true
KillWait=5
NodeName=$host NodeAddr=127.0.0.1 CPUs=${SLURM_CLUSTER_CPUS:-8} State=UNKNOWN
PartitionName=debug Nodes=$host Default=YES MaxTime=INFINITE State=UP
EOF

for _ in $(seq 50); do [[ -S $dir/munge.socket ]] && break; sleep 0.1; done
slurmctld -D -i -f "$SLURM_CONF" >>"$dir/log/slurmctld.out" 2>&1 &
pids+=($!)
ctld_started=1
slurmd -D -N "$host" -f "$SLURM_CONF" >>"$dir/log/slurmd.out" 2>&1 &
pids+=($!)

# Ready once the node takes jobs.
ready=
for _ in $(seq 150); do  # up to 30 s
    if [[ $(sinfo --noheader --nodes="$host" --format=%t 2>/dev/null) == idle ]]; then ready=1; break; fi
    sleep 0.2
done
if [[ -z $ready ]]; then
    echo "slurm_cluster: the node did not become idle within 30 s; logs in $dir/log:" >&2
    tail -n 20 "$dir"/log/*.log >&2 || true
    made_dir=  # keep the logs
    exit 1
fi

if (($#)); then
    "$@"
else
    trap 'exit 0' TERM INT  # the awaited way to stop: the temporary folder goes too
    echo "slurm_cluster: ready SLURM_CONF=$SLURM_CONF"
    while :; do sleep 1; done
fi
