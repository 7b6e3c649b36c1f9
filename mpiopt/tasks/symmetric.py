"""A small non-convex objective with symmetric minima: the "curse of symmetry".

Teng et al. (LSGD, NeurIPS 2019) argue that averaging workers that sit in
mirror-image minima lands between them, where the objective need not be
minimal; a leader, being one of the workers, is always a real point of the
landscape.  This module is the smallest instance of that picture:

    f(x) = sum_j (x_j^2 - 1)^2,    x in R^d

- gradient ``4 x_j (x_j^2 - 1)``; the Hessian is diagonal, ``12 x_j^2 - 4``;
- minima: every ``x`` with all ``x_j = +-1`` (``2^d`` of them, ``f = 0``,
  Hessian ``8 I``), mirror images of each other under ``x -> -x``;
- ``x = 0`` is a stationary point with Hessian ``-4 I``: a local maximum,
  ``f = d``.  (Points mixing 0 and +-1 coordinates are saddles.)

:func:`mirrored_starts` places worker ``2k`` in the positive well and worker
``2k + 1`` at its mirror image, so the workers' average is 0, the maximum;
with an odd number of workers the last one starts at 0 itself.  From there
EASGD's centre stays at the average (a stationary point that is not a
minimum) while LSGD's workers follow a leader into one well.

Arrays are float64 by default (the tests ask for gradient norms below 1e-6);
the functions accept any floating dtype and keep it.
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
    """Starting points, one row per worker, in mirror-image wells.

    Row ``2k`` is drawn uniformly from ``[low, high]^dim`` (inside the basin
    of the minimum ``(1, ..., 1)`` when ``0 < low``), row ``2k + 1`` is its
    negative; an unpaired last row is 0.  The rows sum to exactly 0.

    Parameters
    ----------
    workers : int
        Number of rows (>= 1).
    dim : int
        Number of coordinates (>= 1).
    seed : int
        Seed of the draws; every rank can rebuild all rows.
    low, high : float
        Range of the positive coordinates, ``0 < low <= high``.
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
