"""Distributed linear regression with heterogeneous workers (the workload of Top-k / RegTop-k).

The experiment of Bereyhi et al. (RegTop-k, arXiv:2501.05633, "Numerical
validation"; ALGORITHMS.md "Top-k with error feedback, and RegTop-k"), with
the data model of the authors' code (``SynthDataSet.py``): worker ``n`` has
``m`` samples ``y = A_n x_n + noise`` of its own true model::

    mean_n ~ N(0, mean_power)                 one number per worker: heterogeneous means
    x_n    = mean_n 1 + N(0, I_d)
    A_n    ~ N(0, 1) entries, shape (m, d);   noise ~ N(0, noise_variance)

and the objective (torch's ``mse_loss``, as in the authors' code, which the
learning rate 0.01 goes with) is the mean of the workers' losses::

    f_n(x) = (1/m) ||A_n x - y_n||^2,     grad f_n(x) = H_n x - b_n,
    H_n = (2/m) A_n^T A_n,   b_n = (2/m) A_n^T y_n.

The optimum ``x*`` is the least-squares solution over all data,
``(sum_n A_n^T A_n)^{-1} sum_n A_n^T y_n`` (float64).  Gradients are full
batch, computed in float64 from ``H_n`` and ``b_n`` and rounded to float32
(the algorithms' buffers): a deterministic function of ``(worker, x)``, so
an MPI run and its one-process twin (:func:`mpiopt.sim.topk.simulate`) see
identical gradients.  Because the
workers' means differ, ``grad f_n(x*)`` is far from 0 for every ``n`` even
though their sum is 0: this is where error feedback hurts Top-k.

Worker ``n``'s data depends only on ``(seed, n)``: the first 4 workers of a
20-worker problem are a 4-worker problem.

Example
-------
>>> problem = make_problem(num_workers=20)
>>> grad = problem.gradient(3, x)            # worker 3's full-batch gradient at x (float32)
>>> problem.squared_distance(x)              # ||x - x*||^2
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import numpy as np

__all__ = ["LinRegProblem", "make_problem"]


@dataclass(frozen=True)
class LinRegProblem:
    """The workers' quadratic losses in closed form.

    Attributes
    ----------
    hessians : numpy.ndarray
        ``(N, d, d)`` float64, ``H_n = (2/m) A_n^T A_n``.
    offsets : numpy.ndarray
        ``(N, d)`` float64, ``b_n = (2/m) A_n^T y_n``.
    optimum : numpy.ndarray
        ``(d,)`` float64, the least-squares solution over all workers' data.
    """

    hessians: np.ndarray
    offsets: np.ndarray
    optimum: np.ndarray

    @property
    def num_workers(self) -> int:
        return int(self.offsets.shape[0])

    @property
    def dim(self) -> int:
        return int(self.offsets.shape[1])

    def gradient(self, worker: int, x: np.ndarray, out: Optional[np.ndarray] = None) -> np.ndarray:
        """Full-batch gradient of worker ``worker``'s loss at ``x``: float32 (``out``'s dtype when given)."""
        exact = self.hessians[worker] @ x.astype(np.float64) - self.offsets[worker]
        if out is None:
            return exact.astype(np.float32)
        out[...] = exact
        return out

    def squared_distance(self, x: np.ndarray) -> float:
        """``||x - x*||^2`` (the papers' figure plots its log10)."""
        return float(np.sum((x.astype(np.float64) - self.optimum) ** 2))


def _rng(seed: int, worker: int) -> np.random.Generator:
    return np.random.default_rng(np.random.SeedSequence(seed, spawn_key=(worker,)))


def make_problem(
    num_workers: int = 20,
    dim: int = 100,
    samples: int = 500,
    *,
    mean_power: float = 5.0,
    noise_variance: float = 0.5,
    seed: int = 0,
) -> LinRegProblem:
    """The papers' instance by default: 20 workers, d = 100, 500 samples each, mean power 5, noise variance 0.5."""
    hessians = np.empty((num_workers, dim, dim))
    offsets = np.empty((num_workers, dim))
    for n in range(num_workers):
        rng = _rng(seed, n)
        truth = np.sqrt(mean_power) * rng.standard_normal() + rng.standard_normal(dim)
        a = rng.standard_normal((samples, dim))
        y = a @ truth + np.sqrt(noise_variance) * rng.standard_normal(samples)
        hessians[n] = (2.0 / samples) * (a.T @ a)
        offsets[n] = (2.0 / samples) * (a.T @ y)
    optimum = np.linalg.solve(hessians.sum(axis=0), offsets.sum(axis=0))
    return LinRegProblem(hessians, offsets, optimum)
