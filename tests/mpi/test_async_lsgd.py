"""Asynchronous LSGD: a slow worker holds nobody back, leaders by running mean, pulls on the total step count,
shutdown, torch.optim.SGD without pulls, resume, the server's book event by event, validation."""

from __future__ import annotations

import json
import time

import numpy as np
import pytest
import torch
from mpi4py import MPI

import mpiopt
from mpiopt.algorithms.async_lsgd import AsyncLSGD
from mpiopt.algorithms.async_lsgd_server import LeaderBook
from mpiopt.tasks import logistic

pytestmark = pytest.mark.mpi

D = 6
NO_MOMENTUM = dict(momentum=0.0, nesterov=False, weight_decay=0.0)


def gather(obj):
    return MPI.COMM_WORLD.allgather(obj)


def make_topology(group_size):
    return mpiopt.Topology(group_size=group_size) if group_size else mpiopt.Topology()


def workers(size):
    return list(range(1, size)) if size > 1 else [0]


def shared(result):
    """The record without this rank's own times, as text (NaN-safe comparison)."""
    record = result.as_dict()
    del record["seconds"], record["idle_seconds"]
    return json.dumps(record, sort_keys=True)


@pytest.mark.mpi(min_size=3)
def test_slow_worker_holds_nobody_back_and_every_worker_converges(topology):
    """The last rank sleeps 20 ms per step; the others do not wait for it, and all end near the optimum."""
    rank, size = topology.rank, topology.size
    slow = size - 1
    task = dict(seed=0, num_samples=256, num_features=8, shift=0.0)
    data = logistic.make_data(rank, **task)
    everyone = logistic.make_global_data(workers(size), **task)
    l2 = 1e-2
    best = logistic.optimum(everyone, l2)
    params = (2.0 * np.random.default_rng([5, rank]).standard_normal(8)).astype(np.float32)
    start = params.copy()
    rng = np.random.default_rng([6, rank])
    alg = mpiopt.create("async_lsgd", topology, lr=0.05, period=2, global_period=4, weight_decay=0.0)
    alg.setup(params)

    def worker_fn(x, step, out):
        if rank == slow:
            time.sleep(0.02)
        batch = data.sample(rng, 32)
        logistic.gradient(x, batch, l2, out=out)
        return float(logistic.loss(x, batch, l2))

    result = alg.run(params, worker_fn, seconds=1.5)
    f_best = float(logistic.loss(best.astype(np.float32), everyone, l2))
    rows = gather((alg.steps, float(logistic.loss(start, everyone, l2)), float(logistic.loss(params, everyone, l2)),
                   float(np.linalg.norm(start - best)), float(np.linalg.norm(params - best)), params.tobytes(), shared(result)))

    steps = [rows[w][0] for w in workers(size)]
    assert len({r[6] for r in rows}) == 1  # one record everywhere
    assert list(result.steps[1:]) == steps and result.total_steps == sum(steps)
    assert all(rows[w][0] >= 1.5 * rows[slow][0] for w in workers(size) if w != slow), steps
    for w in workers(size):
        _, f_start, f_end, d_start, d_end, _, _ = rows[w]
        assert f_end - f_best < 0.1 * (f_start - f_best), (w, f_start, f_end, f_best)
        assert d_end < 0.3 * d_start, (w, d_start, d_end)
    assert result.pulls[slow].sum() > 0  # the slow worker is pulled towards the faster leaders
    assert rows[0][5] == rows[result.global_leader][5]  # the server ends with the global leader's parameters


LOSS_CASES = {
    # Window 3 over 4 steps: the target's first loss drops out; its last loss alone would lose, its full mean too.
    "window": lambda w, target: [100.0, 0.0, 0.0, 5.0] if w == target else [0.0, 3.0, 3.0, 1.0 + 0.1 * w],
    "tie": lambda w, target: [1.0, 1.0, 1.0],
    "nan": lambda w, target: [0.0, float("nan"), 0.0] if w == min(target, 1) else [1.0, 2.0, 1.0 + 0.1 * w],
}


@pytest.mark.parametrize("case", sorted(LOSS_CASES))
@pytest.mark.parametrize("group_size", [None, 2])
def test_leaders_have_the_lowest_running_mean_loss(monkeypatch, case, group_size):
    """Every message tells the server the running mean of the losses of the steps it counts; the final leaders
    are the lowest means (ties: lowest rank; NaN never), per group and over the world."""
    heard = []  # on the rank that keeps the book: (worker, steps, loss) of every message
    note = LeaderBook.note
    monkeypatch.setattr(LeaderBook, "note", lambda book, w, steps, loss: (heard.append((w, steps, loss)), note(book, w, steps, loss)))
    topo = make_topology(group_size)
    rank, size = topo.rank, topo.size
    losses = LOSS_CASES[case]
    target = workers(size)[-1]
    params = np.full(D, float(rank))
    alg = mpiopt.create("async_lsgd", topo, loss_window=3, period=1, global_period=1, **NO_MOMENTUM)
    alg.setup(params)
    mine = losses(rank, target)

    def worker_fn(x, step, out):
        # time for the reply, so that a report follows (nearly) every step: a round trip took up to 6 ms under
        # MPICH and 10-20 ms under Open MPI, 2 ranks on 2 cores busy with other work
        time.sleep(0.03)
        out[...] = 0.0
        return mine[step]

    result = alg.run(params, worker_fn, len(mine))
    groups = gather(topo.group_index)
    rows = gather((params.tobytes(), shared(result)))
    topo.Free()

    means = {w: np.mean(losses(w, target)[-3:]) for w in workers(size)}
    if rank == 0:
        assert {w for w, _, _ in heard} == set(workers(size))
        assert len(heard) > 2 * len(workers(size))  # reports during the run, not only the LAST messages
        for w, steps, loss in heard:
            window = losses(w, target)[:steps][-3:]
            assert loss == pytest.approx(np.mean(window) if steps else np.nan, rel=1e-12, nan_ok=True), (w, steps, loss)

    def lowest(ranks):
        ranks = [w for w in ranks if not np.isnan(means[w])]
        return min(ranks, key=lambda w: (means[w], w)) if ranks else -1

    assert len({r[1] for r in rows}) == 1
    assert result.global_leader == lowest(workers(size))
    assert result.local_leaders == {g: lowest([w for w in workers(size) if groups[w] == g]) for g in {groups[w] for w in workers(size)}}
    for w in workers(size):
        assert result.losses[w] == pytest.approx(means[w], rel=1e-12, nan_ok=True)
    if case == "window":
        assert result.global_leader == target
    if case == "nan" and size > 2:
        assert result.global_leader != 1
    if size > 1 and result.global_leader >= 0:  # the server holds the global leader's final parameters
        assert rows[0][0] == rows[result.global_leader][0]


PULL_SETTINGS = [(None, "paper"), (2, "convex")]


@pytest.mark.parametrize("group_size,pull_form", PULL_SETTINGS)
@pytest.mark.parametrize("kind", ["local", "global"])
def test_pulls_follow_the_total_step_count(kind, group_size, pull_form):
    """Zero gradients and loss = rank: only pulls move a worker, each by half its distance to its (still) leader.

    A round opens at every multiple of N tau (N tau_G) total steps; each worker pulls at most once per round;
    the counts match the parameters: x = leader + (x_0 - leader) / 2^pulls, exactly in float64."""
    topo = make_topology(group_size)
    rank, size = topo.rank, topo.size
    period, global_period, steps = 2, 3, 30
    on = dict(pull_local=0.5, pull_global=0.0) if kind == "local" else dict(pull_local=0.0, pull_global=0.5)
    params = np.full(D, float(rank))
    alg = mpiopt.create("async_lsgd", topo, period=period, global_period=global_period, pull_form=pull_form, **on, **NO_MOMENTUM)
    alg.setup(params)

    def worker_fn(x, step, out):
        time.sleep(0.002)
        out[...] = 0.0
        return float(rank)

    result = alg.run(params, worker_fn, steps)
    groups = gather(topo.group_index)
    wire = (topo.ledger["world.Isend"].calls, topo.ledger["world.Isend"].bytes_sent, topo.ledger["world.Recv"].bytes_recv)
    rows = gather((alg.steps, alg.pulls_local, alg.pulls_global, params.tobytes(), shared(result)))
    topo.Free()

    N, col = len(workers(size)), 0 if kind == "local" else 1
    if size > 1 and rank > 0:
        # Reports 32 bytes up, replies 32 down plus a float64 copy per pull (one kind only: one copy per reply),
        # uploads 32 + 8 D up, the final STOP 32 down.
        sends, sent, received = wire
        reports = sends - result.uploads[rank]
        assert sent == 32 * reports + (32 + 8 * D) * result.uploads[rank]
        assert received == 32 * (reports + 1) + 8 * D * result.pulls[rank, col]
    total = sum(rows[w][0] for w in workers(size))
    rounds = (result.local_rounds, result.global_rounds)
    assert len({r[4] for r in rows}) == 1
    assert result.total_steps == total == N * steps
    assert rounds == (total // (N * period), total // (N * global_period))
    for w in workers(size):
        scope = [v for v in workers(size) if kind == "global" or groups[v] == groups[w]]
        leader, pulls = min(scope), result.pulls[w]
        assert (pulls[0], pulls[1]) == (rows[w][1], rows[w][2])  # the server's count is the worker's
        assert pulls[1 - col] == 0 and result.crossings[w, 1 - col] == 0  # the other pull is off
        crossings = result.crossings[w, col]
        assert crossings == pulls[col] + result.as_leader[w, col] + result.merged[w, col]
        assert rounds[col] // 2 <= crossings <= rounds[col]  # every round while it ran (all run about as long)
        x = np.frombuffer(rows[w][3])
        np.testing.assert_array_equal(x, leader + (w - leader) * 0.5 ** pulls[col])
        if w == leader:
            assert pulls[col] == 0 and result.as_leader[w, col] > 0
        else:
            assert pulls[col] >= 1


@pytest.mark.mpi(min_size=4)
@pytest.mark.parametrize("pull_form", ["paper", "convex"])
def test_local_and_global_pull_from_different_leaders_in_one_reply(monkeypatch, pull_form):
    """Groups {1} and {2, 3}: rank 3 is pulled towards rank 2 (local) and rank 1 (global); a reply can carry both
    copies.  Every step is checked against a float64 transcription of the pull form, with the proximal pull
    towards the latest copy received (the global one when both came)."""
    topo = mpiopt.Topology(group_size=2)
    rank = topo.rank
    params = np.full(D, float(rank))
    proximal = 0.1
    alg = mpiopt.create("async_lsgd", topo, pull_local=0.5, pull_global=0.25, period=2, global_period=2,
                        pull_form=pull_form, proximal=proximal, **NO_MOMENTUM)
    alg.setup(params)
    events = []
    pull_and_step = alg._pull_and_step

    def logged(x, grad, pulls):
        before = x.copy()
        copies = [(coeff, fetch().copy()) for coeff, fetch in pulls]
        pull_and_step(x, grad, pulls)
        events.append((before, copies, grad is not None, x.copy()))

    monkeypatch.setattr(alg, "_pull_and_step", logged)

    def worker_fn(x, step, out):
        time.sleep(0.006 if rank == 3 else 0.001)  # the leaders refresh between rank 3's reports
        out[...] = 0.0
        return float(rank)

    result = alg.run(params, worker_fn, 30 if rank == 3 else 150)
    pairs = gather(sum(len(c) == 2 for _, c, _, _ in events))
    topo.Free()
    anchor = None
    for before, copies, stepped, after in events:
        anchor = copies[-1][1] if copies else anchor
        want = before.copy()
        if pull_form == "paper":
            pull = sum(c * (before - leader) for c, leader in copies)
            if stepped and anchor is not None:
                want -= proximal * (want - anchor)
            want -= pull
        else:
            if stepped and anchor is not None:
                want = (1 - proximal) * want + proximal * anchor
            for c, leader in copies:
                want = (1 - c) * want + c * leader
        np.testing.assert_allclose(after, want, rtol=0, atol=1e-14)
    if rank == 3:
        assert [c for _, copies, _, _ in events for c, _ in copies].count(0.5) == result.pulls[3, 0] > 0
        assert result.pulls[3, 1] > 0
    assert pairs[3] > 0 and sum(pairs) == pairs[3]  # only rank 3 has two different leaders


def test_shutdown_with_early_and_idle_workers_gives_every_rank_one_record(topology):
    """At 3+ ranks rank 1 stops after 2 steps; at 4 ranks rank 3 takes none.  Nobody hangs, all agree."""
    rank, size = topology.rank, topology.size
    steps = 40 if size <= 2 else {0: 999, 1: 2, 2: 40, 3: 0}[rank]  # the server's number is ignored
    params = np.full(D, float(rank), np.float32)
    alg = mpiopt.create("async_lsgd", topology, lr=0.1, period=1, global_period=2, **NO_MOMENTUM)
    alg.setup(params)

    def worker_fn(x, step, out):
        time.sleep(0.001)
        out[...] = x - 1.0
        return float(np.sum((x - 1.0) ** 2))

    result = alg.run(params, worker_fn, steps)
    rows = gather((alg.steps, params.tobytes(), shared(result), result.idle_seconds))
    assert len({r[2] for r in rows}) == 1
    assert [rows[w][0] for w in workers(size)] == [int(s) for s in result.steps[workers(size)]]
    assert result.total_steps == sum(rows[w][0] for w in workers(size))
    if size > 1:
        assert rows[0][0] == 0 and rows[0][1] == rows[result.global_leader][1]
        assert all(result.uploads[w] >= 1 for w in workers(size))  # at least LAST
    if size == 4:
        assert result.uploads[3] == 1 and np.isnan(result.losses[3]) and result.steps[3] == 0
        assert result.global_leader != 3 and result.pulls[3].sum() == 0


def _quadratic(rank):
    """A worker's own convex objective 0.5 ||A x - b||^2 (float32): gradient A^T (A x - b)."""
    rng = np.random.default_rng([9, rank])
    a = (rng.standard_normal((D, D)) / np.sqrt(D) + np.eye(D)).astype(np.float32)
    b = rng.standard_normal(D).astype(np.float32)

    def worker_fn(x, step, out):
        r = a @ x - b
        np.matmul(a.T, r, out=out)
        return float(0.5 * r @ r)

    return worker_fn


SGD_SETTINGS = dict(lr=0.05, momentum=0.9, nesterov=True, weight_decay=1e-4)


def test_without_pulls_every_worker_is_torch_sgd(topology):
    rank, size = topology.rank, topology.size
    worker_fn, steps = _quadratic(rank), 25
    x0 = np.random.default_rng([10, rank]).standard_normal(D).astype(np.float32)
    params = x0.copy()
    alg = mpiopt.create("async_lsgd", topology, pull_local=0.0, pull_global=0.0, period=1, global_period=1, report_every=4,
                        **SGD_SETTINGS)
    alg.setup(params)
    result = alg.run(params, worker_fn, steps)
    sends = topology.ledger["world.Isend"].calls  # reports (every 4 steps at most) and the LAST upload

    ref = torch.nn.Parameter(torch.from_numpy(x0.copy()))
    opt = torch.optim.SGD([ref], **SGD_SETTINGS)
    grad = np.empty_like(x0)
    for k in range(steps):
        worker_fn(ref.detach().numpy(), k, grad)
        ref.grad = torch.from_numpy(grad.copy())
        opt.step()
    rows = gather(params.tobytes())
    if rank in workers(size):
        np.testing.assert_allclose(params, ref.detach().numpy(), rtol=1e-6, atol=1e-7)
    assert result.pulls.sum() == result.crossings.sum() == 0  # rounds are counted, nobody owes a pull
    N = len(workers(size))
    assert (result.local_rounds, result.global_rounds) == (steps, steps) and result.total_steps == N * steps
    assert list(result.uploads[workers(size)]) == [1] * N  # LAST only: no leader is needed
    if size > 1:
        assert rows[0] == rows[result.global_leader]
        if rank > 0:
            assert 2 <= sends <= steps // 4 + 1


def test_state_round_trip_continues_bit_identically(topology):
    """k steps, save, m more; a fresh instance restored from the save runs the same m steps bitwise (no pulls:
    asynchronous pulls depend on timing)."""
    rank = topology.rank
    worker_fn = _quadratic(rank)
    settings = dict(pull_local=0.0, pull_global=0.0, loss_window=3, **SGD_SETTINGS)
    params = np.random.default_rng([11, rank]).standard_normal(D).astype(np.float32)
    alg = mpiopt.create("async_lsgd", topology, **settings)
    alg.setup(params)
    alg.run(params, worker_fn, 5)
    state, saved = alg.state_dict(), params.copy()
    alg.run(params, worker_fn, 7)
    fresh = mpiopt.create("async_lsgd", topology, **settings)
    fresh.setup(saved)
    fresh.load_state_dict(state)
    fresh.run(saved, worker_fn, 7)
    a, b = fresh.state_dict(), alg.state_dict()
    np.testing.assert_array_equal(saved, params)
    for key in ("momentum_buffer", "recent_losses"):
        np.testing.assert_array_equal(a["arrays"][key], b["arrays"][key])
    assert a["scalars"] == b["scalars"] and a["steps"] == b["steps"]
    if rank in workers(topology.size):
        assert a["scalars"]["losses_seen"] == 12 and a["steps"] == 12


def test_leader_book_event_by_event():
    """The server's book on a scripted sequence: rounds, elections, which copy serves which debt, merging."""
    book = LeaderBook({1: 0, 2: 0, 3: 1}, period=2, global_period=4, pulls_on=(True, True))  # rounds: 6 and 12 steps
    none = ((-1, -1), (False, False))
    book.note(1, 4, 0.5)  # T = 4; rank 1 leads group 0 and the world
    assert book.answer(1) == (True, *none)  # so it is asked for its parameters
    book.note(2, 3, 0.7)  # T = 7: local round 1
    assert book.answer(2) == (False, *none)  # no copy yet: the pull stays owed
    book.uploaded(1, 4, 0.5, final=False)  # asked for before round 1, but rank 1 has not stepped since: current
    assert book.answer(2) == (False, (1, -1), (True, False))
    book.note(2, 9, 0.7)  # T = 13: local round 2, global round 1
    book.note(1, 5, 0.5)  # T = 14: rank 1 moves on
    assert book.answer(2) == (False, *none)  # a copy older than the crossings, left behind: the pulls wait
    assert book.answer(1) == (True, (1, 1), (False, False))  # the refresh; its own rounds settled as leader
    book.uploaded(1, 5, 0.5, final=False)
    book.note(1, 6, 0.5)  # T = 15: rank 1 moves on again, but its copy was asked for after both crossings
    assert book.answer(2) == (False, (1, 1), (True, True))  # one copy serves both pulls
    book.note(3, 5, 0.1)  # T = 20: local round 3; rank 3 leads the world (and its lone group)
    assert book.answer(3) == (True, (3, 3), (False, False))  # the new leader is asked; it owes nothing to itself
    assert book.answer(2) == (False, *none)  # the world's source is still rank 1 until rank 3's copy arrives
    book.note(2, 20, 0.9)  # T = 31: local rounds 4, 5 merge into rank 2's debt; global round 2
    assert (book.rounds, book.merged[2].tolist()) == ([5, 2], [2, 0])
    book.uploaded(3, 5, 0.1, final=True)  # LAST: the finished leader's final parameters, current for ever
    assert book.answer(2) == (False, (-1, 3), (False, True))
    for w in (1, 2):
        book.uploaded(w, int(book.steps[w]), float(book.loss[w]), final=True)
    record = book.record()
    assert record["global_leader"] == 3 and record["local_leaders"] == {0: 1, 1: 3}
    assert record["steps"] == [0, 6, 20, 5] and record["total_steps"] == 31
    assert record["pulls"] == [[0, 0], [0, 0], [2, 2], [0, 0]] and record["uploads"] == [0, 3, 1, 1]
    table = np.array(record["crossings"])
    assert table.tolist() == [[0, 0], [5, 2], [5, 2], [5, 2]]  # every round opened before each LAST
    assert np.array_equal(table, np.array(record["pulls"]) + np.array(record["as_leader"]) + np.array(record["merged"]))


def test_registry_defaults_and_validation(topology):
    alg = mpiopt.create("async_lsgd", topology)
    assert isinstance(alg, AsyncLSGD)
    lsgd = mpiopt.create("lsgd", topology).hyperparameters()
    assert alg.hyperparameters() == {**lsgd, "report_every": 1}
    cases = [
        (dict(nan_policy="skip"), ValueError, "nan_policy"),
        (dict(report_every=0), ValueError, "report_every"),
        (dict(report_every=1.5), TypeError, "report_every"),
        (dict(pull_local=1.5), ValueError, "pull_local"),
        (dict(period=8, global_period=4), ValueError, "period"),
    ]
    for kwargs, error, message in cases:
        with pytest.raises(error, match=message):
            mpiopt.create("async_lsgd", topology, **kwargs)
    params = np.zeros(D, np.float32)
    with pytest.raises(RuntimeError, match="setup"):
        alg.run(params, _quadratic(0), 1)
    alg.setup(params)
    with pytest.raises(RuntimeError, match="inside run"):
        alg.step(params, np.zeros(D, np.float32), loss=1.0)
    with pytest.raises(ValueError, match="steps or seconds"):
        alg.run(params, _quadratic(0))
    with pytest.raises(ValueError, match="seconds"):
        alg.run(params, _quadratic(0), seconds=-1.0)
    with pytest.raises(ValueError, match="steps"):
        alg.run(params, _quadratic(0), -3)


@pytest.mark.mpi(min_size=3)
def test_leader_copies_are_never_torn_by_an_upload_in_flight(topology):
    """Uploads above MPICH's eager limit take many progress rounds while the server answers others.

    Every worker starts uniform (all entries equal) and gets uniform gradients, so every leader copy
    and every pulled worker stays uniform, unless a reply copied an upload still being received.
    """
    rank = topology.rank
    big = 1 << 18  # 1 MiB of float32 per copy
    params = np.full(big, float(rank), dtype=np.float32)
    alg = mpiopt.create("async_lsgd", topology, lr=0.01, period=1, global_period=2, pull_local=0.5, pull_global=0.5, **NO_MOMENTUM)
    alg.setup(params)
    seen_torn = []

    def worker_fn(x, step, out):
        seen_torn.append(not np.all(x == x[0]))
        out[...] = 1.0 + rank  # uniform: the leader's parameters move every step
        return float(rank)

    result = alg.run(params, worker_fn, 25)
    torn = gather((any(seen_torn), bool(np.all(params == params[0]))))
    assert result.total_steps == 25 * len(workers(topology.size))
    assert all(not during and after for during, after in torn), torn
