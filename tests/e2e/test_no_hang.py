"""Library use, no abort_on_exception() call: a failure on one rank of two ends the job with its message.

Each script fails on rank 1 only.  Where the failure is found in the middle
of a step, the script catches the exception and carries on, as a user might:
without the abort, rank 0 would wait forever in that step's collective.
"""

from __future__ import annotations

import textwrap

import pytest

from mpiopt.comm.topology import VOTE_SECONDS

from .launch import run_mpi

PREAMBLE = """
import os
import numpy as np
from mpi4py import MPI
import mpiopt

rank = MPI.COMM_WORLD.Get_rank()
params = np.zeros(8, np.float32)
grad = np.ones(8, np.float32)


def failing(name):
    # Algorithm `name` whose allocation fails on rank 1, before anything its set-up communicates.

    class Failing(mpiopt.algorithms.algorithm_class(name)):
        def _allocate(self, params):
            if rank == 1:
                raise MemoryError("deliberate allocation failure on rank 1")
            super()._allocate(params)

    return Failing
"""


def _nan_gradient(name: str, settings: str, aborting: str = "on rank 1 of 2; aborting the job"):
    """Algorithm ``name`` whose gradient is NaN on rank 1: the job ends, naming rank 1 (``aborting``: who ends it)."""
    body = f"""
        topo = mpiopt.Topology()
        alg = mpiopt.create("{name}", topo, lr=0.1{settings})
        alg.setup(params)
        if rank == 1:
            grad[2] = np.nan
        for step in range(3):
            try:
                alg.step(params, grad)
            except FloatingPointError:
                grad[2] = 0.0
        alg.finish(params)  # DaSGD's averaging is nonblocking: completing it waits for rank 1, as a training loop would
        """
    return body, [f"FloatingPointError: {name}: non-finite gradient on rank 1 at step 1", f"{aborting}: its other ranks may be waiting"]


SCRIPTS = {
    # sgd checks the sum in its update's pass: every rank holds the non-finite sum, learns whose gradient it was
    # and ends the job naming rank 1, whichever rank's abort comes first.
    "nan_gradient": _nan_gradient("sgd", "", aborting="aborting the job"),
    # DaSGD checks the gradient inside its update's pass (nan_policy="raise"): the rank that had it still ends the job.
    "nan_gradient_checked_in_the_update": _nan_gradient("dasgd", ", period=2"),
    "lsgd_without_loss": (
        """
        topo = mpiopt.Topology()
        alg = mpiopt.create("lsgd", topo, period=1, global_period=1)
        alg.setup(params)
        for step in range(3):
            try:
                alg.step(params, grad, loss=None if rank == 1 and step == 0 else 1.0)
            except ValueError:
                pass
        """,
        ["ValueError: lsgd: step() needs this rank's training loss", "on rank 1 of 2; aborting the job: its other ranks may be waiting"],
    ),
    "bad_group_size_variable": (
        """
        if rank == 1:
            os.environ["MPIOPT_GROUP_SIZE"] = "two"
        try:
            topo = mpiopt.Topology()
        except ValueError as err:
            print(f"rank {rank} raised {type(err).__name__}", flush=True)
            raise
        """,
        [
            "rank 0 raised SetupMismatchError",
            "rank 1 raised SetupMismatchError",
            "MPIOPT_GROUP_SIZE must be a positive integer, got 'two'",
        ],
    ),
    "setup_failing": (
        """
        alg = failing("sgd")(mpiopt.Topology(), lr=0.1)
        try:
            alg.setup(params)
        except Exception as err:
            print(f"rank {rank} raised {type(err).__name__}", flush=True)
            raise
        """,
        ["rank 0 raised OtherRankError", "rank 1 raised MemoryError", "deliberate allocation failure on rank 1"],
    ),
    # EASGD's set-up ends with an Allreduce that rank 1 never joins: rank 0 never
    # reaches the vote, so rank 1 gives up waiting for it and aborts.
    "setup_failing_before_a_collective": (
        """
        alg = failing("easgd")(mpiopt.Topology(), lr=0.1)
        try:
            alg.setup(params)
        except MemoryError:
            pass
        """,
        [
            "MemoryError: deliberate allocation failure on rank 1",
            f"on rank 1 of 2; aborting the job: the other ranks did not come to the easgd set-up check within {VOTE_SECONDS:g} s",
            'raise MemoryError("deliberate allocation failure on rank 1")',
        ],
    ),
}


@pytest.mark.parametrize("name", sorted(SCRIPTS))
def test_one_rank_failure_ends_the_job(tmp_path, name):
    body, expected = SCRIPTS[name]
    script = tmp_path / f"{name}.py"
    script.write_text(PREAMBLE + textwrap.dedent(body) + '\nprint(f"rank {rank} finished", flush=True)\n')
    code, output, seconds = run_mpi(2, [str(script)], timeout=60, env={"MPIOPT_ABORT_ON_ERROR": "", "MPIOPT_GROUP_SIZE": ""})
    assert code != 0, output
    assert seconds < 30, f"took {seconds:.1f} s:\n{output}"
    for text in expected:
        assert text in output, f"{text!r} missing from:\n{output}"
    assert "rank 0 finished" not in output, output
