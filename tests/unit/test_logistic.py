"""The logistic-regression task: determinism, per-rank data, loss and gradient."""

import numpy as np
import pytest

from mpiopt.tasks.logistic import gradient, loss, make_data, make_global_data, optimum


def _loss64(w, data, l2):
    """Float64 re-computation of the objective, straight from its definition."""
    x, y = data.features.astype(np.float64), data.labels.astype(np.float64)
    z = x @ w
    return np.mean(np.log1p(np.exp(z)) - y * z) + 0.5 * l2 * w @ w


def test_data_deterministic_and_different_per_rank():
    a, b, other = make_data(1, seed=3), make_data(1, seed=3), make_data(2, seed=3)
    assert np.array_equal(a.features, b.features) and np.array_equal(a.labels, b.labels)
    assert not np.array_equal(a.features, other.features)
    assert a.features.dtype == np.float32 and a.labels.dtype == np.float32
    assert np.all(a.features[:, -1] == 1) and set(np.unique(a.labels)) == {0.0, 1.0}
    # Heterogeneous: the feature means of two ranks differ by far more than sampling noise.
    assert np.abs(a.features[:, :-1].mean(0) - other.features[:, :-1].mean(0)).max() > 0.5
    both = make_global_data(range(2), seed=3)
    assert both.num_samples == 2 * a.num_samples
    assert np.array_equal(both.features[a.num_samples:], make_data(1, seed=3).features)


@pytest.mark.parametrize("l2", [0.0, 0.1])
def test_loss_and_gradient_against_float64_and_finite_differences(l2):
    data = make_data(0, seed=1, num_samples=64, num_features=6)
    rng = np.random.default_rng(0)
    w = rng.standard_normal(6).astype(np.float32)
    value = loss(w, data, l2)
    grad = gradient(w, data, l2)
    assert value.dtype == np.float32 and grad.dtype == np.float32
    w64 = w.astype(np.float64)
    assert value == pytest.approx(_loss64(w64, data, l2), rel=1e-5)
    # Central differences of the float64 objective: error O(h^2), far below the tolerance.
    h = 1e-5
    numeric = np.array([(_loss64(w64 + h * e, data, l2) - _loss64(w64 - h * e, data, l2)) / (2 * h) for e in np.eye(6)])
    np.testing.assert_allclose(grad, numeric, rtol=1e-4, atol=1e-6)
    out = np.empty(6, np.float32)
    assert gradient(w, data, l2, out=out) is out and np.array_equal(out, grad)


def test_no_overflow_for_large_logits():
    data = make_data(0, num_samples=16, num_features=4)
    w = np.full(4, 1e4, dtype=np.float32)
    assert np.isfinite(loss(w, data)) and np.all(np.isfinite(gradient(w, data)))


def test_optimum_is_stationary_and_minimal():
    data = make_global_data(range(3), seed=2, num_samples=100, num_features=5)
    w = optimum(data, l2=1e-3)
    assert np.abs(gradient(w.astype(np.float32), data, 1e-3)).max() < 1e-5
    rng = np.random.default_rng(1)
    for _ in range(5):
        assert _loss64(w, data, 1e-3) < _loss64(w + 0.01 * rng.standard_normal(5), data, 1e-3)


def test_minibatch_sampling():
    data = make_data(0, num_samples=50)
    batch = data.sample(np.random.default_rng(0), 8)
    assert batch.num_samples == 8 and batch.num_features == data.num_features
    rows = {tuple(r) for r in data.features}
    assert all(tuple(r) in rows for r in batch.features)


def test_bad_arguments():
    with pytest.raises(ValueError, match="num_features"):
        make_data(0, num_features=1)
