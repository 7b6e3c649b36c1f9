#!/usr/bin/env bash
# Demonstrate the checkpoint module's parallel-HDF5 (h5py "mpio" driver) path.
#
# Builds, once, a separate virtual environment (default /tmp/ph5/venv; never the
# project's .venv) with h5py compiled against Debian's MPICH build of HDF5 and
# mpi4py compiled against the same Debian MPICH, then runs
# tests/mpi/test_checkpoint_mpio.py and test_checkpoint.py (mpio is then the default writer) at 2 and 4 ranks with Debian's mpiexec.
#
# Needs root (apt-get installs libhdf5-mpich-dev) and network access to the
# Debian mirror and PyPI; Debian 12 (bookworm) tested.  Idempotent: a venv whose
# h5py already reports MPI is reused.
#
# Usage: tools/parallel_hdf5.sh [pytest args...]      PH5_VENV=/path overrides the venv.
set -euo pipefail

repo=$(cd "$(dirname "$0")/.." && pwd)
venv=${PH5_VENV:-/tmp/ph5/venv}
python=${PYTHON:-python3}
# The versions the project's own venv uses (its constraints file), so that the two differ only in the MPI build.
export PIP_CONSTRAINT="$repo/constraints.txt"

if ! { [ -x "$venv/bin/python" ] && "$venv/bin/python" -c 'import h5py, sys; sys.exit(not h5py.get_config().mpi)' 2>/dev/null; }; then
    if [ "$(id -u)" != 0 ]; then
        echo "parallel_hdf5.sh: building the environment needs root (apt-get install libhdf5-mpich-dev)" >&2
        exit 1
    fi
    if ! dpkg -s libhdf5-mpich-dev mpich >/dev/null 2>&1; then
        apt-get update
        DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends libhdf5-mpich-dev libmpich-dev mpich pkg-config
    fi
    "$python" -m venv "$venv"
    # h5py's build needs setuptools >= 77 (SPDX license field); a new venv may bring an older one (the constraints pin a newer).
    "$venv/bin/pip" install --quiet --upgrade pip setuptools wheel
    "$venv/bin/pip" install --quiet numpy "Cython>=3" pkgconfig pytest pytest-mpi pytest-timeout
    # mpi4py from source against Debian's MPICH (not the PyPI mpich wheel): h5py's MPI must be the same library.
    MPICC=/usr/bin/mpicc.mpich "$venv/bin/pip" install --quiet --no-binary=mpi4py --no-build-isolation mpi4py
    HDF5_MPI=ON CC=/usr/bin/mpicc.mpich HDF5_PKGCONFIG_NAME=hdf5-mpich \
        "$venv/bin/pip" install --quiet --no-binary=h5py --no-build-isolation h5py
    "$venv/bin/python" -c 'import h5py, sys; sys.exit(not h5py.get_config().mpi)' \
        || { echo "parallel_hdf5.sh: h5py in $venv was built without MPI" >&2; exit 1; }
fi

"$venv/bin/python" -c 'import h5py, mpi4py; from mpi4py import MPI
print(f"h5py {h5py.__version__} (HDF5 {h5py.version.hdf5_version}, mpi={h5py.get_config().mpi}), mpi4py {mpi4py.__version__}:",
      MPI.Get_library_version().splitlines()[0])'

cd "$repo"
export PYTHONPATH="$repo${PYTHONPATH:+:$PYTHONPATH}"
for n in 2 4; do
    echo "== $n ranks =="
    # --oversubscribe is not needed by MPICH's hydra: it runs more ranks than cores.
    /usr/bin/mpiexec.mpich -n "$n" "$venv/bin/python" tools/run_mpi_pytest.py -q tests/mpi/test_checkpoint_mpio.py tests/mpi/test_checkpoint.py "$@"
done
