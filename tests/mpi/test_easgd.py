"""EASGD/EAMSGD: the elastic pull against a float64 recomputation; alpha = 0 is local SGD; bytes; resume; validation."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from mpi4py import MPI

import mpiopt
from mpiopt.algorithms.local import LocalSGD

pytestmark = pytest.mark.mpi

D = 257


def rank_data(steps: int, rank: int, seed: int = 0):
    """This rank's own start and gradients (ranks differ, so the pull has work to do)."""
    rng = np.random.default_rng([seed, rank])
    return rng.standard_normal(D).astype(np.float32), rng.standard_normal((steps, D)).astype(np.float32)


def gather(x: np.ndarray) -> np.ndarray:
    """Every rank's array, as float64 rows in rank order (the test's own view, not the algorithm's)."""
    return np.array(MPI.COMM_WORLD.allgather(np.asarray(x, dtype=np.float64)))


@pytest.mark.parametrize("given", [dict(beta=0.6), dict(alpha=0.2)])
def test_elastic_pull_matches_float64_formula(topology, given):
    N, rank, lr, period, steps = topology.size, topology.rank, 0.05, 2, 6
    x0, grads = rank_data(steps, rank)
    params = x0.copy()
    alg = mpiopt.create("easgd", topology, lr=lr, period=period, **given)
    alg.setup(params)
    alpha = given.get("alpha", given.get("beta", 0) / N)
    center = gather(x0).mean(axis=0)  # the centre starts at the world average
    errors, centers_agree = [], []
    center_error = [np.max(np.abs(alg.center - center))]
    for t, g in enumerate(grads, start=1):
        # Reference from every rank's actual parameters before the step (float64):
        # local SGD step, then x_i -= alpha (x_i - c) and c += alpha sum_i (x_i - c).
        y = gather(params) - lr * gather(g)
        if t % period == 0:
            expect = y[rank] - alpha * (y[rank] - center)
            center = center + alpha * np.sum(y - center, axis=0)
        else:
            expect = y[rank]
        alg.step(params, g)
        errors.append(np.max(np.abs(params - expect)))
        center_error.append(np.max(np.abs(alg.center - center)))
        centers_agree.append(np.all(gather(alg.center) == alg.center))  # redundant copies stay identical
    assert alg.alpha == pytest.approx(alpha) and alg.beta == pytest.approx(N * alpha)
    assert max(errors) < 1e-5, errors
    assert max(center_error) < 1e-5, center_error
    assert all(centers_agree)
    assert np.max(np.abs(center)) > 0.1  # the test compared something that moved


def test_alpha_zero_is_independent_local_sgd(topology):
    settings = dict(momentum=0.9, nesterov=True, weight_decay=1e-3)
    lr, steps = 0.05, 12
    x0, grads = rank_data(steps, topology.rank, seed=1)
    params = x0.copy()
    alg = mpiopt.create("easgd", topology, lr=lr, alpha=0.0, period=1, **settings)
    alg.setup(params)
    initial_center = alg.center.copy()
    local, alone = LocalSGD(**settings), x0.copy()
    local.allocate(alone)
    ref = torch.nn.Parameter(torch.from_numpy(x0.copy()))
    opt = torch.optim.SGD([ref], lr=lr, **settings)
    for g in grads:
        alg.step(params, g)
        local.apply(alone, g, lr)
        ref.grad = torch.from_numpy(g)
        opt.step()
    np.testing.assert_array_equal(params, alone)  # a pull with alpha = 0 changes no bit
    np.testing.assert_allclose(params, ref.detach().numpy(), rtol=1e-6, atol=1e-6)
    np.testing.assert_array_equal(alg.center, initial_center)


def test_one_allreduce_of_4d_bytes_per_pull(topology):
    params, grad = np.zeros(D, np.float32), np.ones(D, np.float32)
    alg = mpiopt.create("easgd", topology, lr=0.1, period=3)
    alg.setup(params)
    before = topology.ledger.snapshot()
    records = [alg.step(params, grad) for _ in range(6)]
    wire = 4 * D if topology.size > 1 else 0
    assert [(r.bytes_sent, r.bytes_recv) for r in records] == [(0, 0), (0, 0), (wire, wire)] * 2
    assert topology.ledger.since(before)["world.Allreduce"].calls == 2


def test_resume_is_bitwise(topology, bitwise_resume):
    """Run k steps, save; a fresh instance restored from there runs m more steps identically (EAMSGD)."""
    settings = dict(lr=0.05, beta=0.5, period=3, momentum=0.99, nesterov=True, weight_decay=1e-4)
    x0, grads = rank_data(9, topology.rank, seed=2)
    alg, fresh = bitwise_resume(topology, "easgd", settings, x0, grads, 4)
    np.testing.assert_array_equal(fresh.center, alg.center)


def test_defaults_and_validation(topology):
    N = topology.size
    alg = mpiopt.create("easgd", topology)
    assert (alg.beta, alg.period) == (0.9, 4) and alg.alpha == pytest.approx(0.9 / N)
    cases = [
        (dict(alpha=0.1, beta=0.4), ValueError, "alpha or beta"),
        (dict(alpha=-0.1), ValueError, "alpha"),
        (dict(beta="0.5"), TypeError, "beta"),
        (dict(beta=2.0), ValueError, r"beta=2\.0 .*unstable"),
        (dict(alpha=1.0), ValueError, r"alpha=1\.0 .*unstable"),
        (dict(period=0), ValueError, "period"),
        (dict(period=2.5), TypeError, "period"),
        (dict(lr=-1.0), ValueError, "lr"),
        (dict(momentum=1.5), ValueError, "momentum"),
        (dict(tau=4), TypeError, "tau"),
    ]
    for kwargs, error, message in cases:
        with pytest.raises(error, match=message):
            mpiopt.create("easgd", topology, **kwargs)
