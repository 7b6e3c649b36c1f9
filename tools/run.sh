#!/usr/bin/env bash
# Set up (tools/setup.sh) and run the main job on this machine: every algorithm
# trained on the offline 8x8 digits at 4 MPI ranks in 2 groups of 2 (emulated
# nodes), compared in one table with plots.  Extra arguments go to
# `python -m mpiopt compare` (e.g. --algorithms sgd,lsgd --epochs 40).
set -euo pipefail
cd "$(dirname "$0")/.."
source tools/setup.sh
ranks="${MPIOPT_RANKS:-4}"
echo "== mpiexec -n $ranks python -m mpiopt compare --group-size 2 $*"
exec mpiexec -n "$ranks" python -m mpiopt compare --group-size 2 "$@"
