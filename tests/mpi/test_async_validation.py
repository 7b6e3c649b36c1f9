"""A bad step count or time budget on one rank only: every rank raises the same error, nobody hangs.

The asynchronous drivers let each rank pass its own ``steps`` and
``seconds``, so a bad value may sit on one rank.  Each case below gives it to
one rank alone and checks that every rank raises the same error, naming the
value and the rank, and that the next run on the same communicator works
(no message of the failed call is left behind).
"""

import numpy as np
import pytest

import mpiopt
from mpiopt.asyncrt import agree_on_arguments, run_async

pytestmark = [pytest.mark.mpi(min_size=2)]

D = 5


def _raised_everywhere(topology, error, call):
    """Run ``call`` expecting ``error``; return every rank's message (the same, or the assertion says who differs)."""
    with pytest.raises(error) as caught:
        call()
    messages = topology.world.allgather_obj(str(caught.value))
    assert len(set(messages)) == 1, messages
    return messages[0]


def _add_one(params, payload, arrival):
    params += payload


def _ones(params, step, out):
    out[...] = 1.0
    return 0.5


def test_run_async_with_a_bad_steps_on_one_rank(topology):
    bad = topology.size - 1
    params = np.zeros(D)
    message = _raised_everywhere(
        topology, ValueError, lambda: run_async(topology.world, params, _add_one, _ones, -3 if topology.rank == bad else 4)
    )
    assert message == f"run_async: rank {bad}: steps must be >= 0, got -3"
    result = run_async(topology.world, params, _add_one, _ones, 4)  # the communicator is clean
    assert result.version == 4 * (topology.size - 1) and np.all(params == result.version)


def test_errors_of_several_ranks_are_listed_together_with_the_lowest_ranks_type(topology):
    """Rank 0 has a step count of the wrong type, the others a negative one: a TypeError listing both."""
    steps = 2.5 if topology.rank == 0 else -1
    message = _raised_everywhere(topology, TypeError, lambda: run_async(topology.world, np.zeros(D), _add_one, _ones, steps))
    others = ", ".join(str(r) for r in range(1, topology.size))
    label = "rank" if topology.size == 2 else "ranks"
    assert message == f"run_async: rank 0: steps must be an integer, got 2.5; {label} {others}: steps must be >= 0, got -1"


def test_async_msgd_run_with_a_bad_steps_on_one_rank(topology):
    params = np.zeros(D, np.float32)
    alg = mpiopt.create("async_msgd", topology, lr=0.5, momentum=0.0)
    alg.setup(params)
    message = _raised_everywhere(topology, TypeError, lambda: alg.run(params, _ones, "3" if topology.rank == 1 else 3))
    assert message == "async_msgd.run: rank 1: steps must be an integer, got '3'"
    result = alg.run(params, _ones, 3)
    assert result.version == 3 * (topology.size - 1) and np.all(params == -0.5 * result.version)


def test_async_msgd_run_with_parameters_unlike_the_set_up_on_one_rank(topology):
    alg = mpiopt.create("async_msgd", topology)
    alg.setup(np.zeros(D, np.float32))
    params = np.zeros(D + 1 if topology.rank == 0 else D, np.float32)
    message = _raised_everywhere(topology, ValueError, lambda: alg.run(params, _ones, 2))
    assert message.startswith("async_msgd.run: rank 0: params has 6 elements of float32; set-up was 5 of float32")


@pytest.mark.parametrize(
    "steps,seconds,error,text",
    [
        (5, -1.0, ValueError, "seconds must be > 0, got -1.0"),
        (5, float("nan"), TypeError, "seconds must be a finite number, got nan"),
        (None, None, ValueError, "run() needs steps or seconds (or both)"),
        (-2, None, ValueError, "steps must be >= 0, got -2"),
    ],
)
def test_async_lsgd_run_with_a_bad_budget_on_one_rank(topology, steps, seconds, error, text):
    """The server's budget is ignored, but checked too: the bad value is on the server here at 2 ranks."""
    bad = topology.size - 2
    params = np.full(D, float(topology.rank), np.float32)
    alg = mpiopt.create("async_lsgd", topology, pull_local=0.0, pull_global=0.0)
    alg.setup(params)

    def worker_fn(x, step, out):
        out[...] = 0.0
        return 1.0

    mine = dict(steps=steps, seconds=seconds) if topology.rank == bad else dict(steps=3)
    message = _raised_everywhere(topology, error, lambda: alg.run(params, worker_fn, **mine))
    assert message == f"async_lsgd.run: rank {bad}: {text}"
    result = alg.run(params, worker_fn, 3)
    assert result.total_steps == 3 * (topology.size - 1)


def test_without_a_communicator_the_local_verdict_stands(topology):
    with pytest.raises(TypeError, match="world must be an mpiopt.comm.Comm, got NoneType"):
        agree_on_arguments(None, "f", lambda: None)

    def bad_argument():
        raise ValueError("local")

    with pytest.raises(ValueError, match="^local$"):
        agree_on_arguments(None, "f", bad_argument)
