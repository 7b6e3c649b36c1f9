"""Logistic regression with different data on every rank, rebuilt from ``(seed, rank)`` without communication.

Feature shifts make local models drift apart, as non-i.i.d. data do.  Objective: docs/internals-tasks.md.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Optional

import numpy as np

__all__ = ["LogisticData", "make_data", "make_global_data", "loss", "gradient", "optimum"]


@dataclass(frozen=True)
class LogisticData:
    """Samples of one rank (or several stacked): float32 ``features`` whose last column is 1, ``labels`` of 0 and 1."""

    features: np.ndarray
    labels: np.ndarray

    @property
    def num_samples(self) -> int:
        return int(self.labels.shape[0])

    @property
    def num_features(self) -> int:
        return int(self.features.shape[1])

    def sample(self, rng: np.random.Generator, batch_size: int) -> "LogisticData":
        """A minibatch of ``batch_size`` samples drawn with replacement."""
        index = rng.integers(0, self.num_samples, size=batch_size)
        return LogisticData(self.features[index], self.labels[index])


def _seed(seed: int, *key: int) -> np.random.Generator:
    # Independent streams: (0,) for the true weights, (1, rank) for a rank's samples.
    return np.random.default_rng(np.random.SeedSequence(seed, spawn_key=key))


def make_data(
    rank: int,
    *,
    seed: int = 0,
    num_samples: int = 256,
    num_features: int = 16,
    shift: float = 1.0,
    concept_shift: float = 0.0,
) -> LogisticData:
    """Rank ``rank``'s samples, the same on every call with the same arguments.

    ``shift`` scales this rank's feature mean (0: i.i.d.); ``concept_shift`` perturbs the true weights per rank,
    so ranks have different local optima.
    """
    if rank < 0 or num_samples < 1 or num_features < 2:
        raise ValueError(f"need rank >= 0, num_samples >= 1, num_features >= 2; got {rank}, {num_samples}, {num_features}")
    scale = 2.0 / np.sqrt(num_features)
    rng = _seed(seed, 1, rank)
    true_weights = _seed(seed, 0).standard_normal(num_features) * scale
    true_weights += concept_shift * scale * rng.standard_normal(num_features)
    mean = shift * rng.standard_normal(num_features - 1)
    features = np.ones((num_samples, num_features))
    features[:, :-1] = mean + rng.standard_normal((num_samples, num_features - 1))
    probability = 1.0 / (1.0 + np.exp(-features @ true_weights))
    labels = (rng.random(num_samples) < probability).astype(np.float32)
    return LogisticData(features.astype(np.float32), labels)


def make_global_data(ranks: Iterable[int], **kwargs) -> LogisticData:
    """The samples of all ``ranks`` stacked: the data of the global objective."""
    parts = [make_data(r, **kwargs) for r in ranks]
    return LogisticData(np.concatenate([p.features for p in parts]), np.concatenate([p.labels for p in parts]))


def _logits(w: np.ndarray, data: LogisticData) -> np.ndarray:
    return data.features @ w.astype(data.features.dtype, copy=False)


def loss(w: np.ndarray, data: LogisticData, l2: float = 0.0) -> np.float32:
    """Mean logistic loss of ``w`` on ``data`` plus ``l2/2 ||w||^2`` (float32)."""
    z = _logits(w, data)
    # log(1 + e^z) - y z, written with logaddexp so large |z| neither overflows nor loses digits.
    value = np.mean(np.logaddexp(np.float32(0), z) - data.labels * z, dtype=np.float32)
    if l2:
        value += np.float32(0.5 * l2) * np.dot(w, w)
    return np.float32(value)


def gradient(w: np.ndarray, data: LogisticData, l2: float = 0.0, out: Optional[np.ndarray] = None) -> np.ndarray:
    """Gradient of :func:`loss` at ``w`` (float32), written into ``out`` when given."""
    z = _logits(w, data)
    # sigmoid(z) = (1 + tanh(z/2)) / 2: no overflow for any z.
    residual = np.tanh(np.float32(0.5) * z)
    residual += np.float32(1)
    residual *= np.float32(0.5)
    residual -= data.labels
    residual /= np.float32(data.num_samples)
    if out is None:
        out = np.empty(data.num_features, dtype=np.float32)
    np.matmul(residual, data.features, out=out)
    if l2:
        out += np.float32(l2) * w
    return out


def optimum(data: LogisticData, l2: float = 0.0, tol: float = 1e-12, max_iter: int = 100) -> np.ndarray:
    """The minimiser of :func:`loss` on ``data`` in float64, by Newton's method (needs ``l2 > 0`` or non-separable data)."""
    x = data.features.astype(np.float64)
    y = data.labels.astype(np.float64)
    n, d = x.shape
    w = np.zeros(d)
    for _ in range(max_iter):
        p = 0.5 * (1.0 + np.tanh(0.5 * (x @ w)))
        grad = x.T @ (p - y) / n + l2 * w
        hessian = (x.T * (p * (1.0 - p))) @ x / n + l2 * np.eye(d)
        step = np.linalg.solve(hessian, grad)
        w -= step
        if np.linalg.norm(step) <= tol * (1.0 + np.linalg.norm(w)):
            break
    return w
