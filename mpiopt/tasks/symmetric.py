"""A non-convex objective with mirror-image minima, ``f(x) = sum_j (x_j^2 - 1)^2``: the "curse of symmetry" of LSGD.

Workers started in mirror-image wells average to the maximum at 0, where EASGD's centre stays and LSGD's
leader does not.  Details: docs/internals-tasks.md.
"""

from __future__ import annotations

from typing import Optional

import numpy as np

__all__ = ["loss", "gradient", "hessian_eigenvalues", "is_local_minimum", "mirrored_starts"]


def loss(x: np.ndarray) -> float:
    """``f(x) = sum_j (x_j^2 - 1)^2``."""
    return float(np.sum(np.square(np.square(x) - 1.0)))


def gradient(x: np.ndarray, out: Optional[np.ndarray] = None) -> np.ndarray:
    """``4 x (x^2 - 1)``, into ``out`` when given."""
    out = np.multiply(x, x, out=out)
    out -= 1.0
    out *= x
    out *= 4.0
    return out


def hessian_eigenvalues(x: np.ndarray) -> np.ndarray:
    """Eigenvalues of the (diagonal) Hessian ``12 x^2 - 4``, one per coordinate."""
    return 12.0 * np.square(x) - 4.0


def is_local_minimum(x: np.ndarray, tol: float = 1e-6) -> bool:
    """Stationary within ``tol`` (gradient 2-norm) with a positive definite Hessian."""
    return bool(np.linalg.norm(gradient(x)) < tol and np.all(hessian_eigenvalues(x) > 0))


def mirrored_starts(workers: int, dim: int, seed: int = 0, low: float = 0.3, high: float = 1.6) -> np.ndarray:
    """Starting points, one row per worker: row ``2k`` uniform in ``[low, high]^dim``, row ``2k + 1`` its negative.

    An unpaired last row is 0, so the rows sum to exactly 0.  ``0 < low <= high``.
    """
    if workers < 1 or dim < 1:
        raise ValueError(f"workers and dim must be >= 1, got workers={workers}, dim={dim}")
    if not 0 < low <= high:
        raise ValueError(f"need 0 < low <= high, got low={low}, high={high}")
    positive = np.random.default_rng(seed).uniform(low, high, size=(workers // 2, dim))
    starts = np.zeros((workers, dim))
    starts[0 : 2 * (workers // 2) : 2] = positive
    starts[1 : 2 * (workers // 2) : 2] = -positive
    return starts
