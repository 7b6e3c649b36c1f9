"""The MPI test harness never hangs: collective verdicts, aborts and per-test time limits."""

from __future__ import annotations

from .launch import run_mpi

SAMPLES = "tests/e2e/samples/mpi_failures.py"
HARNESS = "tools/run_mpi_pytest.py"


def run_sample(test: str, *extra: str):
    return run_mpi(
        2, [HARNESS, f"{SAMPLES}::{test}", *extra], timeout=90,
        env={"MPIOPT_TEST_VERDICT_DEADLINE": "3"},
    )


def test_failure_on_one_rank_fails_every_rank():
    code, output, _ = run_sample("test_fails_on_rank_one_only")
    assert code != 0
    assert "failed on rank(s) [1]" in output, output  # rank 0's verdict
    assert "rank one disagrees" in output, output  # rank 1's own log, echoed


def test_rank_stuck_in_a_collective_is_aborted_with_the_test_name():
    code, output, seconds = run_sample("test_rank_one_fails_before_a_collective")
    assert code != 0 and seconds < 60, output
    assert "test_rank_one_fails_before_a_collective: rank 1 of 2 waited" in output, output
    assert "rank one gave up early" in output, output


def test_deadlock_everywhere_hits_the_time_limit():
    code, output, seconds = run_sample("test_everyone_deadlocks", "--timeout", "3")
    assert code != 0 and seconds < 60, output
    assert "+++ Timeout +++ tests/e2e/samples/mpi_failures.py::test_everyone_deadlocks ran past its 3 s limit" in output, output
    assert "in test_everyone_deadlocks" in output, output  # the stack dump
