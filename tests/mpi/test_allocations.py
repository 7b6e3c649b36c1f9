"""No parameter-sized allocations in a synchronous algorithm's steady-state step (issue 11, part 4).

numpy reports its array allocations to ``tracemalloc``; the peak traced
during steps 3-10 must stay below 1 % of the parameter bytes plus a small
constant (Python objects, the ledger's records), at d = 100,003 and 1,000,003
(not a multiple of 8 or 64, so ragged packed words are exercised too).
"""

import tracemalloc

import numpy as np
import pytest

import mpiopt
from mpiopt.kernels.sparse import index_sets

pytestmark = pytest.mark.mpi

CONSTANT = 64 * 1024  # bytes: Python-level bookkeeping, independent of d

CASES = [
    ("sgd", dict(lr=0.1, momentum=0.9)),
    ("easgd", {}),
    ("lsgd", dict(period=1, global_period=2)),
    ("lsgd", dict(period=1, global_period=2, proximal=0.1, pull_form="convex")),
    ("dasgd", {}),
    ("signum", dict(exchange="allgather")),
    ("signum", dict(exchange="twophase")),
    ("signum", dict(exchange="prevote")),
    ("signum", dict(exchange="allgather", momentum=0.0, weight_decay=0.0)),
    ("signum", dict(exchange="allgather", pipeline_chunks=3)),
    ("signum", dict(exchange="twophase", pipeline_chunks=5)),
]
# Top-k and RegTop-k select, aggregate and update through workspaces made at setup, with the C loops
# (the numpy fallback allocates k-sized temporaries).
NEEDS_C = pytest.mark.skipif(index_sets._sparsec is None, reason="mpiopt.kernels._sparsec was not built")
CASES += [pytest.param(name, dict(density=density), marks=NEEDS_C) for name in ("topk", "regtopk") for density in (0.001, 0.3)]


def _peak_bytes(topology, name, hyper, d, dtype):
    rng = np.random.default_rng([d, topology.rank])
    params = rng.standard_normal(d).astype(dtype)
    grads = [rng.standard_normal(d).astype(dtype) for _ in range(3)]
    alg = mpiopt.create(name, topology, **hyper)
    alg.setup(params)
    for step in range(10):
        if step == 2:
            tracemalloc.start()
        alg.step(params, grads[step % 3], loss=1.0 + 0.01 * step * (topology.rank + 1))
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    alg.finish(params)
    return peak, params.nbytes


@pytest.mark.parametrize("name, hyper", CASES)
@pytest.mark.parametrize("d", [100_003, 1_000_003])
def test_steps_allocate_nothing_parameter_sized(topology, name, hyper, d):
    for dtype in (np.float32, np.float64):
        peak, param_bytes = _peak_bytes(topology, name, hyper, d, dtype)
        assert peak < 0.01 * param_bytes + CONSTANT, f"{name} {hyper} {dtype.__name__}: peak {peak} B, params {param_bytes} B"
