"""Topology: groups (emulated nodes), leaders and group indices at every world size."""

from __future__ import annotations

import numpy as np
import pytest

from mpiopt import Topology
from mpiopt.comm import SetupMismatchError

pytestmark = pytest.mark.mpi


def expected_groups(size: int, k: int) -> list:
    """Reference partition: consecutive ranks, k per group, the last group holds the rest."""
    return [list(range(start, min(start + k, size))) for start in range(0, size, k)]


@pytest.mark.parametrize("k", [1, 2, 3, 4])
def test_group_size_partition(world_size, k):
    topo = Topology(group_size=k)
    groups = expected_groups(world_size, k)
    mine = next(i for i, g in enumerate(groups) if topo.rank in g)
    # Who is in my group, seen through the group communicator itself.
    members = topo.group.allgather_obj(topo.rank)
    assert members == groups[mine]
    assert (topo.group_index, topo.num_groups) == (mine, len(groups))
    assert topo.is_leader == (topo.rank == groups[mine][0])
    if topo.is_leader:
        assert topo.leaders.allgather_obj(topo.rank) == [g[0] for g in groups]
    else:
        assert topo.leaders is None
    topo.Free()


def test_acceptance_examples(world_size):
    """-n 4: 2 groups of 2 and 2 leaders; -n 3: {0,1} and {2}; -n 1: one group."""
    topo = Topology(group_size=2)
    layout = topo.world.allgather_obj((topo.group_index, topo.group.size, topo.leaders.size if topo.is_leader else None))
    expected = {
        1: [(0, 1, 1)],
        2: [(0, 2, 1), (0, 2, None)],
        3: [(0, 2, 2), (0, 2, None), (1, 1, 2)],
        4: [(0, 2, 2), (0, 2, None), (1, 2, 2), (1, 2, None)],
    }[world_size]
    assert layout == expected
    topo.Free()


def test_default_groups_are_nodes(world_size, monkeypatch):
    monkeypatch.delenv("MPIOPT_GROUP_SIZE", raising=False)
    topo = Topology()
    # All test ranks run on this one machine: one node, one group.
    assert (topo.num_groups, topo.group.size, topo.group_index) == (1, world_size, 0)
    assert topo.is_leader == (topo.rank == 0)
    topo.Free()


def test_group_size_from_environment(world_size, monkeypatch):
    monkeypatch.setenv("MPIOPT_GROUP_SIZE", "1")
    topo = Topology()
    assert (topo.num_groups, topo.group.size, topo.group_index) == (world_size, 1, topo.rank)
    topo.Free()


def test_shared_ledger_names_the_communicator(world_size):
    topo = Topology(group_size=2)
    buf = np.ones(8, dtype=np.float32)
    topo.group.Allreduce(buf)
    topo.world.Allreduce(buf)
    assert set(topo.ledger) == {"group.Allreduce", "world.Allreduce"}
    assert topo.ledger["group.Allreduce"].bytes_sent == (32 if topo.group.size > 1 else 0)
    topo.Free()


@pytest.mark.parametrize("bad", [0, -2, "two", 1.5])
def test_bad_group_size(bad):
    with pytest.raises(ValueError, match="group_size must be a positive integer"):
        Topology(group_size=bad)


@pytest.mark.mpi(min_size=2)
def test_group_size_must_agree():
    from mpi4py import MPI

    rank = MPI.COMM_WORLD.Get_rank()
    with pytest.raises(SetupMismatchError, match="group_size"):
        Topology(group_size=1 + (rank == 1))


def test_first_ranks_make_a_topology_of_their_own(world_size):
    """first(n): world ranks 0..n-1 in a new topology with its own ledger, None elsewhere; bad n is a ValueError."""
    topo = Topology(group_size=2)
    n = max(1, world_size // 2)
    sub = topo.first(n)
    assert (sub is None) == (topo.rank >= n)
    if sub is not None:
        assert (sub.rank, sub.size) == (topo.rank, n)
        assert sub.world.allgather_obj(topo.rank) == list(range(n))
        sub.world.Allreduce(np.ones(4, dtype=np.float32))
        assert "world.Allreduce" not in topo.ledger  # a ledger of its own
        sub.Free()
    for bad in (0, world_size + 1, 1.0):
        with pytest.raises(ValueError, match="ranks must be an integer"):
            topo.first(bad)
    topo.Free()
