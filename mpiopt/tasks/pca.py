"""Streaming PCA: the test problem of Async-MSGD (Liu et al., NeurIPS 2018).

Find the top eigenvector ``u`` of a covariance ``Sigma`` from a stream of
samples ``X ~ N(0, Sigma)``, i.e. maximise ``v^T Sigma v`` on the unit
sphere.  The paper's update (ALGORITHMS.md "Async-MSGD") is

    v_{k+1} = v_k + eta (I - v_s v_s^T) X X^T v_s + mu (v_k - v_{k-1}),   s = k - tau_k

which is Async-MSGD's ``x_{k+1} = x_k - eta g(x_s) + mu (x_k - x_{k-1})``
with the stochastic "gradient"

    g(v) = -(I - v v^T) X X^T v                                            (1)

(:func:`gradient`; with a minibatch of ``B`` samples ``X X^T`` is replaced by
their mean).  So the same server update applies to PCA and to any other task.

The problem (:func:`make_problem`)
----------------------------------
``Sigma = Q diag(lambda) Q^T`` with a random orthogonal ``Q`` (seeded) and, by
default, ``d = 16``, ``lambda_1 = 1`` and ``lambda_2 .. lambda_d`` evenly
spaced from ``0.6`` down to ``0.1``: a spectral gap ``lambda_1 - lambda_2 =
0.4``, large enough that the top eigenvector is found in a few hundred
iterations, and a spread of the other eigenvalues so the iterate has to
leave several directions behind, not one.  The metric is

    sin^2 angle(v, u) = 1 - (v . u)^2 / ||v||^2                             (2)

(:func:`sin2`), scale-invariant: 0 at the solution, about ``1 - 1/d`` from a
random start.

Normalisation: none.  The paper keeps ``v`` near the sphere; (1) does so by
itself: for ``||v|| = 1`` the step is orthogonal to ``v`` (the norm grows
only at second order), and for ``||v|| != 1`` the term ``-v (v^T X X^T v)``
pulls ``||v||^2`` back to 1 at a rate ``~ 2 eta v^T Sigma v`` (Oja's rule).
No projection is added, so the update is exactly the paper's and the
generic Async-MSGD rule; :func:`diverged` flags a run whose iterate left the
sphere for good (norm beyond ``10``) or stopped being finite.

Samples are float32 (like the algorithms' flat buffers), drawn up front by
:meth:`PCAProblem.samples` so that an experiment can feed every grid cell
the same stream (common random numbers: differences between cells are the
algorithm's, not the sampling noise's).

Example
-------
>>> problem = make_problem()
>>> stream = PCAStream(problem, problem.samples(seed=1, steps=500))
>>> v = problem.initial(seed=2)
>>> g = np.empty_like(v)
>>> stream(v, 0, g)                  # gradient (1) of sample 0 into g; returns the loss
>>> sin2(v, problem.top)
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
    """A covariance ``Sigma = Q diag(eigenvalues) Q^T`` to sample from.

    Attributes
    ----------
    eigenvalues : numpy.ndarray
        ``(d,)`` float64, descending, positive.
    basis : numpy.ndarray
        ``(d, d)`` float64 orthogonal; column ``j`` is eigenvector ``j``.
    """

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
        """``(steps, batch_size, d)`` samples of ``N(0, Sigma)``, deterministic in ``(seed, key)``.

        ``key`` separates streams of one seed (e.g. one per worker rank).
        """
        z = _rng(seed, 1, key).standard_normal((steps, batch_size, self.dim))
        return ((z * np.sqrt(self.eigenvalues)) @ self.basis.T).astype(dtype)

    def initial(self, seed: int, dtype: type = np.float32) -> np.ndarray:
        """A random unit vector (uniform on the sphere): the usual start."""
        v = _rng(seed, 2).standard_normal(self.dim)
        return (v / np.linalg.norm(v)).astype(dtype)


def make_problem(dim: int = 16, top: float = 1.0, second: float = 0.6, last: float = 0.1, seed: int = 0) -> PCAProblem:
    """The streaming-PCA problem: ``lambda_1 = top``, the others evenly from ``second`` to ``last``.

    Raises
    ------
    ValueError
        Unless ``dim >= 2`` and ``top > second >= last > 0`` (a spectral gap).
    """
    if isinstance(dim, bool) or not isinstance(dim, int) or dim < 2:
        raise ValueError(f"dim must be an integer >= 2, got {dim!r}")
    if not top > second >= last > 0:
        raise ValueError(f"eigenvalues need top > second >= last > 0, got top={top}, second={second}, last={last}")
    eigenvalues = np.concatenate([[top], np.linspace(second, last, dim - 1)])
    basis, _ = np.linalg.qr(_rng(seed, 0).standard_normal((dim, dim)))
    return PCAProblem(eigenvalues=eigenvalues, basis=basis)


def gradient(v: np.ndarray, x: np.ndarray, out: np.ndarray) -> float:
    """The stochastic gradient (1) ``-(I - v v^T) C v`` with ``C = x^T x / B``, into ``out``.

    Parameters
    ----------
    v : numpy.ndarray
        ``(d,)`` iterate.
    x : numpy.ndarray
        ``(B, d)`` samples (one row per sample).
    out : numpy.ndarray
        ``(d,)`` destination (``v``'s dtype).

    Returns
    -------
    float
        The sample's loss ``-v^T C v / ||v||^2`` (minus the Rayleigh
        quotient: lower is better), for leader election and logging.
    """
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
    """A worker's gradient function over a fixed sample stream: ``stream(v, step, out) -> loss``.

    Step ``k`` uses sample block ``samples[k]``; this is the ``worker_fn``
    signature of :mod:`mpiopt.asyncrt`.

    Parameters
    ----------
    problem : PCAProblem
        The problem the samples come from.
    samples : numpy.ndarray
        ``(steps, B, d)`` from :meth:`PCAProblem.samples`.
    """

    def __init__(self, problem: PCAProblem, samples: np.ndarray) -> None:
        if samples.ndim != 3 or samples.shape[2] != problem.dim:
            raise ValueError(f"samples must have shape (steps, batch, {problem.dim}), got {samples.shape}")
        self.problem = problem
        self.samples = samples

    def __len__(self) -> int:
        return int(self.samples.shape[0])

    def __call__(self, v: np.ndarray, step: int, out: np.ndarray) -> float:
        return gradient(v, self.samples[step], out=out)
