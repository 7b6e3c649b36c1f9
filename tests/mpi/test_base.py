"""The algorithm base class and the topology's error handling: state checks, failed set-ups, abort settings."""

from __future__ import annotations

import sys
import threading

import numpy as np
import pytest

import mpiopt
from mpiopt.algorithms.sgd import SGD
from mpiopt.comm import SetupMismatchError, Topology
from mpiopt.comm import abort
from mpiopt.comm.abort import OtherRankError

pytestmark = pytest.mark.mpi

D = 12
SETTINGS = dict(lr=0.1, momentum=0.9, nesterov=True, weight_decay=1e-4)


def trained(topology, steps=3, **settings):
    """An sgd instance after ``steps`` steps, and its parameters."""
    alg = mpiopt.create("sgd", topology, **{**SETTINGS, **settings})
    params = np.linspace(-1, 1, D).astype(np.float32)
    alg.setup(params)
    rng = np.random.default_rng([4, topology.rank])
    for _ in range(steps):
        alg.step(params, rng.standard_normal(D).astype(np.float32))
    return alg, params


def fresh(topology, **settings):
    alg = mpiopt.create("sgd", topology, **{**SETTINGS, **settings})
    alg.setup(np.zeros(D, np.float32))
    return alg


# -- load_state_dict ---------------------------------------------------------------------------
def test_state_records_world_size_and_hyperparameters(topology):
    state = trained(topology)[0].state_dict()
    assert state["world_size"] == topology.size
    assert state["hyperparameters"] == {"momentum": 0.9, "dampening": 0.0, "nesterov": True, "weight_decay": 1e-4}


def test_other_hyperparameters_are_refused_with_every_difference(topology):
    state = trained(topology)[0].state_dict()
    alg = fresh(topology, momentum=0.5, nesterov=False)
    with pytest.raises(ValueError) as err:
        alg.load_state_dict(state)
    message = str(err.value)
    assert "hyperparameter momentum: saved 0.9, here 0.5" in message, message
    assert "hyperparameter nesterov: saved True, here False" in message, message
    assert "weight_decay" not in message and "dampening" not in message, message
    assert "override_hyperparameters=True" in message
    assert alg.steps == 0 and alg.local.buffer is None  # nothing was loaded


def test_other_world_size_is_refused_even_with_override(topology):
    state = trained(topology)[0].state_dict()
    state["world_size"] = topology.size + 1
    alg = fresh(topology)
    for override in (False, True):
        with pytest.raises(ValueError, match=rf"world_size: saved {topology.size + 1}, here {topology.size}"):
            alg.load_state_dict(state, override_hyperparameters=override)
    assert alg.steps == 0


def test_override_keeps_this_instances_hyperparameters(topology):
    original, params = trained(topology)
    state = original.state_dict()
    alg = fresh(topology, momentum=0.5, nesterov=False, weight_decay=0.0)
    alg.load_state_dict(state, override_hyperparameters=True)
    assert alg.steps == original.steps and np.array_equal(alg.local.buffer, original.local.buffer)
    assert alg.hyperparameters() == {"momentum": 0.5, "dampening": 0.0, "nesterov": False, "weight_decay": 0.0}
    # The next step follows this instance's rule: heavy-ball momentum 0.5 from the restored buffer.
    grad = np.full(D, 0.25, np.float32)
    expected = params - 0.1 * (0.5 * original.local.buffer + grad)
    alg.step(params, grad)
    np.testing.assert_allclose(params, expected, rtol=1e-6, atol=1e-7)


def test_state_read_back_from_a_file_fits(topology):
    """Numbers come back from HDF5 or JSON as numpy scalars or lists: the same values still fit."""
    original, _ = trained(topology)
    state = original.state_dict()
    state["world_size"] = np.int64(topology.size)
    state["hyperparameters"] = {k: np.asarray(v)[()] for k, v in state["hyperparameters"].items()}
    alg = fresh(topology)
    alg.load_state_dict(state)
    assert alg.steps == original.steps and np.array_equal(alg.local.buffer, original.local.buffer)


def test_state_without_world_size_and_other_shapes_are_refused(topology):
    state = trained(topology)[0].state_dict()
    alg = fresh(topology)
    with pytest.raises(ValueError, match=r"state for 'sgd' lacks \['world_size'\]"):
        alg.load_state_dict({k: v for k, v in state.items() if k != "world_size"})
    state["arrays"]["momentum_buffer"] = np.zeros(D + 1, np.float32)
    with pytest.raises(ValueError, match=rf"array momentum_buffer shape: saved \({D + 1},\), here \({D},\)"):
        trained(topology)[0].load_state_dict(state)


# -- setup ------------------------------------------------------------------------------------
class FailingSGD(SGD):
    """SGD whose allocation raises on the ranks in ``failing``."""

    def __init__(self, topology, failing, **settings):
        super().__init__(topology, **settings)
        self.failing = failing

    def _allocate(self, params):
        super()._allocate(params)
        if self.topology.rank in self.failing:
            raise MemoryError(f"no room for {params.size} parameters on rank {self.topology.rank}")


def assert_not_set_up(alg):
    assert alg.num_params is None and alg.dtype is None and alg._xp is np
    with pytest.raises(RuntimeError, match="setup"):
        alg.step(np.zeros(D, np.float32), np.zeros(D, np.float32))


def test_failed_setup_on_every_rank_leaves_it_not_set_up(topology):
    alg = FailingSGD(topology, failing=range(topology.size), lr=0.1)
    with pytest.raises(MemoryError, match=f"no room for {D} parameters on rank {topology.rank}"):
        alg.setup(np.zeros(D, np.float32))
    assert_not_set_up(alg)
    alg.failing = ()
    alg.setup(np.zeros(D, np.float32))  # a later set-up that succeeds
    assert alg.num_params == D and alg.dtype == np.float32


@pytest.mark.mpi(min_size=2)
def test_setup_failing_on_one_rank_raises_on_every_rank(topology):
    alg = FailingSGD(topology, failing=(1,), lr=0.1)
    if topology.rank == 1:
        with pytest.raises(MemoryError, match=f"no room for {D} parameters on rank 1"):
            alg.setup(np.zeros(D, np.float32))
    else:
        with pytest.raises(OtherRankError, match="the sgd set-up failed on rank 1:\n  rank 1: MemoryError: no room"):
            alg.setup(np.zeros(D, np.float32))
    assert_not_set_up(alg)


@pytest.mark.mpi(min_size=2)
def test_unfit_buffer_on_one_rank_raises_on_every_rank(topology):
    alg = mpiopt.create("sgd", topology, lr=0.1)
    params = np.zeros((2, D), np.float32) if topology.rank == 1 else np.zeros(D, np.float32)
    with pytest.raises(SetupMismatchError) as err:
        alg.setup(params)
    messages = topology.world.allgather_obj(str(err.value))
    assert len(set(messages)) == 1, messages
    assert "rank 1: 'ValueError: params must be a contiguous 1-D array, got shape (2, 12)'" in messages[0], messages[0]
    assert_not_set_up(alg)


# -- abort settings ---------------------------------------------------------------------------
@pytest.fixture
def default_hooks():
    """Python's own hooks in place during the test; whatever was installed before, back after it."""
    saved = sys.excepthook, threading.excepthook
    sys.excepthook, threading.excepthook = sys.__excepthook__, threading.__excepthook__
    yield
    sys.excepthook, threading.excepthook = saved


def test_opting_out_installs_no_hooks(default_hooks, monkeypatch):
    monkeypatch.delenv("MPIOPT_ABORT_ON_ERROR", raising=False)
    topo = Topology(abort_on_error=False)
    assert not topo.abort_on_error
    assert sys.excepthook is sys.__excepthook__ and threading.excepthook is threading.__excepthook__
    topo.Free()
    monkeypatch.setenv("MPIOPT_ABORT_ON_ERROR", "0")
    topo = Topology()
    assert not topo.abort_on_error
    assert sys.excepthook is sys.__excepthook__ and threading.excepthook is threading.__excepthook__
    topo.Free()


def test_default_installs_the_hooks(default_hooks, monkeypatch):
    monkeypatch.delenv("MPIOPT_ABORT_ON_ERROR", raising=False)
    topo = Topology()
    assert topo.abort_on_error
    assert sys.excepthook is abort._hook and threading.excepthook is abort._thread_hook
    topo.Free()


def test_topology_keeps_a_hook_someone_else_installed(default_hooks):
    def collector(args):  # like pytest's collector of exceptions in threads
        pass

    threading.excepthook = collector
    topo = Topology(abort_on_error=True)
    assert sys.excepthook is abort._hook and threading.excepthook is collector
    mpiopt.abort_on_exception()  # an explicit call replaces it
    assert threading.excepthook is abort._thread_hook
    topo.Free()


@pytest.mark.parametrize(
    "value, argument, expected",
    [("1", None, True), ("yes", None, True), (" off ", None, False), ("FALSE", None, False), ("", None, True), ("0", True, True), ("1", False, False)],
)
def test_abort_setting_from_environment(default_hooks, monkeypatch, value, argument, expected):
    monkeypatch.setenv("MPIOPT_ABORT_ON_ERROR", value)
    topo = Topology(abort_on_error=argument)
    assert topo.abort_on_error is expected
    topo.Free()


def test_bad_abort_settings_name_themselves(default_hooks, monkeypatch):
    monkeypatch.setenv("MPIOPT_ABORT_ON_ERROR", "maybe")
    with pytest.raises(ValueError, match="MPIOPT_ABORT_ON_ERROR must be one of 1/0/true/false/yes/no/on/off, got 'maybe'"):
        Topology()
    monkeypatch.delenv("MPIOPT_ABORT_ON_ERROR")
    with pytest.raises(TypeError, match="abort_on_error must be True, False or None, got 'yes'"):
        Topology(abort_on_error="yes")


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize(
    "variable, value, shown",
    [
        ("MPIOPT_GROUP_SIZE", "two", "group_size: rank 0: None, rank 1: \"ValueError: MPIOPT_GROUP_SIZE must be a positive integer, got 'two'\""),
        ("MPIOPT_GROUP_SIZE", "1", "group_size: rank 0: None, rank 1: 1"),
        ("MPIOPT_ABORT_ON_ERROR", "sometimes", "abort_on_error: rank 0: True, rank 1: \"ValueError: MPIOPT_ABORT_ON_ERROR must be"),
        ("MPIOPT_ABORT_ON_ERROR", "0", "abort_on_error: rank 0: True, rank 1: False"),
    ],
)
def test_setting_on_one_rank_raises_on_every_rank(world_size, default_hooks, monkeypatch, variable, value, shown):
    for name in ("MPIOPT_GROUP_SIZE", "MPIOPT_ABORT_ON_ERROR"):
        monkeypatch.delenv(name, raising=False)
    from mpi4py import MPI

    if MPI.COMM_WORLD.Get_rank() == 1:
        monkeypatch.setenv(variable, value)
    with pytest.raises(SetupMismatchError, match="ranks disagree on the topology settings") as err:
        Topology()
    messages = MPI.COMM_WORLD.allgather(str(err.value))
    assert len(set(messages)) == 1, messages
    assert shown in messages[0], messages[0]


def test_raise_or_abort_raises_without_the_abort(monkeypatch):
    topo = Topology(abort_on_error=False)
    with pytest.raises(KeyError, match="deliberate"):
        topo.raise_or_abort(KeyError("deliberate"))
    topo.Free()


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")
def test_an_exception_in_a_thread_under_pytest_does_not_abort(topology):
    """pytest reports exceptions in threads through its own hook, which a topology leaves in place."""
    assert threading.excepthook is not abort._thread_hook

    def fail():
        raise RuntimeError("deliberate failure in a thread")

    thread = threading.Thread(target=fail)
    thread.start()
    thread.join()
    topology.world.Barrier()  # every rank is still alive


# -- where the gradient is checked ------------------------------------------------------------
@pytest.mark.parametrize("name, policy, at_one_rank_only", [
    ("sgd", "raise", False), ("easgd", "raise", False), ("dasgd", "raise", False),
    ("topk", "raise", False), ("regtopk", "raise", False),
    ("sgd", "skip", None), ("easgd", "skip", None), ("topk", "skip", None), ("lsgd", "raise", None), ("signum", "raise", None),
])
def test_the_update_checks_the_gradient_where_it_reads_this_ranks_own(topology, monkeypatch, name, policy, at_one_rank_only):
    # nan_policy="raise" and an update that reads this rank's gradient: the update's own pass checks it (no
    # pass of its own before; None: never); a non-finite value still names this rank, before the step communicates.
    from mpiopt.algorithms import nonfinite as base

    checks, real = [], base.all_finite
    monkeypatch.setattr(base, "all_finite", lambda grad: checks.append(1) or real(grad))
    fused = at_one_rank_only is not None and (topology.size == 1 or not at_one_rank_only)
    own = Topology(abort_on_error=False)
    try:
        alg = mpiopt.create(name, own, lr=0.1, nan_policy=policy)
        params = np.zeros(D, np.float32)
        alg.setup(params)
        alg.step(params, np.ones(D, np.float32), loss=1.0)
        assert alg._checks_in_step() is fused and len(checks) == (0 if fused else 1)
        if fused:  # every rank's gradient is bad, so every rank raises before the step communicates
            bad = np.ones(D, np.float32)
            bad[D - 1] = np.inf
            with pytest.raises(FloatingPointError, match=f"{name}: non-finite gradient on rank {topology.rank} at step 2"):
                alg.step(params, bad, loss=1.0)
            assert alg.steps == 1
    finally:
        own.Free()
