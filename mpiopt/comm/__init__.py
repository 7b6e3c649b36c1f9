"""Communication layer: every byte mpiopt sends goes through here.

:class:`Comm` records every call in a :class:`Ledger`; :class:`Topology` holds the world, group (node) and
leaders communicators; :func:`abort_on_exception` makes an exception on one rank end the job; with
``Topology(on_failure="shrink")`` a lost rank raises :class:`RankLost` on the survivors, who go on (docs/failures.md).
Conventions and environment variables: docs/internals-comm.md.
"""

from .abort import ABORT_ENV, OtherRankError, abort_job, abort_on_exception
from .buffers import gpu_aware_mpi, is_gpu_array, nbytes
from .communicator import ANY_SOURCE, ANY_TAG, MAX, MIN, SUM, Comm, Request, SetupMismatchError
from .ledger import Ledger, OpStats
from .staging import CHUNK_ENV as STAGING_CHUNK_ENV, GpuPath
from .survival import IslandLeft, PeerLost, RankLost
from .topology import GROUP_SIZE_ENV, Recovery, Topology

__all__ = [
    "Comm",
    "Request",
    "Topology",
    "RankLost",
    "IslandLeft",
    "PeerLost",
    "Recovery",
    "Ledger",
    "OpStats",
    "SetupMismatchError",
    "abort_on_exception",
    "abort_job",
    "OtherRankError",
    "ABORT_ENV",
    "gpu_aware_mpi",
    "is_gpu_array",
    "nbytes",
    "SUM",
    "MAX",
    "MIN",
    "ANY_SOURCE",
    "ANY_TAG",
    "GROUP_SIZE_ENV",
    "STAGING_CHUNK_ENV",
    "GpuPath",
]
