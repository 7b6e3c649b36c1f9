"""``Topology``: the world, its groups (nodes) and the group leaders.

Groups are the nodes of the allocation by default, asked of MPI with
``Split_type(COMM_TYPE_SHARED)`` (never guessed from rank arithmetic).  To
emulate nodes of ``k`` ranks on one machine, pass ``group_size=k`` or set
``MPIOPT_GROUP_SIZE=k``: ranks ``0..k-1`` form group 0, ``k..2k-1`` group 1,
and the last group holds what is left (``-n 3`` with ``k = 2`` gives {0, 1}
and {2}).  Rank 0 of each group is its leader; the leaders' communicator
joins them (it is None on the other ranks).
"""

from __future__ import annotations

import os
from typing import Any, Dict, Optional

from mpi4py import MPI

from .communicator import Comm
from .ledger import Ledger

__all__ = ["Topology", "GROUP_SIZE_ENV"]

GROUP_SIZE_ENV = "MPIOPT_GROUP_SIZE"


def _group_size_from(value: Any, source: str) -> Optional[int]:
    if value is None or (isinstance(value, str) and not value.strip()):
        return None
    try:
        size = int(value)
    except (TypeError, ValueError):
        raise ValueError(f"{source} must be a positive integer, got {value!r}") from None
    if size < 1 or (isinstance(value, float) and value != size):
        raise ValueError(f"{source} must be a positive integer, got {value!r}")
    return size


class Topology:
    """World, group and leaders communicators sharing one ledger.

    Parameters
    ----------
    comm : mpi4py.MPI.Intracomm, optional
        The job's communicator (default ``MPI.COMM_WORLD``); duplicated.
    group_size : int, optional
        Ranks per emulated node.  Default: the environment variable
        ``MPIOPT_GROUP_SIZE``, else the real nodes.
    gpu_aware : bool, optional
        Override the detection of GPU-aware MPI (see
        :func:`mpiopt.comm.buffers.gpu_aware_mpi`).

    Attributes
    ----------
    world, group : Comm
        All ranks; the ranks of this rank's group.
    leaders : Comm or None
        Rank 0 of every group; None on the other ranks.
    group_index, num_groups : int
        This rank's group (numbered by the world rank of its leader) and the
        number of groups.
    ledger : Ledger
        Shared by the three communicators.
    """

    def __init__(
        self,
        comm: Optional[MPI.Intracomm] = None,
        *,
        group_size: Optional[int] = None,
        gpu_aware: Optional[bool] = None,
    ) -> None:
        self.ledger = Ledger()
        self.world = Comm(comm, name="world", ledger=self.ledger, gpu_aware=gpu_aware)
        size = _group_size_from(group_size, "group_size")
        if size is None:
            size = _group_size_from(os.environ.get(GROUP_SIZE_ENV), GROUP_SIZE_ENV)
        self.world.agree({"group_size": size}, what="group size")
        self.group_size_setting = size
        if size is None:
            self.group = self.world.Split_shared("group")
        else:
            self.group = self.world.Split(self.world.rank // size, self.world.rank, "group")
        is_leader = self.group.rank == 0
        self.leaders = self.world.Split(0 if is_leader else -1, self.world.rank, "leaders")
        # Group index = the leader's rank among the leaders, told to the group.
        self.group_index = self.group.bcast_obj(self.leaders.rank if is_leader else None)
        self.num_groups = self.group.bcast_obj(self.leaders.size if is_leader else None)
        self.ledger.reset()  # set-up traffic is not the algorithms'

    @property
    def rank(self) -> int:
        return self.world.rank

    @property
    def size(self) -> int:
        return self.world.size

    @property
    def is_leader(self) -> bool:
        return self.leaders is not None

    @property
    def gpu_aware(self) -> bool:
        return self.world.gpu_aware

    def describe(self) -> Dict[str, Any]:
        """This rank's place in the topology, as plain data."""
        return {
            "world_rank": self.world.rank,
            "world_size": self.world.size,
            "group_index": self.group_index,
            "num_groups": self.num_groups,
            "group_rank": self.group.rank,
            "group_size": self.group.size,
            "is_leader": self.is_leader,
            "leaders_size": self.leaders.size if self.leaders is not None else None,
            "host": MPI.Get_processor_name(),
        }

    def Free(self) -> None:
        """Release the communicators."""
        for comm in (self.leaders, self.group, self.world):
            if comm is not None:
                comm.Free()

    def __repr__(self) -> str:
        return (
            f"Topology(rank={self.rank}, size={self.size}, group={self.group_index}/{self.num_groups}, "
            f"group_rank={self.group.rank}/{self.group.size}, leader={self.is_leader})"
        )
