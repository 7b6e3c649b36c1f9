"""Async-MSGD on the real runtime: float64 replay of the asynchronous sequence, torch at tau = 0, PCA, state."""

import time

import numpy as np
import pytest
import torch

import mpiopt
from mpiopt.algorithms.async_msgd import AsyncMSGD
from mpiopt.comm import SetupMismatchError
from mpiopt.tasks.pca import PCAStream, make_problem, sin2

pytestmark = pytest.mark.mpi

LR, MOMENTUM, BATCH = 0.02, 0.6, 4
PROBLEM = make_problem()


def _samples(worker, steps):
    return PROBLEM.samples(seed=11, steps=steps, batch_size=BATCH, key=worker)


def _steps(rank, size):
    # At 3+ ranks rank 1 stops far earlier than the others.
    return 40 if size <= 2 or rank != 1 else 3


def _grad64(v, x):
    c = x.T @ x / x.shape[0]
    return -(c @ v - v * (v @ c @ v))


def test_run_is_the_heavy_ball_rule_on_the_recorded_asynchronous_sequence(topology, monkeypatch):
    """x_{k+1} = x_k - lr g(x_{k - tau_k}) + mu (x_k - x_{k-1}), replayed in float64 from the server's record
    of which worker's which gradient was applied at which version; torch.optim.SGD where tau is always 0."""
    rank, size = topology.rank, topology.size
    steps = _steps(rank, size)
    stream = PCAStream(PROBLEM, _samples(rank, steps))
    v0 = PROBLEM.initial(seed=12)
    params = v0.copy() if rank == 0 else np.zeros_like(v0)  # x_0 is the server's
    alg = mpiopt.create("async_msgd", topology, lr=LR, momentum=MOMENTUM)
    alg.setup(params)
    arrivals = []
    apply = alg._apply
    monkeypatch.setattr(alg, "_apply", lambda p, g, a: (arrivals.append(a), apply(p, g, a)))

    def worker_fn(x, step, out):
        time.sleep(0.0003 * rank)  # workers at different speeds
        return stream(x, step, out)

    result = alg.run(params, worker_fn, steps)
    arrivals = topology.world.bcast_obj(arrivals, root=0)
    everyone = topology.world.allgather_obj(params.tobytes())

    xs = [v0.astype(np.float64)]
    previous = xs[0]
    samples = {w: _samples(w, _steps(w, size)).astype(np.float64) for w in {a.worker for a in arrivals}}
    for k, a in enumerate(arrivals):
        assert a.staleness == k - a.version >= 0
        g = _grad64(xs[a.version], samples[a.worker][a.step])
        xs.append(xs[k] - LR * g + MOMENTUM * (xs[k] - previous))
        previous = xs[k]
    assert len(set(everyone)) == 1
    assert len(arrivals) == result.version == alg.steps == sum(_steps(w, size) for w in (range(1, size) if size > 1 else [0]))
    assert np.max(np.abs(params - xs[-1])) < 1e-4 * np.max(np.abs(xs[-1]))
    if size >= 4:  # the replay did exercise stale gradients
        assert result.max_staleness > 0, result.histogram()
    if size <= 2:  # one worker waits for each reply: staleness 0, plain momentum SGD
        assert result.histogram() == {0: len(arrivals)}
        ref = torch.nn.Parameter(torch.from_numpy(v0.copy()))
        opt = torch.optim.SGD([ref], lr=LR, momentum=MOMENTUM)
        g = np.empty_like(v0)
        ref_stream = PCAStream(PROBLEM, _samples(arrivals[0].worker, len(arrivals)))
        for k in range(len(arrivals)):
            ref_stream(ref.detach().numpy(), k, g)
            ref.grad = torch.from_numpy(g.copy())
            opt.step()
        assert np.max(np.abs(params - ref.detach().numpy())) < 1e-5


def test_streaming_pca_converges_with_stale_gradients(topology):
    rank, size = topology.rank, topology.size
    steps = 300 // max(1, size - 1)
    stream = PCAStream(PROBLEM, PROBLEM.samples(seed=13, steps=steps, batch_size=8, key=rank))
    params = PROBLEM.initial(seed=14)
    alg = mpiopt.create("async_msgd", topology, lr=0.02, momentum=0.5)
    alg.setup(params)

    def worker_fn(x, step, out):
        time.sleep(0.0005)  # let the workers interleave
        return stream(x, step, out)

    result = alg.run(params, worker_fn, steps)
    errors = topology.world.allgather_obj(sin2(params, PROBLEM.top))
    assert len(set(errors)) == 1 and errors[0] < 0.1, errors
    assert result.version == steps * max(1, size - 1) == result.staleness.sum()
    if size >= 4:
        assert result.staleness[1:].sum() > 0, result.histogram()


def test_state_round_trip_continues_bit_identically(topology):
    rng = np.random.default_rng(3)
    grads = rng.standard_normal((9, 33)).astype(np.float32)
    params = rng.standard_normal(33).astype(np.float32)
    alg = mpiopt.create("async_msgd", topology, lr=0.05, momentum=0.9)
    alg.setup(params)
    for g in grads[:5]:
        alg.apply(params, g)
    state, saved = alg.state_dict(), params.copy()
    for g in grads[5:]:
        alg.apply(params, g)
    fresh = mpiopt.create("async_msgd", topology, lr=0.5, momentum=0.9)
    fresh.setup(saved)
    fresh.load_state_dict(state)
    assert fresh.lr == 0.05 and fresh.rule.lr == 0.05 and fresh.steps == 5
    for g in grads[5:]:
        fresh.apply(saved, g)
    assert np.array_equal(saved, params) and np.array_equal(fresh.momentum_buffer, alg.momentum_buffer)
    fresh.lr = 0.01  # a scheduler's change reaches the rule
    assert fresh.rule.lr == 0.01


def test_registry_and_validation(topology):
    assert "async_msgd" in mpiopt.available() and isinstance(mpiopt.create("async_msgd", topology), AsyncMSGD)
    assert mpiopt.create("async_msgd", topology).hyperparameters() == {"momentum": 0.9}
    with pytest.raises(ValueError, match="nan_policy"):
        mpiopt.create("async_msgd", topology, nan_policy="skip")
    with pytest.raises(ValueError, match="momentum"):
        mpiopt.create("async_msgd", topology, momentum=1.0)
    with pytest.raises(ValueError, match="lr"):
        mpiopt.create("async_msgd", topology, lr=0.0)
    alg = mpiopt.create("async_msgd", topology)
    with pytest.raises(RuntimeError, match="setup"):
        alg.run(np.zeros(4, np.float32), lambda *a: None, 1)
    # Without the abort (the default aborts the job: tests/e2e/test_no_hang.py) the error is raised.
    quiet = mpiopt.Topology(abort_on_error=False)
    alg = mpiopt.create("async_msgd", quiet)
    alg.setup(np.zeros(4, np.float32))
    with pytest.raises(FloatingPointError, match="non-finite"):
        alg.apply(np.zeros(4, np.float32), np.array([0, np.nan, 0, 0], np.float32))
    quiet.Free()


@pytest.mark.mpi(min_size=2)
def test_ranks_with_different_momentum_all_raise(topology):
    alg = mpiopt.create("async_msgd", topology, momentum=0.9 if topology.rank else 0.5)
    with pytest.raises(SetupMismatchError, match="momentum"):
        alg.setup(np.zeros(4, np.float32))
