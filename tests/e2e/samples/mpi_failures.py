"""Deliberately failing MPI tests, run by tests/e2e/test_mpi_harness.py (not collected otherwise)."""

import numpy as np
import pytest
from mpi4py import MPI

pytestmark = pytest.mark.mpi


def test_fails_on_rank_one_only():
    assert MPI.COMM_WORLD.Get_rank() != 1, "rank one disagrees"


def test_rank_one_fails_before_a_collective():
    if MPI.COMM_WORLD.Get_rank() == 1:
        raise RuntimeError("rank one gave up early")
    MPI.COMM_WORLD.Allreduce(MPI.IN_PLACE, np.ones(1))  # rank 0 waits here for ever


def test_everyone_deadlocks():
    MPI.COMM_WORLD.Recv(np.empty(1), source=MPI.ANY_SOURCE, tag=77)  # nobody sends
