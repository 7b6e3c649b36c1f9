"""This process's MPI: the library, the host and the place in the world, asked before or beside a :class:`Topology`.

For the headers of results, checkpoints and metrics, and for the command line's checks that run before any
communicator exists (is this an MPI job at all, which rank prints the help).  Nothing here communicates.
"""

from __future__ import annotations

from mpi4py import MPI

__all__ = ["library_version", "host", "world_rank", "world_size", "thread_level"]


def library_version() -> str:
    """The MPI library's name and version: the first line of ``MPI_Get_library_version``, blanks collapsed.

    Open MPI 4.1's string ends in a NUL character, which is dropped (an HDF5 attribute holding one is stored as
    JSON text).
    """
    return " ".join(MPI.Get_library_version().replace("\0", " ").splitlines()[0].split())


def host() -> str:
    """This process's host as MPI names it (``MPI_Get_processor_name``)."""
    return MPI.Get_processor_name()


def world_rank() -> int:
    """This process's rank in ``MPI.COMM_WORLD``."""
    return MPI.COMM_WORLD.Get_rank()


def world_size() -> int:
    """The number of processes in ``MPI.COMM_WORLD``: 1 for a process started without a launcher."""
    return MPI.COMM_WORLD.Get_size()


def thread_level() -> int:
    """The thread support MPI was initialised with (``MPI_Query_thread``: 0 single ... 3 multiple)."""
    return MPI.Query_thread()
