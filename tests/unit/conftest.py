"""Fixtures for the tests without MPI."""

import pytest

from mpiopt.kernels import threads
from mpiopt.kernels._backend import array_modules


@pytest.fixture(params=array_modules(), ids=lambda xp: xp.__name__)
def xp(request):
    """Each array module present: numpy, and cupy where a GPU is."""
    return request.param


@pytest.fixture
def kernel_threads():
    """Set the C kernels' thread count within a test (call it with the count); restored afterwards."""
    saved = threads.get_num_threads()
    yield threads.set_num_threads
    threads.set_num_threads(saved)
