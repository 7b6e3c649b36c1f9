"""Async-MSGD in the deterministic mode: torch equivalence at tau = 0, the delayed rule, the trade-off."""

import numpy as np
import pytest
import torch

from mpiopt.algorithms.async_msgd import AsyncMSGDRule
from mpiopt.asyncrt.simulated import FixedDelay, RandomDelay, simulate
from mpiopt.bench.tradeoff import markdown_table, tradeoff_grid
from mpiopt.tasks.pca import PCAStream, make_problem


def _rule(params, lr, momentum):
    rule = AsyncMSGDRule(lr, momentum)
    rule.allocate(params)
    return rule


@pytest.mark.parametrize("momentum", [0.0, 0.5, 0.9])
def test_delay_zero_is_torch_sgd_with_momentum(momentum):
    """tau = 0, one worker: torch.optim.SGD(lr, momentum, dampening=0), first step included, on PCA."""
    problem, lr, steps = make_problem(), 0.02, 60
    stream = PCAStream(problem, problem.samples(seed=1, steps=steps, batch_size=4))
    v0 = problem.initial(seed=2)
    g = np.empty_like(v0)
    # The first step has no momentum: x_1 = x_0 - lr g_0.
    v1 = v0.copy()
    simulate(v1, _rule(v1, lr, momentum), stream, 1)
    stream(v0, 0, g)
    assert np.allclose(v1, v0 - np.float32(lr) * g, rtol=0, atol=1e-7)
    v = v0.copy()
    result = simulate(v, _rule(v, lr, momentum), stream, steps, delay=0)
    ref = torch.nn.Parameter(torch.from_numpy(v0.copy()))
    opt = torch.optim.SGD([ref], lr=lr, momentum=momentum, dampening=0)
    for k in range(steps):
        stream(ref.detach().numpy(), k, g)
        ref.grad = torch.from_numpy(g.copy())
        opt.step()
        if k == 0:
            assert np.allclose(ref.detach().numpy(), v1, rtol=0, atol=1e-7)
    expect = ref.detach().numpy()
    assert result.version == steps and result.histogram() == {0: steps}
    assert np.max(np.abs(v - expect)) < 1e-5 * np.max(np.abs(expect))


def _heavy_ball_float64(problem, samples, v0, lr, momentum, taus):
    """(1) written out: x_{k+1} = x_k - lr g(x_{k - tau_k}) + mu (x_k - x_{k-1}), x_{-1} = x_0, in float64."""
    xs = [v0.astype(np.float64)]
    previous = xs[0]
    for k, tau in enumerate(taus):
        stale = xs[k - tau]
        c = samples[k].astype(np.float64).T @ samples[k].astype(np.float64) / samples.shape[1]
        g = -(c @ stale - stale * (stale @ c @ stale))
        xs.append(xs[k] - lr * g + momentum * (xs[k] - previous))
        previous = xs[k]
    return xs[-1]


@pytest.mark.parametrize("delay, tau_max", [(FixedDelay(3), 3), (RandomDelay(5, seed=4), 5), (7, 7)])
def test_stale_gradient_rule_against_float64(delay, tau_max):
    problem, lr, momentum, steps = make_problem(), 0.02, 0.6, 80
    samples = problem.samples(seed=5, steps=steps, batch_size=4)
    v0 = problem.initial(seed=6)
    v = v0.copy()
    arrivals = []
    rule = _rule(v, lr, momentum)

    def apply(params, grad, arrival):
        arrivals.append(arrival)
        rule(params, grad, arrival)

    result = simulate(v, apply, PCAStream(problem, samples), steps, delay=delay)
    taus = [a.staleness for a in arrivals]
    if isinstance(delay, RandomDelay):
        assert taus == list(RandomDelay(5, seed=4).delays(steps))  # reproducible
        assert len(set(taus[5:])) > 3  # and random
    else:
        assert taus == [min(tau_max, k) for k in range(steps)]
    assert all(0 <= t <= min(tau_max, k) for k, t in enumerate(taus))
    assert [a.version for a in arrivals] == [k - t for k, t in enumerate(taus)]
    assert result.histogram() == {t: taus.count(t) for t in set(taus)} and result.version == steps
    expect = _heavy_ball_float64(problem, samples, v0, lr, momentum, taus)
    assert np.max(np.abs(v - expect)) < 1e-4 * np.max(np.abs(expect))
    # The delay matters: the same run without it ends elsewhere.
    undelayed = _heavy_ball_float64(problem, samples, v0, lr, momentum, [0] * steps)
    assert np.max(np.abs(undelayed - expect)) > 1e-3 * np.max(np.abs(expect))


def test_until_stops_early_and_bad_arguments_are_refused():
    problem = make_problem()
    v = problem.initial(seed=1)
    result = simulate(v, _rule(v, 0.02, 0.5), PCAStream(problem, problem.samples(1, 100)), 100, until=lambda p, k: k == 10)
    assert result.version == 10 and result.stopped_early and result.applied.tolist() == [10]
    with pytest.raises(ValueError, match="steps must be >= 0, got -1"):
        simulate(v, _rule(v, 0.02, 0.5), PCAStream(problem, problem.samples(1, 1)), -1)
    with pytest.raises(TypeError, match="steps must be an integer"):
        simulate(v, _rule(v, 0.02, 0.5), PCAStream(problem, problem.samples(1, 1)), 2.0)
    with pytest.raises(TypeError, match="numpy"):
        simulate(list(v), _rule(v, 0.02, 0.5), PCAStream(problem, problem.samples(1, 1)), 1)
    with pytest.raises(ValueError, match="delay"):
        FixedDelay(-1)
    with pytest.raises(TypeError, match="max_delay must be an integer, got 1.5"):
        RandomDelay(1.5)
    with pytest.raises(ValueError, match="lr"):
        AsyncMSGDRule(0.0, 0.5)
    with pytest.raises(ValueError, match="momentum"):
        AsyncMSGDRule(0.1, 1.0)


def test_asynchrony_momentum_tradeoff_on_streaming_pca():
    """Liu et al.: the best momentum falls as the delay grows; plain SGD hardly notices the delay."""
    delays, momenta = (0, 8, 32), (0.0, 0.5, 0.7, 0.8, 0.9)
    grid = tradeoff_grid(delays, momenta, seeds=(1, 2, 3))
    table = markdown_table(grid)
    best = grid.best_momentum()
    assert None not in best, table
    assert all(a >= b for a, b in zip(best, best[1:])), table
    assert best[-1] < best[0], table
    sgd = grid.iterations[:, 0]
    assert np.all(np.isfinite(sgd)) and sgd.max() / sgd.min() < 1.15, table
    # Large momentum with the largest delay diverges; with no delay it converges fastest.
    assert grid.status[-1, -1] == "diverged" and best[0] == 0.9, table
    # Momentum does accelerate at every delay (the best cell beats plain SGD clearly).
    assert np.all(np.nanmin(grid.iterations, axis=1) < 0.8 * sgd), table
