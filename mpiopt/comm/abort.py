"""Never hang: an error on one rank ends the job or is raised on every rank (docs/internals-comm.md, "Never hang")."""

from __future__ import annotations

import os
import sys
import threading
import time
import traceback
from types import TracebackType
from typing import NoReturn, Optional, Type

__all__ = ["abort_on_exception", "abort_job", "OtherRankError", "ABORT_ENV"]

#: Environment variable read by :class:`~mpiopt.comm.Topology` when
#: ``abort_on_error`` is not given: ``0`` (or false/no/off) opts out of the
#: abort hooks, ``1`` (true/yes/on) or unset keeps them.
ABORT_ENV = "MPIOPT_ABORT_ON_ERROR"
ABORT_GRACE_SECONDS = 1.0


class OtherRankError(RuntimeError):
    """Raised on the ranks that did not fail when a collective check found an error on another rank."""


def abort_job(message: str, code: int = 1) -> NoReturn:
    """Print ``message`` to stderr, abort every rank of ``MPI.COMM_WORLD`` and end this process (never returns)."""
    from mpi4py import MPI

    sys.stderr.write(message)
    sys.stderr.flush()
    sys.stdout.flush()
    # The launcher forwards our output through pipes and stops forwarding
    # once it kills the job: give it a moment to deliver the traceback.
    time.sleep(ABORT_GRACE_SECONDS)
    MPI.COMM_WORLD.Abort(code)
    # MPI_Abort may return before the launcher ends this process (MPICH 5 does, now and then): a caller that
    # catches the error must not go on, into collectives the other ranks will never join.
    os._exit(code)


def _hook(exc_type: Type[BaseException], exc: BaseException, tb: Optional[TracebackType]) -> None:
    from mpi4py import MPI

    if issubclass(exc_type, KeyboardInterrupt) or (issubclass(exc_type, SystemExit) and exc.code in (0, None)):
        sys.__excepthook__(exc_type, exc, tb)
        return
    rank, size = MPI.COMM_WORLD.Get_rank(), MPI.COMM_WORLD.Get_size()
    text = "".join(traceback.format_exception(exc_type, exc, tb))
    abort_job(f"mpiopt: uncaught exception on rank {rank} of {size}; aborting the job\n{text}")


def _thread_hook(args: threading.ExceptHookArgs) -> None:
    _hook(args.exc_type, args.exc_value or args.exc_type(), args.exc_traceback)


def abort_on_exception(*, override: bool = True) -> None:
    """Install hooks that print an uncaught exception with its rank and abort the job, in every thread (idempotent).

    ``override=False`` leaves a hook other than Python's default in place (what :class:`Topology` does, so pytest
    keeps its report of an exception in a thread).
    """
    if override or sys.excepthook is sys.__excepthook__:
        sys.excepthook = _hook
    if override or threading.excepthook is threading.__excepthook__:
        threading.excepthook = _thread_hook
