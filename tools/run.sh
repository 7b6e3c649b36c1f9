#!/usr/bin/env bash
# Set up (tools/setup.sh) and run the main job on this machine: 4 MPI ranks,
# emulating 2 nodes of 2 ranks.  Extra arguments go to `python -m mpiopt info`.
set -euo pipefail
cd "$(dirname "$0")/.."
source tools/setup.sh
ranks="${MPIOPT_RANKS:-4}"
echo "== mpiexec -n $ranks python -m mpiopt info --group-size 2 $*"
exec mpiexec -n "$ranks" python -m mpiopt info --group-size 2 "$@"
