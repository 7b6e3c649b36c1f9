"""Streaming PCA: the test problem of Async-MSGD (Liu et al., NeurIPS 2018), the top eigenvector from samples.

The paper's update is Async-MSGD's rule with ``g(v) = -(I - v v^T) X X^T v``, without normalisation (Oja's
term keeps ``||v||`` near 1).  Problem and metric: docs/async.md, "Streaming PCA";
docs/algorithms.md "Async-MSGD"; why no projection: docs/internals-tasks.md.
"""

from __future__ import annotations

from dataclasses import dataclass
import numpy as np

__all__ = ["PCAProblem", "PCAStream", "make_problem", "gradient", "sin2", "diverged", "DIVERGED_NORM"]

#: A norm beyond this means the iterate has left the unit sphere for good.
DIVERGED_NORM = 10.0


def _rng(seed: int, *key: int) -> np.random.Generator:
    # Independent streams: (0,) the basis, (1,) samples, (2,) initial points.
    return np.random.default_rng(np.random.SeedSequence(seed, spawn_key=key))


@dataclass(frozen=True)
class PCAProblem:
    """A covariance ``Sigma = Q diag(eigenvalues) Q^T`` to sample from (eigenvalues descending; column j of ``basis``)."""

    eigenvalues: np.ndarray
    basis: np.ndarray

    @property
    def dim(self) -> int:
        return int(self.eigenvalues.shape[0])

    @property
    def top(self) -> np.ndarray:
        """The top eigenvector ``u`` (float64, unit norm)."""
        return self.basis[:, 0]

    @property
    def gap(self) -> float:
        """Spectral gap ``lambda_1 - lambda_2``."""
        return float(self.eigenvalues[0] - self.eigenvalues[1])

    def covariance(self) -> np.ndarray:
        """``Sigma`` as a dense float64 matrix."""
        return (self.basis * self.eigenvalues) @ self.basis.T

    def samples(self, seed: int, steps: int, batch_size: int = 1, key: int = 0, dtype: type = np.float32) -> np.ndarray:
        """``(steps, batch_size, d)`` samples of ``N(0, Sigma)``, deterministic in ``(seed, key)`` (``key``: one stream per worker)."""
        z = _rng(seed, 1, key).standard_normal((steps, batch_size, self.dim))
        return ((z * np.sqrt(self.eigenvalues)) @ self.basis.T).astype(dtype)

    def initial(self, seed: int, dtype: type = np.float32) -> np.ndarray:
        """A random unit vector (uniform on the sphere): the usual start."""
        v = _rng(seed, 2).standard_normal(self.dim)
        return (v / np.linalg.norm(v)).astype(dtype)


def make_problem(dim: int = 16, top: float = 1.0, second: float = 0.6, last: float = 0.1, seed: int = 0) -> PCAProblem:
    """The streaming-PCA problem: ``lambda_1 = top``, the others evenly from ``second`` to ``last`` (a spectral gap)."""
    if isinstance(dim, bool) or not isinstance(dim, int) or dim < 2:
        raise ValueError(f"dim must be an integer >= 2, got {dim!r}")
    if not top > second >= last > 0:
        raise ValueError(f"eigenvalues need top > second >= last > 0, got top={top}, second={second}, last={last}")
    eigenvalues = np.concatenate([[top], np.linspace(second, last, dim - 1)])
    basis, _ = np.linalg.qr(_rng(seed, 0).standard_normal((dim, dim)))
    return PCAProblem(eigenvalues=eigenvalues, basis=basis)


def gradient(v: np.ndarray, x: np.ndarray, out: np.ndarray) -> float:
    """The stochastic gradient ``-(I - v v^T) C v`` with ``C = x^T x / B`` into ``out``; returns ``-v^T C v / ||v||^2``."""
    proj = x @ v                                  # (B,): X^T v, one entry per sample
    np.matmul(proj, x, out=out)                   # B C v
    out /= x.shape[0]                             # C v
    vcv = float(v @ out)
    out -= v * vcv                                # (I - v v^T) C v
    np.negative(out, out=out)
    return -vcv / float(v @ v)


def sin2(v: np.ndarray, top: np.ndarray) -> float:
    """sin^2 of the angle between ``v`` and the unit vector ``top`` (2), in float64; 1 for ``v = 0``."""
    v = np.asarray(v, dtype=np.float64)
    norm2 = float(v @ v)
    if not norm2 > 0:
        return 1.0
    return max(0.0, 1.0 - float(v @ top) ** 2 / norm2)


def diverged(v: np.ndarray) -> bool:
    """The iterate is not finite or its norm exceeds :data:`DIVERGED_NORM`."""
    norm = float(np.linalg.norm(np.asarray(v, dtype=np.float64)))
    return not norm <= DIVERGED_NORM


class PCAStream:
    """A worker's gradient function over a fixed sample stream, ``stream(v, step, out) -> loss`` (``worker_fn`` of asyncrt)."""

    def __init__(self, problem: PCAProblem, samples: np.ndarray) -> None:
        if samples.ndim != 3 or samples.shape[2] != problem.dim:
            raise ValueError(f"samples must have shape (steps, batch, {problem.dim}), got {samples.shape}")
        self.problem = problem
        self.samples = samples

    def __len__(self) -> int:
        return int(self.samples.shape[0])

    def __call__(self, v: np.ndarray, step: int, out: np.ndarray) -> float:
        return gradient(v, self.samples[step], out=out)
