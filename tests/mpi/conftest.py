"""Fixtures of the MPI tests (run under mpiexec: every rank calls them)."""

from __future__ import annotations

import shutil
import tempfile

import pytest
from mpi4py import MPI


@pytest.fixture
def shared_dir():
    """A directory every rank sees (rank 0 makes it and tells the others)."""
    world = MPI.COMM_WORLD
    path = world.bcast(tempfile.mkdtemp(prefix="mpiopt-ckpt-") if world.rank == 0 else None)
    yield path
    world.Barrier()
    if world.rank == 0:
        shutil.rmtree(path, ignore_errors=True)
