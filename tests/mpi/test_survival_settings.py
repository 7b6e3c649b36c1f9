"""Surviving a lost rank is a setting of the topology: refused on every rank where the MPI cannot keep it, before
any collective of an algorithm, with the launch line named; ``abort`` stays MPI's own behaviour (docs/failures.md).

The survival itself (a rank killed from outside) runs under Open MPI's ULFM in tests/e2e/test_survival.py.
"""

from __future__ import annotations

import numpy as np
import pytest

import mpiopt
from mpiopt import Topology
from mpiopt.comm.survival import LAUNCH, ON_FAILURE_ENV, ulfm_problem

pytestmark = pytest.mark.mpi


@pytest.mark.skipif(ulfm_problem() is None, reason="this job runs with ULFM: shrink is accepted here")
@pytest.mark.parametrize("on_failure", ["shrink", "respawn"])
def test_survival_refused_without_ulfm_on_every_rank(world_size, on_failure):
    with pytest.raises(ValueError) as error:
        Topology(on_failure=on_failure)
    text = str(error.value)
    assert f"on_failure={on_failure!r}" in text and LAUNCH in text
    # Every rank raised and none is left in a collective: the world still answers.
    from mpi4py import MPI

    assert MPI.COMM_WORLD.allreduce(1) == world_size


@pytest.mark.skipif(ulfm_problem() is None, reason="this job runs with ULFM: shrink is accepted here")
def test_survival_refused_from_the_environment(world_size, monkeypatch):
    monkeypatch.setenv(ON_FAILURE_ENV, "shrink")
    with pytest.raises(ValueError, match="--with-ft ulfm"):
        Topology()


def test_an_unknown_mode_is_named(world_size):
    with pytest.raises(ValueError, match=r"on_failure must be one of abort, shrink, respawn, got 'restart'"):
        Topology(on_failure="restart")


def test_abort_is_the_default_and_keeps_no_rollback(world_size, monkeypatch):
    monkeypatch.delenv(ON_FAILURE_ENV, raising=False)
    topo = Topology()
    assert topo.on_failure == "abort" and topo.first_ranks == []
    alg = mpiopt.create("sgd", topo, lr=0.1)
    params = np.ones(8)
    alg.setup(params)
    alg.step(params, np.full(8, 2.0))
    np.testing.assert_array_equal(params, np.full(8, 0.8))
    assert alg._rollback is None  # no copy per step where nothing can be rolled back
    with pytest.raises(RuntimeError, match="recover\\(\\) needs Topology\\(on_failure='shrink'\\)"):
        topo.recover()
    with pytest.raises(RuntimeError, match="recovered\\(\\) needs a Topology\\(on_failure="):
        alg.recovered(params)
    topo.Free()


def test_survivors_state_moves_each_entry_by_its_rule(world_size):
    """Each rule over the survivors (here: the world stands for them) against numpy: kept, reset, the float64 mean,
    a sum over the 7 old workers rescaled to this many."""
    from mpiopt.algorithms.resize import COPY, FOLLOW, MEAN, RESCALE, ZERO
    from mpiopt.algorithms.survival import survivors_state

    topo = Topology()
    mine = [np.random.default_rng([5, r]).standard_normal(6).astype(np.float32) for r in range(world_size)]
    me = mine[topo.rank]
    rules = {"copied": COPY, "followed": FOLLOW, "mean": MEAN, "sum": RESCALE, "zeroed": ZERO, "count": COPY}
    state = {"steps": 3, "arrays": {k: me.copy() for k in ("copied", "followed", "mean", "sum", "zeroed")},
             "scalars": {"count": 4}}
    moved = survivors_state(rules, state, topo.world, old_workers=7)
    for key in ("copied", "followed"):
        np.testing.assert_array_equal(moved["arrays"][key], me)
    np.testing.assert_array_equal(moved["arrays"]["mean"], (np.sum(np.array(mine, np.float64), axis=0) / world_size).astype(np.float32))
    np.testing.assert_array_equal(moved["arrays"]["sum"], (me.astype(np.float64) * world_size / 7).astype(np.float32))
    np.testing.assert_array_equal(moved["arrays"]["zeroed"], np.zeros(6, np.float32))
    assert moved["scalars"] == {"count": 4} and moved["steps"] == 3
    topo.Free()


def test_replacements_take_the_survivors_mean_and_add_nothing(world_size):
    """After a respawn the first ranks stand for the survivors and the others for the replacements, which hold the
    state of the survivor they follow: the mean is the survivors' alone, on every rank; the rest as a survivor's."""
    from mpiopt.algorithms.resize import FOLLOW, MEAN
    from mpiopt.algorithms.survival import survivors_state

    topo = Topology()
    surviving = max(1, world_size // 2)
    mine = [np.random.default_rng([6, r]).standard_normal(5).astype(np.float32) for r in range(world_size)]
    held = mine[topo.rank if topo.rank < surviving else topo.rank % surviving]  # a replacement: its survivor's
    state = {"steps": 2, "arrays": {"mean": held.copy(), "followed": held.copy()}, "scalars": {}}
    moved = survivors_state({"mean": MEAN, "followed": FOLLOW}, state, topo.world, old_workers=world_size,
                            surviving=surviving, survivor=topo.rank < surviving)
    expected = (np.sum(np.array(mine[:surviving], np.float64), axis=0) / surviving).astype(np.float32)
    np.testing.assert_array_equal(moved["arrays"]["mean"], expected)
    np.testing.assert_array_equal(moved["arrays"]["followed"], held)
    topo.Free()
