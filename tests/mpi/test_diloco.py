"""DiLoCo: the outer Nesterov step against float64, special cases against sgd and the inner update, resume, validation."""

import numpy as np
import pytest
from mpi4py import MPI

import mpiopt

pytestmark = pytest.mark.mpi


def _grad(rank, step, n):
    return np.random.default_rng([11, rank, step]).standard_normal(n).astype(np.float32)


def _initial(n):
    return np.random.default_rng(5).standard_normal(n).astype(np.float32)


def test_outer_nesterov_against_float64(topology):
    """Inner momentum SGD for H steps per rank, then torch.optim.SGD's Nesterov rule on the mean pseudo-gradient, in float64."""
    rank, size, n, H, steps = topology.rank, topology.size, 30, 3, 10
    lr, mom, olr, omom = 0.05, 0.9, 0.7, 0.9
    alg = mpiopt.create("diloco", topology, lr=lr, momentum=mom, period=H, outer_lr=olr, outer_momentum=omom)
    params = _initial(n)
    alg.setup(params)
    x = [_initial(n).astype(np.float64) for _ in range(size)]
    buf, start, ob = [None] * size, x[0].copy(), None
    errors = []
    for t in range(1, steps + 1):
        alg.step(params, _grad(rank, t, n))
        for r in range(size):
            g = _grad(r, t, n).astype(np.float64)
            buf[r] = g if buf[r] is None else mom * buf[r] + g
            x[r] = x[r] - lr * buf[r]
        if t % H == 0:
            delta = start - np.mean(x, axis=0)
            ob = delta if ob is None else omom * ob + delta
            start = start - olr * (delta + omom * ob)
            x = [start.copy() for _ in range(size)]
        errors.append(np.abs(params - x[rank]).max() / (1 + np.abs(x[rank]).max()))
    assert max(errors) < 1e-5, errors  # float32 against float64 over 10 steps: a few float32 ulps of O(1) values
    assert alg.ledger["world.Allreduce"].calls == 1 + steps // H  # setup's common start, then one per outer step


def test_period_one_plain_outer_is_sgd(topology):
    """H = 1, outer lr 1, momentum 0: the mean of x - lr g_i is sgd's x - lr mean(g), to rounding."""
    rank, n = topology.rank, 40
    a = mpiopt.create("diloco", topology, lr=0.1, period=1, outer_lr=1.0, outer_momentum=0.0)
    b = mpiopt.create("sgd", topology, lr=0.1)
    pa, pb = _initial(n), _initial(n)
    a.setup(pa)
    b.setup(pb)
    for t in range(1, 9):
        a.step(pa, _grad(rank, t, n))
        b.step(pb, _grad(rank, t, n))
    # Averaging parameters vs averaging gradients differ by the roundings of the sums: a few float32 ulps of |x| ~ 3.
    np.testing.assert_allclose(pa, pb, rtol=0, atol=1e-5)


def test_one_rank_outer_identity_is_the_inner_update_bitwise():
    topology = mpiopt.Topology(MPI.COMM_SELF)
    n = 25
    a = mpiopt.create("diloco", topology, lr=0.1, momentum=0.9, period=3, outer_lr=1.0, outer_momentum=0.0)
    b = mpiopt.create("sgd", topology, lr=0.1, momentum=0.9)
    pa, pb = _initial(n), _initial(n)
    a.setup(pa)
    b.setup(pb)
    for t in range(1, 11):
        a.step(pa, _grad(0, t, n))
        b.step(pb, _grad(0, t, n))
        assert np.array_equal(pa, pb)


def test_one_rank_outer_identity_with_inner_adamw_bitwise():
    torch = pytest.importorskip("torch")
    from mpiopt.torch import DistributedOptimizer

    topology = mpiopt.Topology(MPI.COMM_SELF)
    torch.manual_seed(0)
    m1 = torch.nn.Linear(6, 3)
    m2 = torch.nn.Linear(6, 3)
    m2.load_state_dict(m1.state_dict())
    ref = torch.optim.AdamW(m2.parameters(), lr=0.01)
    opt = DistributedOptimizer(
        m1.parameters(), "diloco", topology=topology, inner=torch.optim.AdamW(m1.parameters(), lr=0.01),
        period=2, outer_lr=1.0, outer_momentum=0.0,
    )
    for t in range(7):
        x = torch.randn(4, 6, generator=torch.Generator().manual_seed(t))
        for m, o in ((m1, opt), (m2, ref)):
            o.zero_grad()
            m(x).square().sum().backward()
            o.step()
        for p, q in zip(m1.parameters(), m2.parameters()):
            assert torch.equal(p, q)


def test_state_dict_resume_is_bitwise(topology):
    rank, n = topology.rank, 20
    hyper = dict(lr=0.05, momentum=0.9, period=3, outer_lr=0.7, outer_momentum=0.9)
    alg = mpiopt.create("diloco", topology, **hyper)
    params = _initial(n)
    alg.setup(params)
    for t in range(1, 5):  # past one outer step, in the middle of the next period
        alg.step(params, _grad(rank, t, n))
    state, saved = alg.state_dict(), params.copy()
    for t in range(5, 11):
        alg.step(params, _grad(rank, t, n))
    fresh = mpiopt.create("diloco", topology, **hyper)
    resumed = saved.copy()
    fresh.setup(resumed)
    resumed[...] = saved
    fresh.load_state_dict(state)
    for t in range(5, 11):
        fresh.step(resumed, _grad(rank, t, n))
    assert np.array_equal(params, resumed)


@pytest.mark.parametrize("key, value", [("period", 0), ("outer_lr", -0.5), ("outer_momentum", 1.5), ("outer_momentum", -0.1)])
def test_bad_hyperparameters_name_the_value(topology, key, value):
    with pytest.raises(ValueError, match=str(value)):
        mpiopt.create("diloco", topology, **{key: value})
