"""The averaging benchmark's windows: streaming_diloco's warm-up leaves nothing in flight at a window boundary."""

from __future__ import annotations

import numpy as np
import pytest

import mpiopt
from mpiopt.bench.averaging import streaming_warmup
from mpiopt.training.config import UsageError


@pytest.mark.parametrize("period,fragments,overlap_steps", [(8, 4, 1), (16, 4, 2), (16, 4, 3), (8, 2, 3), (8, 1, 0), (12, 5, 1)])
def test_every_window_starts_and_merges_each_fragment_inside_it(period, fragments, overlap_steps):
    topology = mpiopt.Topology()
    alg = mpiopt.create("streaming_diloco", topology, lr=0.01, period=period, fragments=fragments, overlap_steps=overlap_steps)
    params, grad = np.zeros(64, np.float32), np.ones(64, np.float32)
    alg.setup(params)
    warmup = streaming_warmup(period, fragments, overlap_steps)
    for _ in range(warmup):
        alg.step(params, grad)
    for _ in range(3):  # windows of one period each
        assert not alg.merge_steps.any()
        started = np.zeros(fragments, int)
        for _ in range(period):
            before = alg.merge_steps.copy()
            alg.step(params, grad)
            started += (alg.merge_steps != before) & (alg.merge_steps != 0)
        assert started.tolist() == [1] * fragments or overlap_steps == 0
    assert not alg.merge_steps.any()


def test_no_free_window_boundary_is_a_usage_error():
    with pytest.raises(UsageError, match="--outer-period of at least 12"):
        streaming_warmup(8, 4, 2)
    with pytest.raises(UsageError, match="at most --outer-period"):
        streaming_warmup(4, 5, 0)
