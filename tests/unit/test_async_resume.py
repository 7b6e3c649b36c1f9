"""Resuming the asynchronous algorithms in their deterministic modes: k steps, state, k more is 2k steps, bitwise.

The deterministic modes are :func:`mpiopt.asyncrt.simulated.simulate` (Async-MSGD's
twin, with a delay) and the runtime at world size 1 (its own server, a LocalLink),
for both algorithms.  The reference is always the uninterrupted run of 2k steps;
a state goes through an actual checkpoint file where a test says so.
"""

import numpy as np
import pytest

import mpiopt
from mpiopt.algorithms.async_msgd import AsyncMSGDRule
from mpiopt.checkpoint import load_checkpoint, save_checkpoint
from mpiopt.asyncrt.simulated import FixedDelay, RandomDelay, RecentIterates, simulate

D, K = 12, 15
MSGD = dict(lr=0.03, momentum=0.7)
LSGD = dict(lr=0.05, period=2, global_period=4, proximal=0.3, loss_window=3, pull_local=0.2, pull_global=0.1)


def _problem(seed=0):
    """A noisy quadratic whose gradient and loss depend on the step index (so a restarted index shows)."""
    rng = np.random.default_rng(seed)
    a = rng.standard_normal((D, D))
    hessian = (a @ a.T / D + np.eye(D)).astype(np.float32)
    noise = rng.standard_normal((4 * K, D)).astype(np.float32)

    def worker_fn(x, k, out):
        np.matmul(hessian, x, out=out)
        out += np.float32(0.1) * noise[k]
        return float(x @ hessian @ x) + 0.01 * k

    return worker_fn, rng.standard_normal(D).astype(np.float32)


def _through_file(state, topology, tmp_path):
    """``state`` written to an HDF5 checkpoint and read back (only storable values survive this)."""
    path = str(tmp_path / "ckpt.h5")
    save_checkpoint(path, topology.world, model=None, rank_state={"algorithm": state}, attrs={"step": 0})
    return load_checkpoint(path, topology.world).rank_state["algorithm"]


@pytest.mark.parametrize("delay", [0, FixedDelay(3), RandomDelay(5, seed=7)], ids=repr)
def test_simulate_continued_from_its_version_and_recent_iterates_is_one_long_run(delay):
    worker_fn, x0 = _problem()
    whole = x0.copy()
    rule = AsyncMSGDRule(**MSGD)
    rule.allocate(whole)
    seen = []
    one = simulate(whole, lambda p, g, a: (seen.append(a), rule(p, g)), worker_fn, 2 * K, delay=delay)

    split = x0.copy()
    rule2 = AsyncMSGDRule(**MSGD)
    rule2.allocate(split)
    recent, resumed = RecentIterates(), []
    first = simulate(split, lambda p, g, a: (resumed.append(a), rule2(p, g)), worker_fn, K, delay=delay, recent=recent)
    max_delay = FixedDelay(delay).delay if isinstance(delay, int) else delay.max_delay
    assert (first.version, first.start_version) == (K, 0)
    assert recent.array is None if max_delay == 0 else recent.array.shape == (max_delay, D)
    second = simulate(split, lambda p, g, a: (resumed.append(a), rule2(p, g)), worker_fn, K, delay=delay, version=K, recent=recent)
    assert (second.version, second.start_version, second.sent) == (2 * K, K, K)
    assert resumed == seen  # the same steps, versions and staleness, in order
    np.testing.assert_array_equal(split, whole)
    np.testing.assert_array_equal(rule2.local.buffer, rule.local.buffer)
    counts = np.zeros(max(first.staleness.size, second.staleness.size), dtype=np.int64)
    counts[: first.staleness.size] += first.staleness
    counts[: second.staleness.size] += second.staleness
    np.testing.assert_array_equal(counts, one.staleness)


def test_simulate_refuses_to_read_iterates_it_did_not_keep():
    worker_fn, x0 = _problem()
    rule = AsyncMSGDRule(**MSGD)
    rule.allocate(x0)
    with pytest.raises(ValueError, match="reads x_7, 3 iterates back, but only 0 are kept"):
        simulate(x0.copy(), rule, worker_fn, 2, delay=3, version=10)
    recent = RecentIterates()
    simulate(x0, rule, worker_fn, K, delay=2, recent=recent)
    with pytest.raises(ValueError, match="4 iterates back, but only 2 are kept"):
        simulate(x0, rule, worker_fn, 2, delay=4, version=K, recent=recent)
    simulate(x0, rule, worker_fn, 2, delay=1, version=K, recent=recent)  # a smaller delay reads what is kept
    assert recent.array.shape == (1, D)


@pytest.mark.parametrize("delay", [0, RandomDelay(4, seed=3)], ids=repr)
def test_async_msgd_simulate_resumed_from_a_checkpoint_file_is_bitwise_one_long_run(topology, tmp_path, delay):
    worker_fn, x0 = _problem(1)
    whole = x0.copy()
    alg = mpiopt.create("async_msgd", topology, **MSGD)
    alg.setup(whole)
    alg.simulate(whole, worker_fn, 2 * K, delay=delay)

    first = mpiopt.create("async_msgd", topology, **MSGD)
    params = x0.copy()
    first.setup(params)
    first.simulate(params, worker_fn, K, delay=delay)
    state = _through_file(first.state_dict(), topology, tmp_path)
    fresh = mpiopt.create("async_msgd", topology, lr=1.0, momentum=0.7)  # lr is state: the saved one returns
    fresh.setup(params)
    fresh.load_state_dict(state)
    result = fresh.simulate(params, worker_fn, K, delay=delay)
    assert (result.start_version, result.version) == (K, 2 * K)
    np.testing.assert_array_equal(params, whole)
    np.testing.assert_array_equal(fresh.momentum_buffer, alg.momentum_buffer)
    assert fresh.version == alg.version == 2 * K and fresh.steps == alg.steps == 2 * K
    np.testing.assert_array_equal(fresh.staleness, alg.staleness)
    np.testing.assert_array_equal(fresh.applied, alg.applied)
    assert (fresh.recent.array is None) == (alg.recent.array is None)
    if alg.recent.array is not None:
        np.testing.assert_array_equal(fresh.recent.array, alg.recent.array)


def test_async_msgd_run_at_one_rank_continues_in_memory_and_from_a_state(topology, tmp_path):
    """The runtime at world size 1 (its own server): run(k) twice on one instance, and run(k) on an instance
    restored from the first's file, both equal run(2k) bitwise, with the step numbers running on."""
    worker_fn, x0 = _problem(2)
    runs = {}
    for how in ("whole", "twice", "resumed"):
        alg = mpiopt.create("async_msgd", topology, **MSGD)
        params = x0.copy()
        alg.setup(params)
        steps = []
        fn = lambda x, k, out: (steps.append(k), worker_fn(x, k, out))[1]  # noqa: E731
        if how == "whole":
            results = [alg.run(params, fn, 2 * K)]
        else:
            results = [alg.run(params, fn, K)]
            if how == "resumed":
                state = _through_file(alg.state_dict(), topology, tmp_path)
                alg = mpiopt.create("async_msgd", topology, **MSGD)
                alg.setup(params)
                alg.load_state_dict(state)
            results.append(alg.run(params, fn, K))
            assert (results[-1].start_version, results[-1].version) == (K, 2 * K)
            assert results[-1].histogram() == {0: K} and list(results[-1].applied) == [K]
        assert steps == list(range(2 * K))
        runs[how] = (params, alg)
    params, alg = runs["whole"]
    for how in ("twice", "resumed"):
        other_params, other = runs[how]
        np.testing.assert_array_equal(other_params, params)
        np.testing.assert_array_equal(other.momentum_buffer, alg.momentum_buffer)
        assert other.version == 2 * K and list(other.staleness) == [2 * K] and list(other.applied) == [2 * K]


def _lsgd_run(topology, x0, worker_fn, segments, tmp_path=None):
    """async_lsgd at one rank over ``segments`` (step counts), a fresh instance from a file between them if
    ``tmp_path``; the parameters, the last instance and the steps worker_fn saw."""
    alg = mpiopt.create("async_lsgd", topology, **LSGD)
    params = x0.copy()
    alg.setup(params)
    seen = []
    for i, steps in enumerate(segments):
        if i and tmp_path is not None:
            state = _through_file(alg.state_dict(), topology, tmp_path)
            alg = mpiopt.create("async_lsgd", topology, **LSGD)
            alg.setup(params)
            alg.load_state_dict(state)
        result = alg.run(params, lambda x, k, out: (seen.append(k), worker_fn(x, k, out))[1], steps)
    return params, alg, seen, result


def test_async_lsgd_at_one_rank_continued_or_resumed_is_bitwise_one_long_run(topology, tmp_path):
    worker_fn, x0 = _problem(3)
    params, alg, seen, result = _lsgd_run(topology, x0, worker_fn, [2 * K])
    assert seen == list(range(2 * K))
    for tmp in (None, tmp_path):
        other_params, other, other_seen, other_result = _lsgd_run(topology, x0, worker_fn, [K, K], tmp)
        assert other_seen == seen
        np.testing.assert_array_equal(other_params, params)
        a, b = other.state_dict(), alg.state_dict()
        for key in ("momentum_buffer", "leader_copy", "recent_losses"):
            np.testing.assert_array_equal(a["arrays"][key], b["arrays"][key])
        assert a["scalars"] == b["scalars"] and a["steps"] == b["steps"] == 2 * K
        for key, value in b["server"].items():
            if key == "uploads":  # one LAST per run
                assert list(a["server"][key]) == [2] and list(value) == [1]
            elif key != "copies":
                np.testing.assert_array_equal(a["server"][key], value, err_msg=key)
        assert other_result.total_steps == 2 * K and other_result.local_rounds == K and other_result.global_rounds == K // 2
        assert (other_result.crossings == other_result.as_leader).all()  # the one worker leads every scope


def test_loading_a_state_that_does_not_fit_changes_nothing(topology):
    worker_fn, x0 = _problem(4)
    alg = mpiopt.create("async_msgd", topology, **MSGD)
    params = x0.copy()
    alg.setup(params)
    alg.simulate(params, worker_fn, K, delay=2)
    good = alg.state_dict()
    fresh = mpiopt.create("async_msgd", topology, **MSGD)
    fresh.setup(params)
    bad_states = [
        ({k: v for k, v in good.items() if k != "server"}, "lacks \\['server'\\]"),
        ({**good, "server": {**good["server"], "version": -1}}, "'version' must be an integer >= 0"),
        ({**good, "server": {**good["server"], "applied": np.zeros(3, np.int64)}}, "'applied' must be an array of shape \\(1,\\)"),
        ({**good, "server": {**good["server"], "recent_iterates": np.zeros((2, D + 1), np.float32)}}, "'recent_iterates'"),
        ({**good, "server": {**good["server"], "version": 1}}, "2 iterates kept before version 1"),
    ]
    for state, message in bad_states:
        with pytest.raises(ValueError, match=message):
            fresh.load_state_dict(state)
        assert fresh.version == 0 and fresh.steps == 0 and fresh.recent.array is None and fresh.momentum_buffer is None
    lsgd = mpiopt.create("async_lsgd", topology, **LSGD)
    lsgd.setup(params)
    lsgd.run(params, worker_fn, 3)
    state = lsgd.state_dict()
    other = mpiopt.create("async_lsgd", topology, **LSGD)
    other.setup(params)
    with pytest.raises(ValueError, match="'leaders'"):
        other.load_state_dict({**state, "server": {**state["server"], "leaders": np.array([5, 5])}})
    assert other.steps == 0 and other._book.total == 0
