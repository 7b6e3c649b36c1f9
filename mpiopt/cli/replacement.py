"""The program of a process started for a lost rank (``--on-failure respawn``, :mod:`.respawn`): join the survivors,
train with them to the end, report as they do.  Started by the survivors, never by hand."""

from __future__ import annotations

import sys

from mpi4py import MPI


def main() -> int:
    if MPI.Comm.Get_parent() == MPI.COMM_NULL:
        print("mpiopt.cli.replacement is started by mpiopt train's survivors (--on-failure respawn), not by hand", file=sys.stderr)
        return 2
    from .respawn import join_survivors
    from .train import train_to_the_end

    config, session = join_survivors()
    return train_to_the_end(config, session)


if __name__ == "__main__":
    sys.exit(main())
