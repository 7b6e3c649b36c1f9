"""The streaming-PCA task: problem, samples, gradient (1), metric (2), self-normalisation."""

import numpy as np
import pytest

from mpiopt.tasks.pca import DIVERGED_NORM, PCAStream, diverged, gradient, make_problem, sin2


def test_problem_has_the_documented_spectrum_and_top_eigenvector():
    problem = make_problem()
    assert problem.dim == 16 and problem.gap == pytest.approx(0.4)
    assert np.allclose(problem.eigenvalues, np.concatenate([[1.0], np.linspace(0.6, 0.1, 15)]), rtol=0, atol=1e-15)
    assert np.all(np.diff(problem.eigenvalues) <= 0)
    assert np.allclose(problem.basis.T @ problem.basis, np.eye(16), atol=1e-12)
    # Independent: the eigen-decomposition of the dense covariance.
    values, vectors = np.linalg.eigh(problem.covariance())
    assert np.allclose(values[::-1], problem.eigenvalues, atol=1e-12)
    assert abs(vectors[:, -1] @ problem.top) == pytest.approx(1.0, abs=1e-12)
    assert np.array_equal(make_problem(seed=3).basis, make_problem(seed=3).basis)
    assert not np.allclose(make_problem(seed=3).basis, problem.basis)


@pytest.mark.parametrize(
    "kwargs", [dict(dim=1), dict(dim=2.0), dict(top=0.5, second=0.6), dict(last=0.0), dict(second=0.1, last=0.2)]
)
def test_problem_rejects_no_gap_or_bad_dimension(kwargs):
    with pytest.raises(ValueError, match="dim|eigenvalues"):
        make_problem(**kwargs)


def test_samples_are_deterministic_per_stream_and_have_covariance_sigma():
    problem = make_problem()
    a = problem.samples(seed=1, steps=20000, batch_size=2)
    assert a.shape == (20000, 2, 16) and a.dtype == np.float32
    assert np.array_equal(a, problem.samples(seed=1, steps=20000, batch_size=2))
    assert not np.array_equal(a[:10], problem.samples(seed=1, steps=10, batch_size=2, key=1))
    assert not np.array_equal(a[:10], problem.samples(seed=2, steps=10, batch_size=2))
    x = a.reshape(-1, 16).astype(np.float64)
    # 40000 samples: entries of the empirical covariance are within ~4 standard errors (~0.02).
    assert np.abs(x.T @ x / len(x) - problem.covariance()).max() < 0.03
    v = problem.initial(seed=5)
    assert v.dtype == np.float32 and np.linalg.norm(v) == pytest.approx(1.0, abs=1e-6)


@pytest.mark.parametrize("scale", [1.0, 1.7])
def test_gradient_against_float64_definition(scale):
    problem = make_problem()
    v = (scale * problem.initial(seed=4)).astype(np.float32)
    x = problem.samples(seed=3, steps=1, batch_size=5)[0]
    v64, x64 = v.astype(np.float64), x.astype(np.float64)
    c = x64.T @ x64 / 5
    expect = -(np.eye(16) - np.outer(v64, v64)) @ c @ v64
    out = np.full(16, np.nan, dtype=np.float32)
    loss = gradient(v, x, out=out)
    assert out.dtype == np.float32
    assert np.allclose(out, expect, rtol=1e-5, atol=1e-5 * np.abs(expect).max())
    assert loss == pytest.approx(-(v64 @ c @ v64) / (v64 @ v64), rel=1e-5)
    fresh = np.empty(16, np.float32)
    assert PCAStream(problem, x[None])(v, 0, fresh) == loss and np.array_equal(fresh, out)


def test_sin2_of_known_angles():
    problem = make_problem()
    u = problem.top
    w = problem.basis[:, 3]
    for theta in (0.0, 0.3, np.pi / 4, 1.2, np.pi / 2):
        v = np.cos(theta) * u + np.sin(theta) * w
        assert sin2(v, u) == pytest.approx(np.sin(theta) ** 2, abs=1e-12)
        assert sin2(-3.0 * v, u) == pytest.approx(np.sin(theta) ** 2, abs=1e-12)  # scale and sign free
    assert sin2(np.zeros(16), u) == 1.0


def test_diverged():
    v = np.ones(16, np.float32) / 4
    assert not diverged(v)
    assert diverged(v * 4 * DIVERGED_NORM)
    for bad in (np.nan, np.inf):
        v[2] = bad
        assert diverged(v)


def test_oja_update_keeps_the_iterate_near_the_sphere_and_finds_the_top_eigenvector():
    """The module's normalisation claim: no projection is needed, (1) pulls ||v|| back to 1."""
    problem = make_problem()
    samples = problem.samples(seed=7, steps=1500, batch_size=8)
    g = np.empty(16, np.float32)
    for start_norm in (0.5, 1.0, 2.0):
        v = start_norm * problem.initial(seed=8)
        for x in samples:
            gradient(v, x, out=g)
            v -= 0.02 * g
        assert abs(np.linalg.norm(v) - 1) < 0.05, start_norm
        assert sin2(v, problem.top) < 0.1


def test_stream_rejects_mismatched_samples():
    problem = make_problem()
    with pytest.raises(ValueError, match="shape"):
        PCAStream(problem, np.zeros((3, 2, 5), np.float32))
    assert len(PCAStream(problem, problem.samples(seed=0, steps=7))) == 7
