"""Leaving MPI after a lost rank, or with processes a respawn joined (docs/failures.md).

Open MPI's finalize may wait for good after a rank was lost, and crashes on communicators that still span the
processes of a join: :func:`finalize_at_exit` frees those, closes the joins' links and finalizes under a watchdog.
A process the watchdog ends leaves with the status Python would have given it (:func:`exit_status`).
"""

from __future__ import annotations

import atexit
import ctypes
import os
import signal
import sys
import threading
import weakref
from typing import Any, NoReturn

from mpi4py import MPI

from .joining import JOINS, disconnect

__all__ = ["FINALIZE_SECONDS", "JOINED", "exit_status", "finalize_at_exit"]

#: How long a survivor of a lost rank lets MPI_Finalize take before it leaves without it.
FINALIZE_SECONDS = float(os.environ.get("MPIOPT_FINALIZE_SECONDS", "10"))
#: The topologies rebuilt with processes a respawn started (:meth:`Topology.recover`), freed as MPI finalizes.
JOINED: "weakref.WeakSet[Any]" = weakref.WeakSet()
#: The argument of this process's last ``sys.exit`` call, once :func:`finalize_at_exit` has wrapped it.
_EXIT: list = []
_python_exit = sys.exit


def _recording_exit(status: object = None) -> NoReturn:
    """``sys.exit``, remembering ``status``: Python keeps it out of reach of the exit handlers that finalize MPI."""
    _EXIT[:] = [status]
    _python_exit(status)


def exit_status() -> int:
    """The status this process is leaving with, as Python would set it: 1 for an uncaught exception (128 + SIGINT for
    ``KeyboardInterrupt``), else the last ``sys.exit`` call's (0 for none, an int as it is, any other value 1), else 0.

    A ``SystemExit`` raised other than through ``sys.exit`` as :func:`finalize_at_exit` left it (``raise
    SystemExit(3)``, an ``exit`` imported from ``sys`` before, ``sys.exit(main())``, whose ``sys.exit`` is read before
    ``main()`` runs) is not seen: it counts as 0.
    """
    uncaught = getattr(sys, "last_value", None)
    if uncaught is not None:
        return 128 + signal.SIGINT if isinstance(uncaught, KeyboardInterrupt) else 1
    status = _EXIT[0] if _EXIT else None
    if status is None:
        return 0
    return status if isinstance(status, int) else 1


def _finalize() -> None:
    """Finalize MPI, leaving the process after :data:`FINALIZE_SECONDS` if that has not returned: after a rank was
    lost, Open MPI's finalize at times waits for good in a fence that counts the dead rank (open-mpi/ompi#11404).

    The call goes through ctypes, which lets go of the interpreter lock that mpi4py's ``Finalize`` holds, so that
    the watchdog thread can run.
    """
    if MPI.Is_finalized():
        return

    def leave() -> None:
        status = exit_status()
        print(f"mpiopt: MPI_Finalize has not returned in {FINALIZE_SECONDS:g} s after a lost rank: leaving without it, "
              f"with exit status {status}", file=sys.stderr, flush=True)
        sys.stdout.flush()
        os._exit(status)

    watchdog = threading.Timer(FINALIZE_SECONDS, leave)
    watchdog.daemon = True
    watchdog.start()
    if JOINS:  # a respawn's: the communicators over the joined world go first (finalize crashes on them), then the links
        for topology in list(JOINED):
            topology.Free()
        for link in JOINS:
            try:
                disconnect([link])  # collective over both sides
            except MPI.Exception:  # a side lost since: the next link, and finalize, go on; the watchdog bounds them
                pass
        JOINS.clear()
    _mpi_finalize()
    watchdog.cancel()


def _mpi_finalize() -> None:
    """``MPI_Finalize`` through ctypes where the library is found, else mpi4py's."""
    with open("/proc/self/maps") as maps:
        library = next((p for p in maps.read().split() if os.path.basename(p).startswith("libmpi.so")), None)
    if library is None:
        MPI.Finalize()
    else:
        ctypes.CDLL(library, mode=os.RTLD_NOLOAD).MPI_Finalize()


def finalize_at_exit() -> None:
    """Finalize MPI with a watchdog (:func:`_finalize`) while Python runs its exit handlers, before mpi4py's own;
    wrap ``sys.exit`` so that the watchdog knows the status to leave with."""
    if not getattr(finalize_at_exit, "registered", False):
        atexit.register(_finalize)
        sys.exit = _recording_exit
        finalize_at_exit.registered = True  # type: ignore[attr-defined]
