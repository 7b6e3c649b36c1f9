"""Every synchronous algorithm on cupy arrays reproduces its run on numpy arrays, bit for bit.

The GPU's fused kernels (mpiopt.kernels._cuda) give the C loops' bits, and MPI sums the same
float32 values in the same order whether they were staged from the GPU or not, so the two
runs' parameters must be identical.  Skipped, with the reason, on machines without a CUDA GPU.
"""

from __future__ import annotations

import numpy as np
import pytest

import mpiopt
from mpiopt.kernels._backend import array_modules

pytestmark = pytest.mark.mpi

if len(array_modules()) < 2:
    pytest.skip("no cupy with a CUDA GPU on this machine (GPU paths run on a GPU machine only)", allow_module_level=True)

import cupy  # noqa: E402 - only where a GPU is

D = 10_007
CASES = [
    ("sgd", dict(lr=0.1, momentum=0.9, weight_decay=1e-3, nesterov=True)),
    ("easgd", dict(period=2)),
    ("lsgd", dict(period=1, global_period=2)),
    ("lsgd", dict(period=1, global_period=2, proximal=0.1, pull_form="convex")),
    ("dasgd", dict(period=2, delay_steps=1)),
    ("dasgd", dict(period=2, merge="proportion")),
    ("signum", dict(exchange="allgather")),
    ("signum", dict(exchange="twophase", pipeline_chunks=3)),
    ("topk", dict(density=0.01)),
    ("regtopk", dict(density=0.01)),
]


def _run(topology, name, hyper, xp, dtype):
    rng = np.random.default_rng([7, topology.rank])
    params = xp.asarray(rng.standard_normal(D).astype(dtype))
    grads = [xp.asarray(rng.standard_normal(D).astype(dtype)) for _ in range(3)]
    alg = mpiopt.create(name, topology, **hyper)
    alg.setup(params)
    for step in range(9):
        alg.step(params, grads[step % 3], loss=1.0 + 0.01 * step * (topology.rank + 1))
    alg.finish(params)
    return params.get() if xp is cupy else params


@pytest.mark.parametrize("name, hyper", CASES, ids=lambda v: v if isinstance(v, str) else "-".join(f"{k}={w}" for k, w in v.items()))
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_gpu_run_is_the_cpu_run(topology, name, hyper, dtype):
    on_cpu = _run(topology, name, hyper, np, dtype)
    on_gpu = _run(topology, name, hyper, cupy, dtype)
    assert np.isfinite(on_cpu).all()
    np.testing.assert_array_equal(on_gpu.view(np.uint8), on_cpu.view(np.uint8))
