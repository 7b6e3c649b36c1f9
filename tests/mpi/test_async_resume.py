"""Resuming the asynchronous algorithms on the real runtime: k steps, a checkpoint file, a fresh instance, k more.

Timing decides the order of arrivals, so the resumed run is not bitwise the
uninterrupted one; what it must do is start from exactly the saved state (the
parameters the server and the workers hold, the momentum, the book) and run the
counters on (version, steps, rounds).  The same holds for a second run on the
same instance, which needs no file.
"""

import time

import numpy as np
import pytest

import mpiopt
from mpiopt.checkpoint import load_checkpoint, save_checkpoint
from mpiopt.checkpoint.layout import first_difference

pytestmark = pytest.mark.mpi

D, K = 10, 12
LR, MOMENTUM = 0.03, 0.6


def _workers(size):
    return list(range(1, size)) if size > 1 else [0]


def _worker_fn(rank, seen):
    """A noisy quadratic, the noise keyed on (rank, step); records (step, params) of each call in ``seen``."""
    rng = np.random.default_rng(5)
    a = rng.standard_normal((D, D))
    hessian = (a @ a.T / D + np.eye(D)).astype(np.float32)
    noise = np.random.default_rng([6, rank]).standard_normal((4 * K, D)).astype(np.float32)

    def worker_fn(x, k, out):
        seen.append((k, x.copy()))
        time.sleep(0.0002 * rank)  # workers at different speeds
        np.matmul(hessian, x, out=out)
        out += np.float32(0.1) * noise[k]
        return float(x @ hessian @ x)

    return worker_fn


def _through_file(topology, tmp_path_factory, state, params):
    """Every rank's state and parameters written to one HDF5 checkpoint and read back."""
    world = topology.world
    folder = world.bcast_obj(str(tmp_path_factory.mktemp("async-resume")) if world.rank == 0 else None, root=0)
    path = f"{folder}/ckpt.h5"
    save_checkpoint(path, world, model=None, rank_state={"algorithm": state, "params": params}, attrs={"step": K})
    loaded = load_checkpoint(path, world).rank_state
    assert first_difference(loaded["algorithm"], state) is None  # stored exactly: nothing but storable values
    return loaded["algorithm"], loaded["params"]


def test_async_msgd_resumes_from_the_saved_parameters_momentum_and_version(topology, tmp_path_factory):
    rank, size = topology.rank, topology.size
    n = len(_workers(size))
    params = np.random.default_rng(7).standard_normal(D).astype(np.float32)
    seen = []
    alg = mpiopt.create("async_msgd", topology, lr=LR, momentum=MOMENTUM)
    alg.setup(params)
    first = alg.run(params, _worker_fn(rank, seen), K)
    assert (first.start_version, first.version) == (0, K * n)
    state, saved = _through_file(topology, tmp_path_factory, alg.state_dict(), params)

    fresh = mpiopt.create("async_msgd", topology, lr=1.0, momentum=MOMENTUM)  # the saved lr comes back
    resumed = np.zeros_like(params)
    fresh.setup(resumed)
    fresh.load_state_dict(state)
    resumed[...] = saved
    assert first_difference(fresh.state_dict(), state) is None
    applied = []
    apply = fresh._apply

    def recording_apply(p, g, arrival):
        before, buffer = p.copy(), None if fresh.momentum_buffer is None else fresh.momentum_buffer.copy()
        apply(p, g, arrival)
        applied.append((before, buffer, g.copy(), p.copy(), arrival))

    fresh._apply = recording_apply
    seen.clear()
    result = fresh.run(resumed, _worker_fn(rank, seen), K)

    assert (result.start_version, result.version) == (K * n, 2 * K * n) and fresh.version == 2 * K * n
    assert fresh.staleness.sum() == 2 * K * n and list(fresh.applied[_workers(size)]) == [2 * K] * n
    if rank in _workers(size):
        assert [k for k, _ in seen] == list(range(K, 2 * K))  # the step numbers run on
        np.testing.assert_array_equal(seen[0][1], saved)  # the first gradient is taken at the saved parameters
    if rank == 0:
        before, buffer, grad, after, arrival = applied[0]
        np.testing.assert_array_equal(before, saved)  # the server starts from the saved parameters
        np.testing.assert_array_equal(buffer, state["arrays"]["momentum_buffer"])
        # The first update uses the saved momentum, in float64: x - lr (mu b + g).
        expect = before.astype(np.float64) - LR * (MOMENTUM * buffer.astype(np.float64) + grad)
        assert np.max(np.abs(after - expect)) < 1e-6 * np.max(np.abs(expect))
        assert (arrival.version, arrival.staleness) == (K * n, 0)  # computed at the saved parameters' version
        assert all(a.version >= K * n for *_, a in applied)
    assert len(set(topology.world.allgather_obj(resumed.tobytes()))) == 1

    # A second run on the first instance, without a file, continues the same way.
    second = alg.run(params, _worker_fn(rank, []), K)
    assert (second.start_version, second.version) == (K * n, 2 * K * n)
    assert alg.version == 2 * K * n and list(alg.applied[_workers(size)]) == [2 * K] * n


@pytest.mark.parametrize("group_size", [None, 2])
def test_async_lsgd_resumes_the_book_and_every_worker(tmp_path_factory, group_size):
    topology = mpiopt.Topology(group_size=group_size) if group_size else mpiopt.Topology()
    try:
        rank, size = topology.rank, topology.size
        n = len(_workers(size))
        settings = dict(lr=0.05, period=2, global_period=4, pull_local=0.3, pull_global=0.2, proximal=0.1, loss_window=3)
        params = np.random.default_rng([8, rank]).standard_normal(D).astype(np.float32)
        alg = mpiopt.create("async_lsgd", topology, **settings)
        alg.setup(params)
        first = alg.run(params, _worker_fn(rank, []), K)
        assert first.total_steps == K * n
        state, saved = _through_file(topology, tmp_path_factory, alg.state_dict(), params)

        fresh = mpiopt.create("async_lsgd", topology, **settings)
        resumed = np.zeros_like(params)
        fresh.setup(resumed)
        fresh.load_state_dict(state)
        resumed[...] = saved
        assert first_difference(fresh.state_dict(), state) is None  # the book and the worker's state, exactly
        if rank == 0:
            book = state["server"]
            assert book["total_steps"] == K * n and sorted(book["copies"]) == sorted(
                {str(s) for s in book["sources"].tolist() if s >= 0}
            )
            if size > 2:  # the global leader's copy serves the next run's first pulls; the server holds it
                np.testing.assert_array_equal(book["copies"][str(first.global_leader)], saved)
        seen = []
        result = fresh.run(resumed, _worker_fn(rank, seen), K)

        if rank in _workers(size):
            assert [k for k, _ in seen] == list(range(K, 2 * K))
            np.testing.assert_array_equal(seen[0][1], saved)  # the first step starts from the saved parameters
            assert fresh.steps == 2 * K and fresh.losses_seen == 2 * K
        assert result.total_steps == 2 * K * n and list(result.steps[_workers(size)]) == [2 * K] * n
        assert (result.local_rounds, result.global_rounds) == (K, K // 2)  # rounds every 2 n and 4 n steps of all n
        assert (result.crossings == result.pulls + result.as_leader + result.merged).all()
        assert (result.crossings >= first.crossings).all() and (result.uploads[_workers(size)] >= 2).all()  # a LAST per run

        second = alg.run(params, _worker_fn(rank, []), K)  # in memory: the same continuation
        assert second.total_steps == 2 * K * n and (second.local_rounds, second.global_rounds) == (K, K // 2)
    finally:
        topology.Free()
