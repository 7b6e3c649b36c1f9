"""Leaving MPI after a lost rank, or with processes a respawn joined (docs/failures.md).

Open MPI's finalize may wait for good after a rank was lost, and crashes on communicators that still span the
processes of a join: :func:`finalize_at_exit` frees those, closes the joins' links and finalizes under a watchdog.
"""

from __future__ import annotations

import atexit
import ctypes
import os
import sys
import threading
import weakref
from typing import Any

from mpi4py import MPI

from .joining import JOINS, disconnect

__all__ = ["FINALIZE_SECONDS", "JOINED", "finalize_at_exit"]

#: How long a survivor of a lost rank lets MPI_Finalize take before it leaves without it.
FINALIZE_SECONDS = float(os.environ.get("MPIOPT_FINALIZE_SECONDS", "10"))
#: The topologies rebuilt with processes a respawn started (:meth:`Topology.recover`), freed as MPI finalizes.
JOINED: "weakref.WeakSet[Any]" = weakref.WeakSet()


def _finalize() -> None:
    """Finalize MPI, leaving the process after :data:`FINALIZE_SECONDS` if that has not returned: after a rank was
    lost, Open MPI's finalize at times waits for good in a fence that counts the dead rank (open-mpi/ompi#11404).

    The call goes through ctypes, which lets go of the interpreter lock that mpi4py's ``Finalize`` holds, so that
    the watchdog thread can run.
    """
    if MPI.Is_finalized():
        return

    def leave() -> None:
        print(f"mpiopt: MPI_Finalize has not returned in {FINALIZE_SECONDS:g} s after a lost rank: leaving without it",
              file=sys.stderr, flush=True)
        sys.stdout.flush()
        os._exit(0)

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
    with open("/proc/self/maps") as maps:
        library = next((p for p in maps.read().split() if os.path.basename(p).startswith("libmpi.so")), None)
    if library is None:
        MPI.Finalize()
    else:
        ctypes.CDLL(library, mode=os.RTLD_NOLOAD).MPI_Finalize()
    watchdog.cancel()


def finalize_at_exit() -> None:
    """Finalize MPI with a watchdog (:func:`_finalize`) while Python runs its exit handlers, before mpi4py's own."""
    if not getattr(finalize_at_exit, "registered", False):
        atexit.register(_finalize)
        finalize_at_exit.registered = True  # type: ignore[attr-defined]
