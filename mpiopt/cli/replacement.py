"""The program of a process started for a lost rank (``--on-failure respawn``, :mod:`.respawn`): join the survivors,
train with them to the end, report as they do.  Started by the survivors, never by hand."""

from __future__ import annotations

import sys

from mpi4py import MPI


def main() -> int:
    if MPI.Comm.Get_parent() == MPI.COMM_NULL:
        print("mpiopt.cli.replacement is started by the survivors of mpiopt train or compare (--on-failure respawn), not by hand", file=sys.stderr)
        return 2
    from .respawn import join_survivors

    plan, session = join_survivors()
    return plan.go_on(session)


if __name__ == "__main__":
    sys.exit(main())
