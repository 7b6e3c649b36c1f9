"""The linear-regression task and the N-worker simulator of Top-k / RegTop-k; the paper's claim at full size."""

import numpy as np
import pytest

from mpiopt.algorithms.topk import Sparsifier
from mpiopt.sim.topk import simulate
from mpiopt.tasks.linreg import make_problem


def test_problem_optimum_and_heterogeneity():
    problem = make_problem(num_workers=6, dim=12, samples=40, seed=2)
    grads = np.array([problem.hessians[n] @ problem.optimum - problem.offsets[n] for n in range(6)])
    # x* is stationary for the sum of the losses (the least-squares solution over all data) ...
    assert np.abs(grads.sum(axis=0)).max() < 1e-10
    # ... but not for any single worker: their means differ.
    assert np.linalg.norm(grads, axis=1).min() > 1.0
    assert np.allclose(problem.hessians, problem.hessians.transpose(0, 2, 1))
    # Worker n's data depends on (seed, n) only.
    fewer = make_problem(num_workers=2, dim=12, samples=40, seed=2)
    assert np.array_equal(fewer.hessians, problem.hessians[:2]) and np.array_equal(fewer.offsets, problem.offsets[:2])
    g = problem.gradient(3, np.ones(12, np.float32))
    assert g.dtype == np.float32 and np.allclose(g, problem.hessians[3].sum(axis=1) - problem.offsets[3], rtol=1e-6)


def test_full_density_is_gradient_descent():
    """density=1.0: every worker sends everything, so the run is full-batch GD on the mean loss."""
    problem = make_problem(num_workers=3, dim=10, samples=50, seed=1)
    steps, lr = 40, 0.05
    run = simulate(problem, Sparsifier(density=1.0), steps, lr=lr)
    x = np.zeros(problem.dim)
    distances = [problem.squared_distance(x)]
    for _ in range(steps):
        x = x - lr * np.mean([problem.hessians[n] @ x - problem.offsets[n] for n in range(3)], axis=0)
        distances.append(problem.squared_distance(x))
    assert np.abs(run.params - x).max() < 1e-5 * np.abs(x).max()
    assert np.allclose(run.squared_distance, distances, rtol=1e-4, atol=1e-9)


def _reference(problem, steps, lr, k, mu):
    """Top-k / RegTop-k with error feedback for N workers written out in plain numpy (float64 update)."""
    n_workers, d = problem.num_workers, problem.dim
    x = np.zeros(d)
    error = np.zeros((n_workers, d), np.float32)
    previous = [None] * n_workers
    aggregate = np.zeros(d)
    for _ in range(steps):
        sent = []
        for n in range(n_workers):
            acc = error[n] + problem.gradient(n, x.astype(np.float32))
            scores = np.abs(acc.astype(np.float64))
            if mu is not None and previous[n] is not None:
                indices, values = previous[n]
                share = values / n_workers
                scores[indices] *= np.tanh(np.abs(1 + (aggregate[indices] - share) / share) / mu)
            chosen = np.sort(np.argsort(-scores, kind="stable")[:k])
            sent.append((chosen, acc[chosen].astype(np.float64)))
            error[n] = acc
            error[n][chosen] = 0
        aggregate = np.zeros(d)
        for chosen, values in sent:
            aggregate[chosen] += values
        aggregate /= n_workers
        previous = sent
        x = x - lr * aggregate
    return x


@pytest.mark.parametrize("mu", [None, 3.0])
def test_simulation_matches_a_plain_numpy_reference(mu):
    problem = make_problem(num_workers=3, dim=30, samples=60, seed=4)
    steps, lr, k = 40, 0.03, 9
    run = simulate(problem, Sparsifier(k=k, mu=mu), steps, lr=lr)
    expected = _reference(problem, steps, lr, k, mu)
    assert np.abs(run.params - expected).max() < 1e-5 * (1 + np.abs(expected).max())


def test_topk_and_regtopk_differ_where_workers_cancel():
    """Same problem, same k: the two rules make different selections (RegTop-k is not Top-k in disguise)."""
    problem = make_problem(num_workers=4, dim=20, samples=100, seed=0)
    top = simulate(problem, Sparsifier(density=0.5), 30)
    reg = simulate(problem, Sparsifier(density=0.5, mu=4.0), 30)
    assert np.array_equal(top.squared_distance[:2], reg.squared_distance[:2])  # the first round ranks alike
    assert not np.array_equal(top.params, reg.params)


def test_paper_claim_topk_plateaus_regtopk_converges():
    """Bereyhi et al.'s linear regression at full size: 20 workers, d = 100, 500 samples each, heterogeneous
    means, full-batch gradients, lr 0.01, density 0.7 (k = 70), mu = 4.

    Top-k stays at a fixed distance from x*: over the last 200 of 700 iterations ||x - x*||^2 never drops
    below 1e-4 and does not trend down.  RegTop-k converges to x*: it reaches the float32 floor (~1e-8)
    by about iteration 450 and stays below 1e-6 in most iterations; the exceptions are one-step
    excursions (a worker breaks the common selection, the others send the matching mass the next step).
    """
    problem = make_problem()
    assert (problem.num_workers, problem.dim) == (20, 100)
    steps = 700
    top = simulate(problem, Sparsifier(density=0.7), steps).squared_distance
    reg = simulate(problem, Sparsifier(density=0.7, mu=4.0), steps).squared_distance
    window = slice(steps - 200, steps + 1)
    first, second = np.median(top[steps - 200 : steps - 100]), np.median(top[steps - 100 :])
    assert top[window].min() > 1e-4, top[window].min()
    assert 0.5 < second / first < 2.0, (first, second)  # a plateau, not slow convergence
    assert np.median(reg[window]) < 1e-6, np.median(reg[window])
    assert np.mean(reg[window] < 1e-6) > 0.75
    assert np.median(reg[window]) < 1e-3 * top[window].min()
