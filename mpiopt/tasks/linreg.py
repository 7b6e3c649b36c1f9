"""Distributed linear regression with heterogeneous workers: the workload of Top-k / RegTop-k (Bereyhi et al.).

Full-batch gradients are a deterministic function of ``(worker, x)``, so an MPI run and its one-process twin
see the same.  The instance: docs/regtopk.md, "The claim"; docs/algorithms.md "Top-k with error feedback, and RegTop-k".

>>> problem = make_problem(num_workers=20)
>>> grad = problem.gradient(3, x)            # worker 3's full-batch gradient at x (float32)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import numpy as np

__all__ = ["LinRegProblem", "make_problem"]


@dataclass(frozen=True)
class LinRegProblem:
    """The workers' quadratic losses in closed form: ``hessians`` ``H_n``, ``offsets`` ``b_n``, the least-squares ``optimum``."""

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
