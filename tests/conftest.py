"""Shared test machinery.

Every test has a time limit (``timeout`` in setup.cfg, pytest-timeout's
setting).  When it runs out, this file's timer prints the test's name and
every thread's stack and aborts the MPI job, so a deadlock fails fast and
names itself, at any world size (pytest-timeout's own handler exits so
abruptly that mpiexec may drop its output).

MPI tests (``@pytest.mark.mpi``) run at every world size from 1 to 4
(tools/test.sh).  Their verdict is collective: after each test the ranks
exchange pass/fail with a nonblocking Allreduce, so a failure on one rank
fails the test on every rank.  If some rank never reaches the verdict (it is
stuck in a collective that the failing rank left), the job is aborted after
``VERDICT_DEADLINE`` seconds with the test's name and the failing traceback,
instead of hanging.
"""

from __future__ import annotations

import faulthandler
import os
import sys
import threading
import time
import traceback

import numpy as np
import pytest

VERDICT_DEADLINE = float(os.environ.get("MPIOPT_TEST_VERDICT_DEADLINE", "60"))


def _world():
    from mpi4py import MPI

    return MPI.COMM_WORLD


_verdict_comm = None
_TIMER = pytest.StashKey[threading.Timer]()


def _release_output(item) -> None:
    """Stop pytest capturing, so what we print before an abort reaches the terminal (with what was captured)."""
    capman = item.config.pluginmanager.getplugin("capturemanager")
    if capman is not None:
        capman.suspend_global_capture(in_=True)
        out, err = capman.read_global_capture()
        sys.stdout.write(out)
        sys.stderr.write(err)


def _on_timeout(item, seconds: float) -> None:
    from mpiopt.comm import abort_job

    _release_output(item)
    rank, size = _world().Get_rank(), _world().Get_size()
    sys.stderr.write(f"\n+++ Timeout +++ {item.nodeid} ran past its {seconds:g} s limit on rank {rank} of {size}\n")
    faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
    abort_job("mpiopt tests: aborting the job after the timeout above.\n")


def pytest_collection_modifyitems(config, items):
    """tests/unit needs no MPI: ``one_mpi`` (.ci/run's second MPI leaves it out)."""
    unit = os.path.join(os.path.dirname(__file__), "unit") + os.sep
    for item in items:
        if str(item.path).startswith(unit):
            item.add_marker(pytest.mark.one_mpi)


@pytest.hookimpl(tryfirst=True)
def pytest_timeout_set_timer(item, settings):
    if not settings.timeout or settings.timeout <= 0:
        return None
    timer = threading.Timer(settings.timeout, _on_timeout, args=(item, settings.timeout))
    timer.daemon = True
    timer.start()
    item.stash[_TIMER] = timer
    return True


@pytest.hookimpl(tryfirst=True)
def pytest_timeout_cancel_timer(item):
    timer = item.stash.get(_TIMER, None)
    if timer is None:
        return None
    timer.cancel()
    del item.stash[_TIMER]
    return True


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_call(item):
    global _verdict_comm
    if item.get_closest_marker("mpi") is None or _world().Get_size() == 1:
        yield
        return
    from mpi4py import MPI

    if _verdict_comm is None:
        _verdict_comm = _world().Dup()
    outcome = yield
    excinfo = outcome.excinfo
    failed = excinfo is not None and not isinstance(excinfo[1], pytest.skip.Exception)
    rank, size = _verdict_comm.Get_rank(), _verdict_comm.Get_size()
    flags = np.zeros(size, dtype=np.uint8)
    flags[rank] = failed
    request = _verdict_comm.Iallreduce(MPI.IN_PLACE, flags, MPI.MAX)
    deadline = time.monotonic() + VERDICT_DEADLINE
    while not request.Test():
        if time.monotonic() > deadline:
            from mpiopt.comm import abort_job

            _release_output(item)
            own = "".join(traceback.format_exception(*excinfo)) if failed else "(this rank passed)\n"
            abort_job(
                f"\nmpiopt tests: {item.nodeid}: rank {rank} of {size} waited {VERDICT_DEADLINE:.0f} s for the "
                f"other ranks' verdict; some rank is stuck. Aborting the job.\n{own}"
            )
        time.sleep(0.001)
    bad = [r for r in range(size) if flags[r]]
    if bad and not failed:
        outcome.force_exception(AssertionError(f"{item.nodeid} failed on rank(s) {bad} (see rank {bad[0]}'s log)"))


@pytest.fixture
def world_size() -> int:
    return _world().Get_size()


@pytest.fixture
def topology():
    """A fresh Topology over COMM_WORLD (no emulated groups)."""
    from mpiopt import Topology

    topo = Topology()
    yield topo
    topo.Free()


def _check_bitwise_resume(topology, name, hyper, params0, grads, split, losses=None):
    """Run ``grads`` from ``params0``, saving state after ``split`` steps; a fresh instance restored
    from that state (set up from ``params0``, as a resumed job is, then given the saved parameters) must run
    the remaining steps to bitwise the same parameters and state.

    Returns ``(original, restored)`` for further checks, their exchanges in flight completed.
    """
    import mpiopt

    def steps(alg, params, first, last):
        for t in range(first, last):
            alg.step(params, grads[t], loss=None if losses is None else losses[t])

    params = params0.copy()
    alg = mpiopt.create(name, topology, **hyper)
    alg.setup(params)
    steps(alg, params, 0, split)
    state, saved = alg.state_dict(), params.copy()
    steps(alg, params, split, len(grads))
    fresh = mpiopt.create(name, topology, **hyper)
    resumed = params0.copy()
    fresh.setup(resumed)  # a set-up that moves the parameters (diloco's common start) is undone by the saved ones
    resumed[...] = saved
    fresh.load_state_dict(state)
    steps(fresh, resumed, split, len(grads))
    assert np.array_equal(params, resumed), "parameters differ after the resume"
    final, again = alg.state_dict(), fresh.state_dict()
    for key in alg.state_arrays:
        a, b = final["arrays"][key], again["arrays"][key]
        assert (a is None and b is None) or np.array_equal(a, b), f"state array {key!r} differs after the resume"
    assert final["scalars"] == again["scalars"] and fresh.steps == alg.steps == len(grads)
    alg.finish(params)  # an exchange in flight completes before its buffers go
    fresh.finish(resumed)
    return alg, fresh


@pytest.fixture
def bitwise_resume():
    """:func:`_check_bitwise_resume`: save, restore into a fresh instance, compare bitwise."""
    return _check_bitwise_resume
