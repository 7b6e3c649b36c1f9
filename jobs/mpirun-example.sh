#!/bin/bash
# Without Slurm: mpirun/mpiexec across hosts listed in a hostfile.
#   jobs/mpirun-example.sh hosts.txt 16
set -euo pipefail
hostfile=${1:?usage: $0 HOSTFILE NRANKS}
ranks=${2:?usage: $0 HOSTFILE NRANKS}
# MPICH/Hydra syntax; with Open MPI use: mpirun --hostfile "$hostfile" -np "$ranks"
mpiexec -f "$hostfile" -n "$ranks" python -m mpiopt info
