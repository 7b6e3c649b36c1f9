"""What the launcher says the job's size is, and a world that disagrees.

A launcher (``srun``, ``mpiexec``) that starts N processes tells MPI about
them through a process-management interface (PMI).  When the two do not
speak the same one, say ``srun`` on a Slurm whose ``MpiDefault`` is ``none``,
or the ``mpiexec`` of one MPI with mpi4py built against another, every
process starts as an MPI world of one and trains alone, all of them writing
the same files.  The launcher's own environment variables still say N, and
:func:`check_world_size` (called by :class:`~mpiopt.comm.Topology` before it
communicates) stops each process with a message naming both numbers.

Which variables (the first one set wins):

- ``OMPI_COMM_WORLD_SIZE``: Open MPI's ``mpirun``/``mpiexec`` (and prterun);
- ``PMI_SIZE``: a PMI-1/PMI-2 launcher: MPICH's hydra ``mpiexec``, Intel
  MPI's, ``srun --mpi=pmi2``;
- ``SLURM_STEP_NUM_TASKS``: a task of a Slurm job step (``srun``).  Only the
  step's variable counts: ``SLURM_NTASKS`` is also set in the batch script
  of an ``sbatch``/``salloc`` allocation, where a one-process ``python`` is
  no step task and is right to see a world of one.

The MPI launchers' variables come first: an ``mpiexec`` inside a Slurm step
(hydra starts its proxies with ``srun``, one per node) gives its processes
the proxies' step variables too, which count nodes, not ranks.  PMIx sets
no size variable (``srun --mpi=pmix`` is covered by Slurm's).

:func:`launcher_rank` reads this process's rank from the variable that the
same launcher sets beside its size (:data:`RANK_VARIABLES`), for what one
process should do alone before MPI's world is trusted (print ``--help``).
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
    """The launcher's job size read from ``environ`` (default ``os.environ``); None when no launcher set one.

    Raises
    ------
    ValueError
        When the variable read is set to something other than a positive
        integer (naming the variable and its value).
    """
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
    """This process's rank as its launcher numbered it, read from ``environ`` (default ``os.environ``).

    Returns
    -------
    int or None
        The rank, from the rank variable of the launcher :func:`launcher_view`
        reads; None when no launcher set a size.

    Raises
    ------
    ValueError
        When the size variable is malformed (see :func:`launcher_view`), or
        the rank variable beside it is unset or not an integer in
        ``[0, size)`` (naming the variable and its value).
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

    Parameters
    ----------
    mpi_size : int
        The size of ``MPI.COMM_WORLD`` (not of a communicator the caller
        split from it).
    environ : mapping, optional
        The environment to read (default ``os.environ``).

    Returns
    -------
    LauncherView or None
        The launcher's view when it agrees, None when no launcher said.
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
