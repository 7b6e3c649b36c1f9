"""Placement of large state arrays (mpiopt.arrays.host_apart / empty_apart / keep_apart)."""

from __future__ import annotations

import gc
import itertools

import numpy as np
import pytest

from mpiopt import arrays
from mpiopt.arrays import ALIAS_PAGE, ALIAS_SPAN, PLACE_MIN_BYTES, SPAN_GAP, empty_apart, host_apart, keep_apart


def circular(distance: int, period: int) -> int:
    distance %= period
    return min(distance, period - distance)


@pytest.fixture(autouse=True)
def forget_known(monkeypatch):
    """Each test starts with no known arrays (others' leftovers would make the spreads depend on the order)."""
    monkeypatch.setattr(arrays, "_known", [])


@pytest.mark.parametrize("others", [[0], [5 * 4096 + 16, 7 * ALIAS_SPAN + 16], [64 * k + ALIAS_SPAN * k for k in range(9)]])
@pytest.mark.parametrize("address", [16, ALIAS_SPAN - 2 * SPAN_GAP + 16, 3 * ALIAS_SPAN + SPAN_GAP // 2])
def test_start_keeps_clear_of_span_multiples_and_spreads_page_offsets(address, others):
    start = arrays._start(address, others)
    assert 0 <= start < arrays._padding(len(others)) - ALIAS_PAGE and start % 64 == 0
    assert all(circular(address + start - other, ALIAS_SPAN) >= SPAN_GAP for other in others)
    # No clear cache-line offset in the padding lies farther from the others within a page.
    spread = min(circular(address + start - other, ALIAS_PAGE) for other in others)
    for offset in range(0, arrays._padding(len(others)) - ALIAS_PAGE, 64):
        if all(circular(address + offset - other, ALIAS_SPAN) >= SPAN_GAP for other in others):
            assert min(circular(address + offset - other, ALIAS_PAGE) for other in others) <= spread


def test_start_avoids_the_aliased_slot():
    """The case that ran 8x slower: the buffer starting a multiple of 256 MiB (give or take a few KiB) from another."""
    other = 5 * ALIAS_SPAN + 4096
    start = arrays._start(7 * ALIAS_SPAN + 16, [other])
    assert start >= SPAN_GAP - 4096 - 16
    assert circular(7 * ALIAS_SPAN + 16 + start - other, ALIAS_SPAN) >= SPAN_GAP
    assert circular(7 * ALIAS_SPAN + 16 + start - other, ALIAS_PAGE) > ALIAS_PAGE // 2 - 64  # cache lines from 16


def test_placed_arrays_keep_apart_from_each_other_and_from_kept_ones():
    n = PLACE_MIN_BYTES // 4 + 3
    params = np.ones(n, np.float32)
    keep_apart(params)
    near = np.ones(n, np.float32)
    placed = [host_apart(n, np.float32, near=(near,))] + [empty_apart(params) for _ in range(5)] + [empty_apart(params, zero=True)]
    for arr in placed:
        assert arr.shape == (n,) and arr.dtype == np.float32 and arr.flags.c_contiguous and arr.flags.writeable
    assert not placed[-1].any()
    for i, arr in enumerate(placed):
        for other in [params] + placed[:i] + ([near] if i == 0 else []):
            assert circular(arr.ctypes.data - other.ctypes.data, ALIAS_SPAN) >= SPAN_GAP
    # params (kept) and every placed array: distinct offsets within a page, far apart.
    pages = [s.ctypes.data % ALIAS_PAGE for s in [params] + placed]
    assert min(circular(a - b, ALIAS_PAGE) for a, b in itertools.combinations(pages, 2)) >= 256


def test_small_and_float64_and_shapes():
    small = empty_apart(np.zeros(10, np.float64), zero=True)
    assert small.base is None and small.dtype == np.float64 and not small.any()
    big = host_apart((3, PLACE_MIN_BYTES // 8), np.float64, zero=True)
    assert big.shape == (3, PLACE_MIN_BYTES // 8) and big.flags.c_contiguous and not big.any()
    big[...] = 1.5  # every byte is the array's own
    assert big.sum() == 1.5 * big.size


def test_known_arrays_count_once_and_the_latest_few():
    n = PLACE_MIN_BYTES // 4
    kept = np.ones(n, np.float32)
    for _ in range(5):
        keep_apart(kept)  # an algorithm set up again on the same parameters
    assert arrays._live_addresses() == [kept.ctypes.data]
    many = [host_apart(n, np.float32) for _ in range(arrays.MAX_KNOWN + 3)]
    addresses = arrays._live_addresses()
    assert addresses == [arr.ctypes.data for arr in many[-arrays.MAX_KNOWN:]]
    # the padding stays bounded however many arrays live
    assert many[-1].base.nbytes <= many[-1].nbytes + arrays._padding(arrays.MAX_KNOWN)


def test_dead_arrays_are_forgotten():
    n = PLACE_MIN_BYTES // 4
    arr = host_apart(n, np.float32)
    kept = np.ones(n, np.float32)
    keep_apart(kept, np.ones(3))  # the small one is not kept
    assert arrays._live_addresses() == [arr.ctypes.data, kept.ctypes.data]
    del arr, kept
    gc.collect()
    assert arrays._live_addresses() == []


def test_a_resumed_momentum_buffer_is_placed_too():
    """A state array that appears lazily (the momentum buffer) and comes back from a checkpoint is placed like a new one."""
    from mpi4py import MPI

    import mpiopt

    d = PLACE_MIN_BYTES // 4 * 3
    params, grad = np.zeros(d, np.float32), np.ones(d, np.float32)
    alg = mpiopt.create("sgd", mpiopt.Topology(MPI.COMM_SELF), lr=0.1, momentum=0.9)
    alg.setup(params)
    alg.step(params, grad)
    state = alg.state_dict()
    fresh = mpiopt.create("sgd", mpiopt.Topology(MPI.COMM_SELF), lr=0.1, momentum=0.9)
    fresh.setup(params)
    assert fresh.momentum_buffer is None
    fresh.load_state_dict(state)
    restored = fresh.momentum_buffer
    np.testing.assert_array_equal(restored, state["arrays"]["momentum_buffer"])
    assert restored.base is not None and restored.flags.writeable  # cut from a padded buffer
    assert circular(restored.ctypes.data - params.ctypes.data, ALIAS_SPAN) >= SPAN_GAP
    assert circular(restored.ctypes.data - params.ctypes.data, ALIAS_PAGE) >= 256


def test_torch_front_end_flat_buffers_are_placed_apart():
    torch = pytest.importorskip("torch")
    from mpi4py import MPI

    import mpiopt
    from mpiopt.torch import DistributedOptimizer

    model = torch.nn.Linear(1024, PLACE_MIN_BYTES // 4 // 1024 * 2)
    opt = DistributedOptimizer(model.parameters(), "sgd", topology=mpiopt.Topology(MPI.COMM_SELF), lr=0.1)
    flat, grads = opt._params_array, opt._grads_array
    assert circular(flat.ctypes.data - grads.ctypes.data, ALIAS_SPAN) >= SPAN_GAP
    assert circular(flat.ctypes.data - grads.ctypes.data, ALIAS_PAGE) >= 256
    assert model.weight.data.data_ptr() == flat.ctypes.data  # the parameters are views of the placed buffer


def test_algorithm_state_is_placed_apart_from_the_parameters():
    from mpi4py import MPI

    import mpiopt

    d = PLACE_MIN_BYTES // 4 * 3
    params = np.zeros(d, np.float32)
    grad = np.ones(d, np.float32)
    alg = mpiopt.create("easgd", mpiopt.Topology(MPI.COMM_SELF), lr=0.1, momentum=0.9)
    alg.setup(params)
    alg.step(params, grad)
    streams = [params, alg.center, alg._mean, alg.momentum_buffer]
    pages = [s.ctypes.data % ALIAS_PAGE for s in streams]
    assert min(circular(a - b, ALIAS_PAGE) for a, b in itertools.combinations(pages, 2)) >= 256
    for a, b in itertools.combinations(streams, 2):
        assert circular(a.ctypes.data - b.ctypes.data, ALIAS_SPAN) >= SPAN_GAP
    # The momentum buffer, placed at the first step, keeps apart from the gradient too.
    assert circular(alg.momentum_buffer.ctypes.data - grad.ctypes.data, ALIAS_SPAN) >= SPAN_GAP
