"""What the launcher says the job's size is, and a world that disagrees (launcher and MPI speaking different PMIs).

Each process of such a job would train alone; :func:`check_world_size` stops it with both numbers.
Variables read and their order: docs/internals-comm.md.
"""

from __future__ import annotations

import os
from typing import Mapping, NamedTuple, Optional

__all__ = [
    "LauncherView", "LauncherMismatchError", "launcher_view", "launcher_rank", "check_world_size", "SIZE_VARIABLES",
    "RANK_VARIABLES",
]

#: ``(variable, launcher)`` in the order they are read.
SIZE_VARIABLES = (
    ("OMPI_COMM_WORLD_SIZE", "Open MPI's mpiexec"),
    ("PMI_SIZE", "a PMI launcher (MPICH's mpiexec, srun --mpi=pmi2)"),
    ("SLURM_STEP_NUM_TASKS", "Slurm's srun"),
)

#: Each size variable's launcher's rank variable.  Read beside the size variable that won, never on its own: inside
#: an mpiexec run in a Slurm step SLURM_PROCID numbers hydra's proxies, one per node, not the ranks.
RANK_VARIABLES = {"OMPI_COMM_WORLD_SIZE": "OMPI_COMM_WORLD_RANK", "PMI_SIZE": "PMI_RANK", "SLURM_STEP_NUM_TASKS": "SLURM_PROCID"}


class LauncherView(NamedTuple):
    """How many processes the launcher started, and the variable that says so."""

    size: int
    variable: str
    launcher: str


class LauncherMismatchError(RuntimeError):
    """The launcher started another number of processes than MPI's world holds."""


def launcher_view(environ: Optional[Mapping[str, str]] = None) -> Optional[LauncherView]:
    """The launcher's job size read from ``environ``; None when no launcher set one, ``ValueError`` when malformed."""
    environ = os.environ if environ is None else environ
    for variable, launcher in SIZE_VARIABLES:
        value = environ.get(variable, "").strip()
        if not value:
            continue
        try:
            size = int(value)
        except ValueError:
            size = 0
        if size < 1:
            raise ValueError(f"{variable} must be a positive integer (the launcher's count of processes), got {value!r}")
        return LauncherView(size, variable, launcher)
    return None


def launcher_rank(environ: Optional[Mapping[str, str]] = None) -> Optional[int]:
    """This process's rank as its launcher numbered it; None when no launcher set a size.

    ``ValueError`` (naming the variable and value) when the rank variable is unset or not in ``[0, size)``.
    """
    environ = os.environ if environ is None else environ
    view = launcher_view(environ)
    if view is None:
        return None
    variable = RANK_VARIABLES[view.variable]
    value = environ.get(variable, "").strip()
    try:
        rank = int(value)
    except ValueError:
        rank = -1
    if not 0 <= rank < view.size:
        raise ValueError(
            f"{variable} must be an integer in [0, {view.size}) (the launcher's rank of this process, beside "
            f"{view.variable}={view.size}), got {value!r}"
        )
    return rank


def check_world_size(mpi_size: int, environ: Optional[Mapping[str, str]] = None) -> Optional[LauncherView]:
    """Raise :class:`LauncherMismatchError` when the launcher started another number of processes than ``mpi_size``.

    ``mpi_size`` is the size of ``MPI.COMM_WORLD``.  Returns the launcher's view when it agrees, None when none said.
    """
    view = launcher_view(environ)
    if view is None or view.size == mpi_size:
        return view
    raise LauncherMismatchError(
        f"{view.launcher} started {view.size} processes ({view.variable}={view.size}), but MPI's world has "
        f"{mpi_size} rank{'s' if mpi_size != 1 else ''}: the launcher and the MPI library do not share a "
        "process-management interface (PMI), so each process would train on its own.\n"
        "  Under Slurm, give srun the PMI of mpi4py's MPI: srun --mpi=pmi2 for MPICH (the mpich wheel, Intel MPI), "
        "srun --mpi=pmix for Open MPI (srun --mpi=list shows the cluster's; jobs/*.sbatch take SRUN_MPI).\n"
        "  With mpiexec, use the mpiexec of the MPI that mpi4py uses, which this names:\n"
        '  python -c "from mpi4py import MPI; print(MPI.Get_library_version())"'
    )
