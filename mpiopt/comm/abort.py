"""Turn an uncaught exception on any rank into an abort of the whole job.

Without this, one rank dies while the others wait forever in their next
collective.  :func:`abort_on_exception` installs hooks that print the
traceback (with the rank) and call ``MPI.COMM_WORLD.Abort(1)``, which makes
the launcher (mpiexec, srun) end every rank with a non-zero exit code.
"""

from __future__ import annotations

import sys
import threading
import time
import traceback
from types import TracebackType
from typing import Optional, Type

__all__ = ["abort_on_exception", "abort_job"]

_installed = False
ABORT_GRACE_SECONDS = 1.0


def abort_job(message: str, code: int = 1) -> None:
    """Print ``message`` to stderr and abort every rank of ``MPI.COMM_WORLD``."""
    from mpi4py import MPI

    sys.stderr.write(message)
    sys.stderr.flush()
    sys.stdout.flush()
    # The launcher forwards our output through pipes and stops forwarding
    # once it kills the job: give it a moment to deliver the traceback.
    time.sleep(ABORT_GRACE_SECONDS)
    MPI.COMM_WORLD.Abort(code)


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


def abort_on_exception() -> None:
    """Install the abort hooks for the main thread and all other threads (idempotent)."""
    global _installed
    if not _installed:
        sys.excepthook = _hook
        threading.excepthook = _thread_hook
        _installed = True
