"""Fixtures for the tests without MPI."""

import pytest

from mpiopt.kernels._backend import array_modules


@pytest.fixture(params=array_modules(), ids=lambda xp: xp.__name__)
def xp(request):
    """Each array module present: numpy, and cupy where a GPU is."""
    return request.param
