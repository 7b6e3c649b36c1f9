"""The symmetric-wells objective: derivatives against finite differences, its stationary points, the starts."""

from __future__ import annotations

import numpy as np
import pytest

from mpiopt.tasks import symmetric


def test_gradient_and_hessian_match_finite_differences():
    x = np.random.default_rng(0).uniform(-1.5, 1.5, 6)
    h = 1e-6
    eye = np.eye(x.size)
    fd_grad = np.array([(symmetric.loss(x + h * e) - symmetric.loss(x - h * e)) / (2 * h) for e in eye])
    np.testing.assert_allclose(symmetric.gradient(x), fd_grad, rtol=1e-6, atol=1e-6)
    fd_hess = np.array([(symmetric.gradient(x + h * e) - symmetric.gradient(x - h * e)) / (2 * h) for e in eye])
    np.testing.assert_allclose(fd_hess, np.diag(symmetric.hessian_eigenvalues(x)), rtol=1e-6, atol=1e-5)


def test_gradient_writes_into_out_and_keeps_dtype():
    x = np.array([0.5, -2.0], dtype=np.float32)
    out = np.empty_like(x)
    assert symmetric.gradient(x, out=out) is out
    np.testing.assert_array_equal(out, np.float32(4) * x * (x * x - 1))


def test_minima_are_the_sign_vectors_and_zero_is_a_maximum():
    for corner in (np.ones(3), -np.ones(3), np.array([1.0, -1.0, 1.0])):
        assert symmetric.loss(corner) == 0 and symmetric.is_local_minimum(corner)
    zero = np.zeros(3)
    assert not symmetric.gradient(zero).any() and symmetric.loss(zero) == 3
    assert np.all(symmetric.hessian_eigenvalues(zero) == -4) and not symmetric.is_local_minimum(zero)
    saddle = np.array([1.0, 0.0, -1.0])
    assert not symmetric.gradient(saddle).any() and not symmetric.is_local_minimum(saddle)
    assert not symmetric.is_local_minimum(np.full(3, 0.9))  # in a well, not at its bottom


@pytest.mark.parametrize("workers", [1, 2, 3, 4, 5])
def test_mirrored_starts_pair_up_and_cancel(workers):
    starts = symmetric.mirrored_starts(workers, 4, seed=3)
    assert starts.shape == (workers, 4)
    assert not starts.sum(axis=0).any()  # exactly 0: the average is the maximum
    pairs = workers // 2
    np.testing.assert_array_equal(starts[1 : 2 * pairs : 2], -starts[0 : 2 * pairs : 2])
    assert np.all((starts[0 : 2 * pairs : 2] >= 0.3) & (starts[0 : 2 * pairs : 2] <= 1.6))
    if workers % 2:
        assert not starts[-1].any()
    np.testing.assert_array_equal(starts, symmetric.mirrored_starts(workers, 4, seed=3))


def test_mirrored_starts_validate():
    with pytest.raises(ValueError, match="workers"):
        symmetric.mirrored_starts(0, 3)
    with pytest.raises(ValueError, match="low"):
        symmetric.mirrored_starts(2, 3, low=0.0)
