#!/bin/bash
# Without Slurm: compare algorithms on the same task with a plain mpiexec.
#   jobs/mpirun-example.sh        # 4 ranks on this machine
#   jobs/mpirun-example.sh 8      # 8 ranks
# Across hosts, give the launcher a host list: MPICH (Hydra) `mpiexec -f hosts.txt -n 16 ...`,
# Open MPI `mpirun --hostfile hosts.txt -np 16 ...`, and drop --group-size: the groups are the hosts.
set -euo pipefail
ranks=${1:-4}
out=${OUT:-runs/compare-mpirun}

# --group-size 2 emulates nodes of 2 ranks on one machine (LSGD's local leaders, signum's pre-vote).
mpiexec -n "$ranks" python -m mpiopt compare --algorithms sgd,lsgd,signum,topk --steps 200 --group-size 2 --out "$out"
