"""mpiopt.comm.launcher: the launcher's count of processes, read from the environment alone (no MPI)."""

from __future__ import annotations

import pytest

from mpiopt.comm.launcher import LauncherMismatchError, LauncherView, check_world_size, launcher_rank, launcher_view

# What each launcher puts in a process's environment (as seen under Slurm 22.05, MPICH's hydra, Open MPI 5).
SRUN_TASK = {"SLURM_JOB_ID": "7", "SLURM_NTASKS": "4", "SLURM_PROCID": "2", "SLURM_STEP_ID": "0", "SLURM_STEP_NUM_TASKS": "4"}
BATCH_SCRIPT = {"SLURM_JOB_ID": "7", "SLURM_NTASKS": "4", "SLURM_NPROCS": "4", "SLURM_PROCID": "0", "SLURM_LOCALID": "0"}
HYDRA = {"PMI_RANK": "1", "PMI_SIZE": "4"}
OPEN_MPI = {"OMPI_COMM_WORLD_RANK": "1", "OMPI_COMM_WORLD_SIZE": "4", "PMIX_RANK": "1"}


@pytest.mark.parametrize(
    "environ, expected",
    [
        ({}, None),
        (SRUN_TASK, ("SLURM_STEP_NUM_TASKS", 4)),
        (HYDRA, ("PMI_SIZE", 4)),
        (OPEN_MPI, ("OMPI_COMM_WORLD_SIZE", 4)),
        # srun --mpi=pmi2 sets both, and they agree
        (dict(SRUN_TASK, PMI_RANK="2", PMI_SIZE="4"), ("PMI_SIZE", 4)),
        # The batch script of sbatch (or an salloc shell) is no step task: a one-process python there is right.
        (BATCH_SCRIPT, None),
        # mpiexec inside an allocation, its proxies started by a one-task srun per node: the MPI launcher's count wins.
        (dict(SRUN_TASK, SLURM_STEP_NUM_TASKS="1", PMI_SIZE="8"), ("PMI_SIZE", 8)),
        (dict(BATCH_SCRIPT, OMPI_COMM_WORLD_SIZE="8"), ("OMPI_COMM_WORLD_SIZE", 8)),
        ({"PMI_SIZE": " ", "SLURM_STEP_NUM_TASKS": "3"}, ("SLURM_STEP_NUM_TASKS", 3)),  # blank is unset
    ],
    ids=["none", "srun", "hydra", "open-mpi", "srun-pmi2", "batch-script", "mpiexec-in-slurm", "mpirun-in-batch", "blank"],
)
def test_launcher_view(environ, expected):
    view = launcher_view(environ)
    assert (None if view is None else (view.variable, view.size)) == expected


@pytest.mark.parametrize("value", ["0", "-2", "four", "2.5"])
def test_a_bad_count_is_an_error_naming_it(value):
    with pytest.raises(ValueError, match=rf"PMI_SIZE must be a positive integer .*got '{value}'"):
        launcher_view({"PMI_SIZE": value})


@pytest.mark.parametrize(
    "environ, expected",
    [
        ({}, None),
        (SRUN_TASK, 2),
        (HYDRA, 1),
        (OPEN_MPI, 1),
        (BATCH_SCRIPT, None),  # SLURM_PROCID outside a step is no rank of a job
        # mpiexec inside an allocation: SLURM_PROCID=2 numbers the proxies; the MPI launcher's rank counts.
        (dict(SRUN_TASK, SLURM_STEP_NUM_TASKS="1", PMI_SIZE="8", PMI_RANK="5"), 5),
    ],
    ids=["none", "srun", "hydra", "open-mpi", "batch-script", "mpiexec-in-slurm"],
)
def test_launcher_rank_is_read_beside_the_size(environ, expected):
    assert launcher_rank(environ) == expected


@pytest.mark.parametrize("value", ["", "4", "-1", "one"])
def test_a_bad_or_missing_rank_is_an_error_naming_it(value):
    with pytest.raises(ValueError, match=rf"PMI_RANK must be an integer in \[0, 4\) .*beside PMI_SIZE=4\), got '{value}'"):
        launcher_rank({"PMI_SIZE": "4", "PMI_RANK": value})


def test_agreement_passes_and_returns_the_view():
    assert check_world_size(4, SRUN_TASK) == LauncherView(4, "SLURM_STEP_NUM_TASKS", "Slurm's srun")
    assert check_world_size(1, BATCH_SCRIPT) is None
    assert check_world_size(3, {}) is None  # no launcher said (a spawned world, a launcher we do not read)


@pytest.mark.parametrize("environ, variable", [(SRUN_TASK, "SLURM_STEP_NUM_TASKS"), (HYDRA, "PMI_SIZE"), (OPEN_MPI, "OMPI_COMM_WORLD_SIZE")])
def test_a_world_of_one_under_a_launcher_of_four_is_refused_naming_both_and_the_fix(environ, variable):
    with pytest.raises(LauncherMismatchError) as caught:
        check_world_size(1, environ)
    text = str(caught.value)
    assert f"started 4 processes ({variable}=4), but MPI's world has 1 rank:" in text
    for fix in ("srun --mpi=pmi2", "srun --mpi=pmix", "the mpiexec of the MPI that mpi4py uses",
                'python -c "from mpi4py import MPI; print(MPI.Get_library_version())"'):
        assert fix in text


def test_any_other_size_is_refused_too():
    with pytest.raises(LauncherMismatchError, match=r"started 4 processes \(PMI_SIZE=4\), but MPI's world has 2 ranks"):
        check_world_size(2, HYDRA)
