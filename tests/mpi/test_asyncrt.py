"""The asynchronous runtime: exactly-once delivery, stale-copy semantics, staleness, shutdown, stopping."""

import time

import numpy as np
import pytest
from mpiopt.asyncrt import Poller, run_async
from mpiopt.comm import SetupMismatchError

pytestmark = pytest.mark.mpi

D = 6


def _steps(rank, size):
    """Per-rank step counts: at 3+ ranks rank 1 finishes far earlier; at 4 ranks rank 3 has none at all."""
    if size == 1:
        return 30
    return {0: 999, 1: 30 if size == 2 else 2, 2: 30, 3: 0}[rank]  # the server's 999 is ignored


def _increment(rank, step):
    """Integer-valued float64: sums are exact whatever the order of application."""
    return np.random.default_rng([rank, step]).integers(-1000, 1000, D).astype(np.float64)


def _ledger_calls(topology):
    ops = topology.ledger
    return ops["world.Isend"].calls, ops["world.Irecv"].calls


def test_every_payload_applied_once_at_the_version_it_was_computed_at(topology):
    """The payload carries the parameters it was computed from and an increment; the server checks the first
    against its own history and adds the second: the final parameters are x_0 + every increment, exactly."""
    rank, size = topology.rank, topology.size
    params = np.zeros(2 * D)
    params[:D] = np.arange(D) if rank == 0 else -7.0  # the workers' values are overwritten by the server's
    history = [params[:D].copy()]  # on the server: x_k for every version k
    log = []

    def worker_fn(x, step, out):
        time.sleep(0.0005 * rank)
        out[:D] = x[:D]
        out[D:] = _increment(rank if size > 1 else 0, step)
        return float(step)

    def apply(x, payload, arrival):
        log.append((arrival, bool(np.array_equal(payload[:D], history[arrival.version])), len(history) - 1))
        x[:D] += payload[D:]
        history.append(x[:D].copy())

    steps = _steps(rank, size)
    calls_before = _ledger_calls(topology)
    result = run_async(topology.world, params, apply, worker_fn, steps)
    isend, irecv = np.subtract(_ledger_calls(topology), calls_before)
    shared = (result.version, result.histogram(), result.applied.tolist(), result.stopped_early)
    everyone = topology.world.allgather_obj((params.tobytes(), result.sent, shared, int(isend), int(irecv)))

    workers = range(1, size) if size > 1 else [0]
    expect = np.arange(D, dtype=np.float64) + sum(_increment(w, s) for w in workers for s in range(_steps(w, size)))
    assert len({e[0] for e in everyone}) == 1  # bitwise identical everywhere
    assert np.array_equal(params[:D], expect) and not params[D:].any()
    assert all(e[2] == shared for e in everyone)  # the same record everywhere
    for w in workers:
        assert everyone[w][1] == result.applied[w] == _steps(w, size)  # sent = applied, per worker
    assert result.version == sum(_steps(w, size) for w in workers) == result.staleness.sum()
    assert not result.stopped_early
    if rank == 0:
        assert len(log) == result.version
        assert all(same for _, same, _ in log)  # computed at x_{version}, bitwise
        assert all(a.staleness == k - a.version >= 0 for a, _, k in log)
        assert all(a.loss == a.step for a, _, _ in log)
        assert sorted((a.worker, a.step) for a, _, _ in log) == sorted((w, s) for w in workers for s in range(_steps(w, size)))
        assert result.histogram() == {t: sum(a.staleness == t for a, _, _ in log) for t in {a.staleness for a, _, _ in log}}
    if size > 1:
        # Every worker message got exactly one reply and every posted receive completed.
        sent_by_workers = sum(e[3] for e in everyone[1:])
        assert all(e[3] == e[4] for e in everyone[1:])
        assert everyone[0][4] == sent_by_workers == everyone[0][3]
        if size == 4:
            assert everyone[3][3] == 1  # the worker without steps sent a bare LAST


@pytest.mark.mpi(min_size=3)
def test_interleaved_workers_see_stale_parameters(topology):
    params = np.zeros(D)

    def worker_fn(x, step, out):
        time.sleep(0.002)  # the other workers' updates land meanwhile
        out[...] = 1.0

    def apply(x, payload, arrival):
        x += payload

    result = run_async(topology.world, params, apply, worker_fn, 15)
    histograms = topology.world.allgather_obj(result.histogram())
    workers = topology.size - 1
    assert all(h == histograms[0] for h in histograms)
    assert result.version == 15 * workers and np.all(params == 15 * workers)
    assert sum(n for tau, n in result.histogram().items() if tau > 0) > 0, result.histogram()
    assert result.max_staleness < 15 * workers and 0 < result.mean_staleness


def test_until_stops_every_worker_and_applies_what_was_in_flight(topology):
    size = topology.size
    params = np.zeros(D)

    def worker_fn(x, step, out):
        time.sleep(0.001)
        out[...] = 1.0

    def apply(x, payload, arrival):
        x += payload

    result = run_async(topology.world, params, apply, worker_fn, 10_000, until=lambda x, version: version >= 20)
    everyone = topology.world.allgather_obj((params.tobytes(), result.sent))
    assert len({e[0] for e in everyone}) == 1
    assert result.stopped_early
    # At most one payload per worker lands after the rule fired.
    assert 20 <= result.version <= 20 + max(size - 2, 0) and np.all(params == result.version)
    for w in range(1, size):
        assert everyone[w][1] == result.applied[w]


@pytest.mark.mpi(min_size=2)
def test_ranks_with_different_buffers_all_raise(topology):
    params = np.zeros(D + (topology.rank == 1), dtype=np.float32)
    with pytest.raises(SetupMismatchError, match="num_params"):
        run_async(topology.world, params, lambda *a: None, lambda *a: None, 3)


def test_bad_arguments():
    with pytest.raises(TypeError, match="numpy"):
        run_async(None, [0.0], None, None, 1)
    with pytest.raises(ValueError, match="steps"):
        run_async(None, np.zeros(3), None, None, -2)
    with pytest.raises(ValueError, match="at least one request"):
        Poller().wait_any([None, None])
    with pytest.raises(ValueError, match="max_sleep"):
        Poller(max_sleep=-1)
