"""The twin of :class:`~mpiopt.algorithms.topk.TopK` (Top-k and RegTop-k): N workers in one process, bit for bit.

Each step does what every rank of an MPI run does, through the same code:
each worker's :meth:`~mpiopt.kernels.sparse.worker.SparseWorker.compress` writes
its payload into row ``n`` of a table (the ``Allgather``'s result, in rank
order), :func:`~mpiopt.kernels.sparse.worker.aggregate_payloads` decodes and
averages the rows, and :class:`~mpiopt.algorithms.local.LocalSGD` applies
the aggregate ``G``.  So a run of ``mpiopt.create("regtopk", ..., mu=mu)``
on N ranks, rank ``n`` feeding ``problem.gradient(n, x)``, ends with bitwise
the same parameters (docs/regtopk.md says why).

Example
-------
>>> from mpiopt.tasks.linreg import make_problem
>>> run = simulate(make_problem(num_workers=20), Sparsifier(density=0.7, mu=4.0), steps=1000)
>>> run.squared_distance[-1]          # ||x_T - x*||^2
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import numpy as np

from ..algorithms.local import LocalSGD
from ..algorithms.topk import Sparsifier
from ..kernels.sparse.worker import SparseWorker, aggregate_payloads
from ..tasks.linreg import LinRegProblem

__all__ = ["SimulationRun", "simulate"]


@dataclass
class SimulationRun:
    """What :func:`simulate` returns.

    Attributes
    ----------
    params : numpy.ndarray
        ``x_T`` (float32), as every rank of an MPI run would hold it.
    squared_distance : numpy.ndarray
        ``||x_t - x*||^2`` for ``t = 0 .. T`` (float64).
    aggregate : numpy.ndarray
        The last step's ``G`` (float32).
    """

    params: np.ndarray
    squared_distance: np.ndarray
    aggregate: np.ndarray


def simulate(
    problem: LinRegProblem,
    sparsifier: Sparsifier,
    steps: int,
    *,
    lr: float = 0.01,
    momentum: float = 0.0,
    initial: Optional[np.ndarray] = None,
) -> SimulationRun:
    """Run Top-k / RegTop-k with ``problem.num_workers`` workers in one process, through the MPI algorithm's own code.

    Parameters
    ----------
    problem : LinRegProblem
        Worker ``n``'s gradient is ``problem.gradient(n, x)``.
    sparsifier : Sparsifier
        ``Sparsifier(density=1.0)`` is dense distributed SGD.
    steps : int
        ``T``.
    lr, momentum
        The step on ``G`` (the paper: lr 0.01, no momentum).
    initial : numpy.ndarray, optional
        ``x_0`` (default 0).

    Returns
    -------
    SimulationRun
    """
    n_workers = problem.num_workers
    x = np.zeros(problem.dim, np.float32) if initial is None else np.array(initial, dtype=np.float32)
    workers = [SparseWorker(sparsifier, x, n_workers) for _ in range(n_workers)]
    payloads = np.empty((n_workers, workers[0].payload_nbytes), dtype=np.uint8)
    aggregate = np.zeros_like(x)
    local = LocalSGD(momentum)
    local.allocate(x)
    grad = np.empty_like(x)
    distance = np.empty(steps + 1)
    distance[0] = problem.squared_distance(x)
    for t in range(1, steps + 1):
        for n, worker in enumerate(workers):
            worker.compress(problem.gradient(n, x, out=grad), aggregate, out=payloads[n])
        aggregate_payloads(payloads, out=aggregate)
        local.apply(x, aggregate, lr)
        distance[t] = problem.squared_distance(x)
    return SimulationRun(x, distance, aggregate)
