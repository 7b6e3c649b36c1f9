"""The asynchronous runtime: world rank 0 serves with the algorithm's :class:`Policy`, ranks 1..P-1 work.

Every asynchronous algorithm runs on it; the runtime moves messages, checks that none is lost or handled
twice, polls without spinning and ends the run so that no rank hangs.  The one-process twin with a chosen
delay is :func:`mpiopt.asyncrt.simulated.simulate`.

Design: docs/async.md; adding an algorithm, wire format, state between runs: docs/internals-asyncrt.md.
"""

from .apply import ApplyPolicy, run_async
from .messages import GRADIENT, LAST, PARAMS, SERVER, STOP, UPLOAD, Message, Reply
from .result import ApplyFn, Arrival, AsyncResult, UntilFn, WorkerFn, agree_on_arguments, check_run_arguments
from .runtime import DEFAULT_MAX_SLEEP, Link, LocalLink, MPILink, Outcome, Policy, Poller, ServerLost, Survivors, run_policy

__all__ = [
    "run_async",
    "run_policy",
    "Policy",
    "ApplyPolicy",
    "Link",
    "MPILink",
    "LocalLink",
    "Outcome",
    "Reply",
    "Message",
    "Arrival",
    "AsyncResult",
    "ApplyFn",
    "WorkerFn",
    "UntilFn",
    "Poller",
    "ServerLost",
    "Survivors",
    "SERVER",
    "GRADIENT",
    "LAST",
    "PARAMS",
    "STOP",
    "UPLOAD",
    "DEFAULT_MAX_SLEEP",
    "agree_on_arguments",
    "check_run_arguments",
]
