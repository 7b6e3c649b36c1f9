"""Signum / signSGD with majority vote: the vote, both exchange modes, bytes, Byzantine tolerance."""

from __future__ import annotations

import numpy as np
import pytest

import mpiopt
from mpiopt.algorithms.signum import PIPELINE_CHUNKS, PIPELINE_MIN_BYTES, choose_exchange, exchange_bytes, pipeline_bounds
from mpiopt.kernels import packed_nbytes, unpack_signs

pytestmark = pytest.mark.mpi

MODES = ["allgather", "twophase"]


def grads(rank: int, steps: int, d: int, seed: int = 0) -> np.ndarray:
    g = np.random.default_rng([seed, rank]).standard_normal((steps, d)).astype(np.float32)
    g[:, :3] = 0.0  # exact zeros and negative zeros: sign +1 by convention
    g[:, 3:6] = -0.0
    return g


def reference_vote(directions: np.ndarray) -> np.ndarray:
    """sign(sum_i sign(m_i)) from the unpacked float vectors, sign(0) = +1, tie = +1 (int64 counts)."""
    votes = np.where(directions >= 0, 1, -1).astype(np.int64).sum(axis=0)
    return np.where(votes >= 0, 1.0, -1.0)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("d", [1, 13, 64, 1001])
def test_vote_equals_reference_bit_for_bit(topology, mode, d):
    lr, wd = 0.01, 0.1
    params = np.linspace(-1, 1, d).astype(np.float32)
    x0 = params.copy()
    alg = mpiopt.create("signum", topology, lr=lr, momentum=0.0, weight_decay=wd, exchange=mode)
    alg.setup(params)
    g = grads(topology.rank, 1, d)[0]
    alg.step(params, g)
    everyone = np.stack(topology.world.allgather_obj(g))
    expect = reference_vote(everyone)
    np.testing.assert_array_equal(unpack_signs(alg.vote, d), expect)
    np.testing.assert_allclose(params, x0 - lr * (expect + wd * x0.astype(np.float64)), rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("d", [7, 1000, 4097])
def test_modes_identical_with_momentum(topology, d):
    results = []
    for mode in MODES:
        params = np.ones(d, np.float32)
        alg = mpiopt.create("signum", topology, lr=1e-3, momentum=0.9, exchange=mode)
        alg.setup(params)
        for g in grads(topology.rank, 6, d, seed=3):
            alg.step(params, g)
        results.append(params)
    assert np.array_equal(results[0], results[1])


def test_signum_momentum_matches_a_recomputation(topology):
    d, beta, lr, wd = 300, 0.9, 1e-2, 1e-3
    params = np.zeros(d, np.float32)
    alg = mpiopt.create("signum", topology, lr=lr, momentum=beta, weight_decay=wd)
    alg.setup(params)
    steps = grads(topology.rank, 8, d, seed=7)
    momenta = np.zeros((topology.size, d), np.float32)
    all_steps = np.stack(topology.world.allgather_obj(steps))  # (P, steps, d)
    x = np.zeros(d, np.float64)
    for k, g in enumerate(steps):
        alg.step(params, g)
        momenta = beta * momenta + np.float32(1 - beta) * all_steps[:, k]  # float32, the formula as written
        vote = reference_vote(momenta)
        np.testing.assert_array_equal(unpack_signs(alg.vote, d), vote)
        x = x - lr * (vote + wd * x)
    np.testing.assert_allclose(params, x, rtol=1e-5, atol=1e-6)


def test_ledger_shows_the_payload(topology):
    P, d = topology.size, 8 * 1000 + 5
    for mode in MODES:
        params = np.zeros(d, np.float32)
        alg = mpiopt.create("signum", topology, lr=1e-3, exchange=mode)
        alg.setup(params)
        record = alg.step(params, grads(topology.rank, 1, d)[0])
        if P == 1:
            assert (record.bytes_sent, record.bytes_recv) == (0, 0)
        elif mode == "allgather":
            assert (record.bytes_sent, record.bytes_recv) == (packed_nbytes(d), (P - 1) * packed_nbytes(d))
        else:
            # Under 2 bits per parameter each way (chunks are padded to 8-byte words).
            assert record.bytes_sent * 8 <= 2 * d + 64 * P and record.bytes_recv * 8 <= 2 * d + 64 * P, record
            assert record.bytes_sent * 8 >= d  # every sign leaves the rank once


def test_auto_choice():
    assert choose_exchange(1, 10**7) == "allgather"
    assert choose_exchange(2, 10**7) == "allgather"  # same bytes received: one collective wins
    assert choose_exchange(4, 11_000_000) == "twophase"
    assert choose_exchange(4, 1000) == "allgather"  # tiny vectors: latency wins


def test_auto_resolves_the_same_on_every_rank(topology):
    alg = mpiopt.create("signum", topology, lr=1e-3)
    alg.setup(np.zeros(11_000, np.float32))
    assert alg.mode == choose_exchange(topology.size, 11_000)
    assert len(set(topology.world.allgather_obj(alg.mode))) == 1


def noisy_quadratic_run(topology, adversaries: int, steps: int = 300, d: int = 200) -> tuple:
    """f(x) = ||x - x*||^2 / 2 with noisy gradients; ranks < adversaries send flipped signs."""
    target = np.random.default_rng(11).standard_normal(d)
    params = np.zeros(d, np.float32)
    alg = mpiopt.create("signum", topology, lr=0.01, momentum=0.0, weight_decay=0.0)
    alg.setup(params)
    rng = np.random.default_rng([5, topology.rank])
    for _ in range(steps):
        g = (params - target + 0.25 * rng.standard_normal(d)).astype(np.float32)
        alg.step(params, -g if topology.rank < adversaries else g)
    return 0.5 * float(np.sum((params - target) ** 2)), 0.5 * float(np.sum(target**2))


@pytest.mark.mpi(min_size=3)
def test_byzantine_tolerance(topology):
    """Fewer than half adversarial: the loss falls far below its start; more than half: it does not.

    Instance: d = 200, f(x) = ||x - x*||^2 / 2, gradient noise N(0, 0.25^2) per
    coordinate, signSGD (no momentum) with lr 0.01 for 300 steps from x = 0;
    adversaries send the signs of -g.  At even P a tie votes +1, a bias that
    leaves a floor near the optimum; the noise level keeps it well below 5 %.
    """
    P = topology.size
    minority, majority = (P - 1) // 2, P // 2 + 1
    final_minority, start = noisy_quadratic_run(topology, minority)
    final_majority, _ = noisy_quadratic_run(topology, majority)
    assert final_minority < 0.05 * start, (final_minority, start)
    assert final_majority > start, (final_majority, start)


@pytest.mark.parametrize("mode", MODES)
def test_state_dict_resume_is_bitwise(topology, bitwise_resume, mode):
    settings = dict(lr=1e-3, momentum=0.9, weight_decay=1e-4, exchange=mode)
    bitwise_resume(topology, "signum", settings, np.ones(500, np.float32), grads(topology.rank, 10, 500, seed=9), 5)


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        (dict(exchange="ring"), ValueError, "exchange must be one of 'auto', 'allgather', 'twophase', 'prevote'; got 'ring'"),
        (dict(momentum=1.5), ValueError, r"momentum must be in \[0.0, 1.0\), got 1.5"),
        (dict(weight_decay=-1.0), ValueError, "weight_decay must be >= 0, got -1.0"),
    ],
)
def test_bad_hyperparameters(topology, kwargs, error, match):
    with pytest.raises(error, match=match):
        mpiopt.create("signum", topology, **kwargs)


@pytest.mark.parametrize("group_size", [1, 2, 3])
def test_prevote_is_the_majority_of_group_majorities(group_size):
    topo = mpiopt.Topology(group_size=group_size)
    d = 777
    params = np.zeros(d, np.float32)
    alg = mpiopt.create("signum", topo, lr=0.01, momentum=0.0, weight_decay=0.0, exchange="prevote")
    alg.setup(params)
    g = grads(topo.rank, 1, d, seed=4)[0]
    alg.step(params, g)
    everyone = np.stack(topo.world.allgather_obj(g))
    groups = [everyone[start : start + group_size] for start in range(0, topo.size, group_size)]
    expect = reference_vote(np.stack([reference_vote(members) for members in groups]))
    np.testing.assert_array_equal(unpack_signs(alg.vote, d), expect)
    np.testing.assert_allclose(params, -0.01 * expect, rtol=1e-6)
    # Only leaders cross between groups: d/8 sent, (groups - 1) d/8 received among leaders.
    leaders = topo.ledger["leaders.Allgather"]
    if topo.is_leader and topo.num_groups > 1:
        assert (leaders.bytes_sent, leaders.bytes_recv) == (packed_nbytes(d), (topo.num_groups - 1) * packed_nbytes(d))
    else:
        assert leaders.bytes_sent == 0
    topo.Free()


def test_prevote_with_one_group_is_the_plain_vote(topology):
    d = 300
    results = []
    for mode in ("prevote", "allgather"):
        params = np.zeros(d, np.float32)
        alg = mpiopt.create("signum", topology, lr=0.01, momentum=0.5, exchange=mode)
        alg.setup(params)
        for g in grads(topology.rank, 4, d, seed=8):
            alg.step(params, g)
        results.append(params)
    assert np.array_equal(results[0], results[1])


def run_signum(topology, d: int, steps: int, **settings) -> tuple:
    """(parameters, vote, momentum, ledger delta, algorithm) after ``steps`` Signum steps from the same data."""
    params = np.linspace(-1, 1, d).astype(np.float32)
    alg = mpiopt.create("signum", topology, lr=1e-2, weight_decay=0.1, **settings)
    alg.setup(params)
    before = topology.ledger.snapshot()
    for g in grads(topology.rank, steps, d, seed=12):
        alg.step(params, g)
    momentum = None if alg.momentum_buffer is None else alg.momentum_buffer.copy()
    return params, alg.vote.copy(), momentum, topology.ledger.since(before), alg


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("momentum", [0.0, 0.9])
@pytest.mark.parametrize("d", [1, 13, 515, 3 * 64 * 7 + 5, 8 * 1001 + 3])
def test_pipelined_exchange_is_bit_for_bit_the_unpipelined_one(topology, mode, momentum, d):
    """d not a multiple of 8, 64 or the chunk count; the chunk count capped at one word per chunk."""
    P = topology.size
    plain, vote, m, plain_ledger, _ = run_signum(topology, d, 4, exchange=mode, momentum=momentum, pipeline_chunks=1)
    assert not any(op.endswith(("Iallgather", "Ialltoall")) for op in plain_ledger)
    for chunks in (2, 3, 7):
        params, pvote, pm, ledger, alg = run_signum(topology, d, 4, exchange=mode, momentum=momentum, pipeline_chunks=chunks)
        assert alg.chunks == min(chunks, -(-d // 64)) == len(pipeline_bounds(d, chunks, P))
        assert params.tobytes() == plain.tobytes() and pvote.tobytes() == vote.tobytes(), (chunks, d)
        assert m is None or pm.tobytes() == m.tobytes()
        if alg.chunks > 1:  # one nonblocking collective per chunk (and phase) per step, nothing blocking
            assert ledger["world.Iallgather"].calls == 4 * alg.chunks and "world.Allgather" not in ledger.ops
            assert ledger["world.Ialltoall"].calls == (4 * alg.chunks if mode == "twophase" else 0)
        expect = exchange_bytes(mode, P, d, chunks)
        assert (ledger.bytes_sent, ledger.bytes_recv) == (4 * expect["sent"], 4 * expect["recv"])
        if mode == "allgather":  # the same payload, only cut differently
            assert (ledger.bytes_sent, ledger.bytes_recv) == (plain_ledger.bytes_sent, plain_ledger.bytes_recv)


def test_pipeline_bounds():
    for d in (1, 13, 64 * 5 + 1, 10**6 + 3):
        nbytes = packed_nbytes(d)
        for chunks in (1, 2, 5, 64):
            bounds = pipeline_bounds(d, chunks, 1)
            assert bounds[0, 0] == 0 and bounds[-1, 1] == nbytes and np.array_equal(bounds[1:, 0], bounds[:-1, 1])
            assert np.all(bounds[:, 1] > bounds[:, 0]) and np.all(bounds[:, 0] % 8 == 0)
            assert len(bounds) == min(chunks, -(-nbytes // 8))
    assert len(pipeline_bounds(10**5, "auto", 2)) == 1  # small vectors: no extra latency
    big = 8 * PIPELINE_CHUNKS * PIPELINE_MIN_BYTES
    assert len(pipeline_bounds(big, "auto", 2)) == PIPELINE_CHUNKS and len(pipeline_bounds(big - 8, "auto", 2)) == 1
    assert len(pipeline_bounds(big, "auto", 1)) == 1 and len(pipeline_bounds(big, 4, 1)) == 4  # one rank: nothing to hide


@pytest.mark.parametrize("value, error", [(0, ValueError), (2.5, TypeError), ("many", TypeError), (True, TypeError)])
def test_bad_pipeline_chunks(topology, value, error):
    with pytest.raises(error, match=f"pipeline_chunks must be .*got {value!r}"):
        mpiopt.create("signum", topology, pipeline_chunks=value)
