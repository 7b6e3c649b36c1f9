"""LSGD: updates against a float64 recomputation, the election, local vs global leaders, bytes, resume,
the curse of symmetry (against EASGD), validation."""

from __future__ import annotations

import numpy as np
import pytest
from mpi4py import MPI

import mpiopt
from mpiopt.tasks import symmetric

pytestmark = pytest.mark.mpi

D = 129
PAIR = 16  # Comm.elect_min: one (float64, int32) pair, padded to 16 bytes


def gather(x) -> np.ndarray:
    """Every rank's array (or number), as float64 rows in rank order: the test's own view."""
    return np.array(MPI.COMM_WORLD.allgather(np.asarray(x, dtype=np.float64)))


def make_topology(group_size):
    return mpiopt.Topology(group_size=group_size) if group_size else mpiopt.Topology()


def lowest(ranks, means):
    """The rank of ``ranks`` with the smallest mean; ties to the lowest rank."""
    return min(ranks, key=lambda r: (means[r], r))


class Reference:
    """Float64 LSGD on every rank's rows, restarted each step from the algorithm's actual parameters."""

    def __init__(self, groups, lr, pull_local, pull_global, period, global_period, pull_form, proximal, loss_window):
        self.groups, self.lr, self.pl, self.pg = np.asarray(groups), lr, pull_local, pull_global
        self.period, self.global_period, self.form, self.p, self.window = period, global_period, pull_form, proximal, loss_window
        self.copies = None  # each rank's latest leader copy

    def step(self, t, X, G, losses):
        """Next parameters of every rank from X (after t - 1 steps); also the local leaders and the global leader."""
        N = len(X)
        means = losses[max(0, t - self.window) : t].mean(axis=0)
        local = np.array([lowest(np.flatnonzero(self.groups == self.groups[r]), means) for r in range(N)])
        glob = lowest(range(N), means)
        pulls = [(local, self.pl)] * (t % self.period == 0) + [(np.full(N, glob), self.pg)] * (t % self.global_period == 0)
        known = self.copies is not None
        if self.form == "paper":  # x_{t+1} = x_t - lr g - sum_pulls c (x_t - leader_t)
            pull = np.zeros_like(X)
            for leaders, c in pulls:
                pull += c * (X - X[leaders])
                self.copies = X[leaders]
            Y = X - self.lr * G
            if self.p and self.copies is not None:
                Y -= self.p * (Y - self.copies)
            Y -= pull
        else:  # local step, then y <- (1 - c) y + c y_leader, pull after pull
            Y = X - self.lr * G
            if self.p and known:
                Y = (1 - self.p) * Y + self.p * self.copies
            for leaders, c in pulls:
                self.copies = Y[leaders]
                Y = (1 - c) * Y + c * self.copies
        return Y, local, glob


@pytest.mark.parametrize("proximal", [0.0, 0.05])
@pytest.mark.parametrize("group_size", [None, 2])
@pytest.mark.parametrize("pull_form", ["paper", "convex"])
def test_updates_match_float64_formula(pull_form, group_size, proximal):
    topo = make_topology(group_size)
    N, rank, steps = topo.size, topo.rank, 9
    cfg = dict(lr=0.05, pull_local=0.3, pull_global=0.2, period=2, global_period=4, pull_form=pull_form,
               proximal=proximal, loss_window=3)
    rng = np.random.default_rng([7, rank])
    params = rng.standard_normal(D).astype(np.float32)
    grads = rng.standard_normal((steps, D)).astype(np.float32)
    losses = np.random.default_rng(8).uniform(0, 1, (steps, N))  # every rank knows every rank's losses
    alg = mpiopt.create("lsgd", topo, momentum=0.0, nesterov=False, weight_decay=0.0, **cfg)
    alg.setup(params)
    ref = Reference(MPI.COMM_WORLD.allgather(topo.group_index), **cfg)
    errors, leaders, expected = [], [], []
    want_local = want_global = -1  # the records keep the latest pull's leader (world ranks)
    for t in range(1, steps + 1):
        X, G = gather(params), gather(grads[t - 1])
        Y, local, glob = ref.step(t, X, G, losses)
        alg.step(params, grads[t - 1], loss=losses[t - 1, rank])
        errors.append(np.max(np.abs(params - Y[rank])))
        want_local = local[rank] if t % cfg["period"] == 0 else want_local
        want_global = glob if t % cfg["global_period"] == 0 else want_global
        leaders.append((alg.last_local_leader, alg.last_global_leader))
        expected.append((want_local, want_global))
    alone = topo.group.size == 1
    topo.Free()
    assert leaders == expected
    assert max(errors) < 2e-6, errors
    # The losses move the leadership around (except where a group is a single rank).
    assert len({local for local, _ in leaders[1:]}) > 1 or alone


def _elect(topology, losses_of_rank, window):
    """Steps with the given per-rank losses; the (local, global) leader seen by every rank after the last step."""
    steps = len(losses_of_rank(0))
    params = np.zeros(8, np.float32)
    alg = mpiopt.create("lsgd", topology, period=steps, global_period=steps, loss_window=window)
    alg.setup(params)
    for loss in losses_of_rank(topology.rank):
        alg.step(params, np.zeros(8, np.float32), loss=loss)
    return MPI.COMM_WORLD.allgather((alg.last_local_leader, alg.last_global_leader))


def test_leader_has_lowest_running_mean_same_on_every_rank(topology):
    N = topology.size
    # Window 3 over 4 steps: the first loss drops out; the last loss alone would elect rank 0.
    seen = _elect(topology, lambda r: [100.0, 0.0, 0.0, 5.0] if r == N - 1 else [0.0, 3.0, 3.0, 1.0], window=3)
    assert seen == [(N - 1, N - 1)] * N


def test_ties_go_to_the_lowest_rank(topology):
    N = topology.size
    seen = _elect(topology, lambda r: [1.0, 1.0] if r >= N // 2 else [2.0, 2.0], window=2)
    assert seen == [(N // 2, N // 2)] * N


def test_nan_loss_is_never_elected(topology):
    N = topology.size
    seen = _elect(topology, lambda r: [0.0, float("nan")] if r == 0 else [1.0, 1.0], window=2)
    assert seen == [(min(1, N - 1), min(1, N - 1))] * N


@pytest.mark.parametrize("pull_form", ["paper", "convex"])
def test_leader_is_not_moved_by_its_own_pull(topology, pull_form):
    x0 = np.random.default_rng([4, topology.rank]).standard_normal(D).astype(np.float32)
    params = x0.copy()
    alg = mpiopt.create("lsgd", topology, pull_local=0.3, pull_global=0.3, period=1, global_period=1, pull_form=pull_form,
                        momentum=0.0, nesterov=False, weight_decay=0.0)
    alg.setup(params)
    alg.step(params, np.zeros(D, np.float32), loss=float(topology.rank))  # zero gradient: only the pull acts
    if topology.rank == 0:  # the leader (lowest loss): not a bit changes, though (1 - c) x + c x would round
        np.testing.assert_array_equal(params, x0)
    else:
        assert np.all(params != x0)


@pytest.mark.mpi(min_size=4)
def test_local_pulls_stay_in_the_group_global_pull_follows_the_world_leader():
    topo = mpiopt.Topology(group_size=2)  # groups {0, 1}, {2, 3}, ...
    rank = topo.rank
    # Zero gradients: only the pulls move the parameters.  Losses: rank 0 is the
    # global leader, rank 3 the leader of group {2, 3}.
    loss = {0: 0.0, 1: 1.0, 2: 3.0, 3: 2.0}.get(rank, 5.0 + rank)
    params = np.full(D, float(rank), np.float32)
    alg = mpiopt.create("lsgd", topo, lr=0.1, pull_local=0.5, pull_global=0.25, period=1, global_period=2,
                        momentum=0.0, nesterov=False, weight_decay=0.0)
    alg.setup(params)
    zero = np.zeros(D, np.float32)
    alg.step(params, zero, loss=loss)  # local pulls only
    after_local, leaders_1 = params.copy(), (alg.last_local_leader, alg.last_global_leader)
    alg.step(params, zero, loss=loss)  # local, then global (paper form: both from the same x_t)
    leaders_2 = (alg.last_local_leader, alg.last_global_leader)
    topo.Free()
    # Step 1: x <- x - 0.5 (x - x_local_leader); group {2, 3} never sees group {0, 1}.
    local_1 = {0: 0.0, 1: 0.5, 2: 2.5, 3: 3.0}
    # Step 2 from x_1: x - 0.5 (x - x_local_leader) - 0.25 (x - x_rank0).
    both_2 = {0: 0.0, 1: 0.5 - 0.25 - 0.125, 2: 2.5 + 0.25 - 0.625, 3: 3.0 - 0.75}
    if rank < 4:
        np.testing.assert_array_equal(after_local, local_1[rank])
        np.testing.assert_array_equal(params, both_2[rank])
        assert leaders_1 == ({0: 0, 1: 0, 2: 3, 3: 3}[rank], -1)
        assert leaders_2 == ({0: 0, 1: 0, 2: 3, 3: 3}[rank], 0)


@pytest.mark.parametrize("group_size", [None, 2])
def test_bytes_per_pull_are_election_plus_4d(group_size):
    topo = make_topology(group_size)
    params, grad = np.zeros(D, np.float32), np.ones(D, np.float32)
    alg = mpiopt.create("lsgd", topo, period=2, global_period=4)
    alg.setup(params)
    before = topo.ledger.snapshot()
    got, want = [], []
    for t in range(1, 5):
        record = alg.step(params, grad, loss=float(topo.rank % 3))
        got.append((record.bytes_sent, record.bytes_recv))
        sent = recv = 0
        local, world = t % 2 == 0, t % 4 == 0 and (topo.num_groups > 1 or t % 2 != 0)
        for due, size, leader in ((local, topo.group.size, alg.last_local_leader), (world, topo.size, alg.last_global_leader)):
            if due and size > 1:  # elect_min both ways; Bcast: the leader sends 4d, the others receive 4d
                sent += PAIR + 4 * D * (leader == topo.rank)
                recv += PAIR + 4 * D * (leader != topo.rank)
        want.append((sent, recv))
    delta = topo.ledger.since(before)
    calls = (delta["group.Bcast"].calls, delta["world.Bcast"].calls, delta["group.elect_min"].calls)
    multi = topo.num_groups > 1
    topo.Free()
    assert got == want
    assert calls == (2, 1 if multi else 0, 2)  # one group: the global pull reuses the local election


def test_step_without_loss_raises():
    # Without the abort (the default aborts the job: tests/e2e/test_no_hang.py) the error is raised.
    topology = mpiopt.Topology(abort_on_error=False)
    params = np.zeros(D, np.float32)
    alg = mpiopt.create("lsgd", topology)
    alg.setup(params)
    with pytest.raises(ValueError, match=r"needs this rank's training loss \(step\(params, grad, loss=\.\.\.\)\)"):
        alg.step(params, np.zeros(D, np.float32))
    assert alg.steps == 0
    topology.Free()


@pytest.mark.parametrize("pull_form", ["paper", "convex"])
def test_resume_is_bitwise(pull_form):
    """Run k steps, save; a fresh instance restored from there runs m more steps identically."""
    topo = mpiopt.Topology(group_size=2)
    settings = dict(period=2, global_period=4, pull_form=pull_form, proximal=0.05, loss_window=3)
    k, m = 5, 7
    rng = np.random.default_rng([3, topo.rank])
    x0, grads = rng.standard_normal(D).astype(np.float32), rng.standard_normal((k + m, D)).astype(np.float32)
    losses = rng.uniform(size=k + m)
    params = x0.copy()
    alg = mpiopt.create("lsgd", topo, **settings)
    alg.setup(params)
    for g, loss in zip(grads[:k], losses[:k]):
        alg.step(params, g, loss=loss)
    state, saved = alg.state_dict(), params.copy()
    for g, loss in zip(grads[k:], losses[k:]):
        alg.step(params, g, loss=loss)
    resumed = saved.copy()
    fresh = mpiopt.create("lsgd", topo, **settings)
    fresh.setup(resumed)
    fresh.load_state_dict(state)
    for g, loss in zip(grads[k:], losses[k:]):
        fresh.step(resumed, g, loss=loss)
    topo.Free()
    np.testing.assert_array_equal(resumed, params)
    a, b = fresh.state_dict(), alg.state_dict()
    for key in ("momentum_buffer", "leader_copy", "recent_losses"):
        np.testing.assert_array_equal(a["arrays"][key], b["arrays"][key])
    assert a["scalars"] == b["scalars"] and a["scalars"]["losses_seen"] == k + m
    assert state["scalars"]["last_local_leader"] >= 0 and state["arrays"]["leader_copy"] is not None


@pytest.mark.mpi(min_size=2)
def test_curse_of_symmetry_easgd_centre_stalls_at_the_maximum_lsgd_reaches_a_minimum(topology):
    """Workers start in mirror-image wells of f(x) = sum (x_j^2 - 1)^2 (mpiopt.tasks.symmetric)."""
    start = symmetric.mirrored_starts(topology.size, 4, seed=5)[topology.rank]
    grad = np.empty_like(start)

    def run(name, **hyper):
        # Full-batch gradient descent between pulls, a pull every step.
        params = start.copy()
        alg = mpiopt.create(name, topology, lr=0.05, period=1, momentum=0.0, nesterov=False, weight_decay=0.0, **hyper)
        alg.setup(params)
        for _ in range(300):
            alg.step(params, symmetric.gradient(params, out=grad), loss=symmetric.loss(params))
        return alg, params

    easgd, easgd_worker = run("easgd", beta=0.9)
    lsgd, lsgd_worker = run("lsgd", global_period=4)  # pull_local = pull_global = 0.1
    center = easgd.center
    # EASGD: the centre is stationary (gradient ~ 0) but the Hessian there is negative: not a minimum.
    assert np.linalg.norm(symmetric.gradient(center)) < 1e-6
    assert symmetric.hessian_eigenvalues(center).min() < 0 and not symmetric.is_local_minimum(center)
    assert not symmetric.is_local_minimum(easgd_worker, tol=1e-2)  # held between the wells
    # LSGD: every worker ends at a minimum (all in the leader's well).
    assert symmetric.is_local_minimum(lsgd_worker), (np.linalg.norm(symmetric.gradient(lsgd_worker)), lsgd_worker)


def test_defaults_and_validation(topology):
    alg = mpiopt.create("lsgd", topology)
    hyper = alg.hyperparameters()
    assert (hyper["pull_local"], hyper["pull_global"], hyper["period"], hyper["global_period"]) == (0.1, 0.1, 4, 16)
    assert (hyper["momentum"], hyper["nesterov"], hyper["weight_decay"], hyper["pull_form"]) == (0.9, True, 1e-4, "paper")
    assert mpiopt.create("lsgd", topology, global_period=64).period == 16
    assert mpiopt.create("lsgd", topology, global_period=2).period == 1
    cases = [
        (dict(pull_local=1.5), ValueError, "pull_local"),
        (dict(pull_global=-0.1), ValueError, "pull_global"),
        (dict(pull_global="0.1"), TypeError, "pull_global"),
        (dict(period=0), ValueError, "period"),
        (dict(period=8, global_period=4), ValueError, "period must be <= global_period"),
        (dict(global_period=1.5), TypeError, "global_period"),
        (dict(pull_form="mix"), ValueError, "pull_form"),
        (dict(proximal=1.0), ValueError, "proximal"),
        (dict(loss_window=0), ValueError, "loss_window"),
        (dict(nesterov=True, momentum=0.0), ValueError, "nesterov"),
    ]
    for kwargs, error, message in cases:
        with pytest.raises(error, match=message):
            mpiopt.create("lsgd", topology, **kwargs)
