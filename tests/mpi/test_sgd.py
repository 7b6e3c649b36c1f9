"""Data-parallel SGD: torch.optim.SGD on the averaged gradient; bytes; NaN policy; resume; agreement."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import mpiopt
from mpiopt.comm import SetupMismatchError

pytestmark = pytest.mark.mpi

D = 257
SETTINGS = [
    dict(momentum=0.9, nesterov=True, weight_decay=1e-2),
    dict(momentum=0.9, dampening=0.1, weight_decay=1e-3),
    dict(momentum=0.0, weight_decay=0.0),
]


def rank_grads(steps: int, rank: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng([seed, rank]).standard_normal((steps, D)).astype(np.float32)


@pytest.mark.parametrize("settings", SETTINGS)
def test_matches_torch_sgd_on_the_averaged_gradient(topology, settings):
    P, steps, lr = topology.size, 50, 0.05
    x0 = np.random.default_rng(1).standard_normal(D).astype(np.float32)
    params = x0.copy()
    alg = mpiopt.create("sgd", topology, lr=lr, **settings)
    alg.setup(params)
    mine = rank_grads(steps, topology.rank)
    for g in mine:
        alg.step(params, g)
    # Reference: torch.optim.SGD fed the float64 mean of every rank's gradient.
    mean = np.mean([rank_grads(steps, r) for r in range(P)], axis=0, dtype=np.float64).astype(np.float32)
    ref = torch.nn.Parameter(torch.from_numpy(x0.copy()))
    opt = torch.optim.SGD([ref], lr=lr, **settings)
    for g in mean:
        ref.grad = torch.from_numpy(g)
        opt.step()
    expect = ref.detach().numpy()
    rel = np.max(np.abs(params - expect)) / np.max(np.abs(expect))
    assert rel < (2e-6 if P == 1 else 1e-5), rel


def test_one_allreduce_of_4d_bytes_per_step(topology):
    params = np.zeros(D, np.float32)
    alg = mpiopt.create("sgd", topology, lr=0.1, momentum=0.9, weight_decay=0.01)
    alg.setup(params)
    grad = np.ones(D, np.float32)
    record = alg.step(params, grad, loss=1.5)
    np.testing.assert_array_equal(grad, np.ones(D, np.float32))  # read only, also where the step reads it directly (one rank)
    wire = 4 * D if topology.size > 1 else 0
    assert (record.bytes_sent, record.bytes_recv, record.loss, record.step) == (wire, wire, 1.5, 1)
    assert record.comm_seconds >= 0 and record.algo_seconds >= 0
    # The step's (none at one rank, whose sum is its own gradient: no copy); the set-up's agreement is a decision,
    # not the algorithm's traffic, and stays out of the ledger.
    assert topology.ledger["world.Allreduce"].calls == (1 if topology.size > 1 else 0)
    np.testing.assert_array_equal(params, np.full(D, -0.1, np.float32))


@pytest.mark.parametrize("inner", [False, True], ids=["built-in", "inner"])
def test_nan_raise_names_the_rank(inner):
    # Without the abort (the default aborts the job: tests/e2e/test_no_hang.py) the error is raised.  An inner
    # optimizer at one rank is checked on a helper thread while it steps, at more in the division of the sum.
    topology = mpiopt.Topology(abort_on_error=False)
    params = np.zeros(D, np.float32)
    alg = mpiopt.create("sgd", topology, lr=0.1)
    if inner:
        alg.use_inner(lambda p, g: p.__isub__(g), "descent", grad_buffer=np.empty(D, np.float32))
    alg.setup(params)
    grad = np.zeros(D, np.float32)
    grad[3] = np.nan
    with pytest.raises(FloatingPointError, match=f"non-finite gradient on rank {topology.rank} at step 1"):
        alg.step(params, grad)
    topology.Free()


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("overlap", [False, True], ids=["step", "step_reduced"])
@pytest.mark.parametrize("inner", [False, True, "in-grad"], ids=["built-in", "inner", "inner-reading-grad"])
def test_a_non_finite_sum_names_the_rank_on_every_rank(overlap, inner):
    # The sum is checked in the update's pass (the built-in one, or the division into an inner optimizer's
    # gradient), not in a pass over the own gradient first: every rank holds it, so every rank raises, each
    # naming the rank whose own gradient was not finite; the inner step is not taken.
    topology = mpiopt.Topology(abort_on_error=False)
    params = np.zeros(D, np.float32)
    alg = mpiopt.create("sgd", topology, lr=0.1)
    inner_steps = []
    grad = np.ones(D, np.float32)
    if inner:  # "in-grad": the torch front end's arrangement, where the inner optimizer reads the mean in .grad
        alg.use_inner(lambda p, g: inner_steps.append(1), "counting", grad_buffer=grad if inner == "in-grad" else np.empty(D, np.float32))
    alg.setup(params)
    if topology.rank == 1:
        grad[5] = np.inf
    # Where the mean replaced the own gradient, no rank can tell whose it was: every rank says so, none blames itself.
    named = "sgd: non-finite gradient on rank 1 at step 1" if inner != "in-grad" else (
        "sgd: the mean of the ranks' gradients is not finite at step 1 .*the rank at fault is not named")
    with pytest.raises(FloatingPointError, match=named):
        if overlap:
            total = np.empty_like(grad)
            topology.world.Allreduce(grad, out=total)
            alg.step_reduced(params, grad, total)
        else:
            alg.step(params, grad)
    big = np.full(D, np.finfo(np.float32).max, np.float32)  # every rank's finite, their sum not
    with pytest.raises(FloatingPointError, match="the sum of the ranks' gradients overflowed at step 1" if inner != "in-grad" else named):
        grad[...] = big
        alg.step(params, grad)
    assert inner_steps == []
    topology.Free()


@pytest.mark.mpi(min_size=2)
def test_nan_skip_is_collective(topology):
    params = np.zeros(D, np.float32)
    alg = mpiopt.create("sgd", topology, lr=0.1, nan_policy="skip")
    alg.setup(params)
    grad = np.ones(D, np.float32)
    if topology.rank == 1:
        grad[0] = np.inf
    record = alg.step(params, grad)
    assert record.skipped and alg.steps == 0 and not params.any()
    record = alg.step(params, np.ones(D, np.float32))
    assert not record.skipped and alg.steps == 1
    np.testing.assert_allclose(params, -0.1)


def test_state_dict_resume_is_bitwise(topology, bitwise_resume):
    settings = dict(lr=0.1, momentum=0.9, nesterov=True, weight_decay=1e-4)
    bitwise_resume(topology, "sgd", settings, np.ones(D, np.float32), rank_grads(20, topology.rank, seed=5), 10)


def test_load_state_dict_rejects_foreign_state(topology):
    alg = mpiopt.create("sgd", topology, lr=0.1)
    alg.setup(np.zeros(4, np.float32))
    with pytest.raises(ValueError, match="state is for algorithm 'lsgd'"):
        alg.load_state_dict({"algorithm": "lsgd"})


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        (dict(lr=-1.0), ValueError, "lr must be > 0, got -1.0"),
        (dict(lr="fast"), TypeError, "lr must be a finite number, got 'fast'"),
        (dict(momentum=1.0), ValueError, r"momentum must be in \[0.0, 1.0\), got 1.0"),
        (dict(nesterov=True), ValueError, "nesterov=True needs momentum > 0"),
        (dict(nan_policy="ignore"), ValueError, "nan_policy must be one of 'raise', 'skip'; got 'ignore'"),
        (dict(bogus=1), TypeError, "bogus"),
        (dict(lr=np.float32("nan")), TypeError, "lr must be a finite number"),
    ],
)
def test_bad_hyperparameters(topology, kwargs, error, match):
    with pytest.raises(error, match=match):
        mpiopt.create("sgd", topology, **kwargs)


def test_numpy_scalars_are_accepted(topology):
    alg = mpiopt.create("sgd", topology, lr=np.float32(0.5), momentum=np.float64(0.9))
    assert (alg.lr, alg.local.momentum) == (0.5, 0.9)


def test_bad_buffers(topology):
    alg = mpiopt.create("sgd", topology, lr=0.1)
    with pytest.raises(RuntimeError, match="setup"):
        alg.step(np.zeros(3, np.float32), np.zeros(3, np.float32))
    with pytest.raises(ValueError, match="contiguous 1-D"):
        alg.setup(np.zeros((2, 2), np.float32))
    with pytest.raises(TypeError, match="floating-point"):
        alg.setup(np.zeros(3, np.int32))
    alg.setup(np.zeros(3, np.float32))
    with pytest.raises(ValueError, match="grad has 4 elements of float32; set-up was 3 of float32"):
        alg.step(np.zeros(3, np.float32), np.zeros(4, np.float32))


@pytest.mark.mpi(min_size=2)
def test_ranks_that_disagree_get_the_same_error(topology):
    lr = 0.1 if topology.rank else 0.2
    alg = mpiopt.create("sgd", topology, lr=lr)
    with pytest.raises(SetupMismatchError) as err:
        alg.setup(np.zeros(D + (topology.rank == 1), np.float32))
    messages = topology.world.allgather_obj(str(err.value))
    assert len(set(messages)) == 1
    assert "num_params" in messages[0] and f"rank 1: {D + 1}" in messages[0]


def test_unknown_algorithm(topology):
    with pytest.raises(ValueError, match="unknown algorithm 'adam'; available: .*sgd"):
        mpiopt.create("adam", topology)


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize(
    "differs, key",
    [(dict(lr=0.2), "lr"), (dict(nan_policy="skip"), "nan_policy"), (dict(momentum=0.5), "hyperparameters")],
)
def test_ranks_must_agree_on_every_setting(topology, differs, key):
    settings = dict(lr=0.1, momentum=0.9)
    if topology.rank == 1:
        settings.update(differs)
    alg = mpiopt.create("sgd", topology, **settings)
    with pytest.raises(SetupMismatchError) as err:
        alg.setup(np.zeros(D, np.float32))
    messages = topology.world.allgather_obj(str(err.value))
    assert len(set(messages)) == 1 and f"  {key}:" in messages[0], messages[0]
