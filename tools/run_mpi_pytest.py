"""Run pytest on every rank of an MPI job, with readable output.

Usage: ``mpiexec -n N python tools/run_mpi_pytest.py [pytest args]``.  Rank 0
reports on the terminal; the other ranks write to ``$MPIOPT_TEST_LOGDIR/
rank<r>.log`` (default: a temporary folder) and print the tail of their log
to stderr if their pytest run fails, so a failure on rank 3 is never silent.
"""

from __future__ import annotations

import os
import sys
import tempfile

import pytest
from mpi4py import MPI


def main() -> int:
    rank, size = MPI.COMM_WORLD.Get_rank(), MPI.COMM_WORLD.Get_size()
    args = ["--with-mpi", "-p", "no:cacheprovider"] + sys.argv[1:]
    if rank == 0:
        return int(pytest.main(args))
    logdir = os.environ.get("MPIOPT_TEST_LOGDIR") or tempfile.gettempdir()
    path = os.path.join(logdir, f"rank{rank}of{size}.log")
    # Keep only rank 0's JUnit report: every rank runs the same tests.
    args = [a for a in args if not a.startswith("--junitxml")] + ["-q"]
    with open(path, "w") as log:
        os.dup2(log.fileno(), 1)
        sys.stdout = os.fdopen(os.dup(1), "w", buffering=1)
        code = int(pytest.main(args))
        sys.stdout.flush()
    if code not in (0, 5):
        with open(path) as log:
            tail = log.read()[-6000:]
        sys.stderr.write(f"\n===== rank {rank} of {size}: pytest exit {code}; its log ({path}) ends:\n{tail}\n")
    return code


if __name__ == "__main__":
    sys.exit(main())
