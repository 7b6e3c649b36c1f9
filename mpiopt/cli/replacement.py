"""The program of a process started for a lost rank (``--on-failure respawn``, :mod:`.respawn`): join the survivors,
train with them to the end, report as they do.  Started by the survivors, never by hand."""

from __future__ import annotations

import sys

from ..comm.joining import started_by_survivors


def main() -> int:
    if not started_by_survivors():
        print("mpiopt.cli.replacement is started by the survivors of mpiopt train or compare (--on-failure respawn), not by hand", file=sys.stderr)
        return 2
    from .respawn import join_survivors

    plan, session = join_survivors()
    return plan.go_on(session)


if __name__ == "__main__":
    status = main()
    sys.exit(status)  # looked up after main(), as in mpiopt/__main__.py
