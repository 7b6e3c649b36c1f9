"""Asynchronous training on MPI: a parameter server, and a deterministic twin for experiments.

Two drivers run the same two callbacks:

- ``worker_fn(params, step, out) -> loss`` computes a payload (a stochastic
  gradient) for a copy of the parameters that may be stale;
- ``apply(params, payload, arrival)`` is the update, run where the
  parameters live, once per payload, in arrival order.

:func:`run_async` runs them on MPI; :func:`simulate` in one process with a
fixed or random delay (:class:`FixedDelay`, :class:`RandomDelay`), for
reproducible experiments and tests.  An algorithm supplies ``apply`` (e.g.
:class:`~mpiopt.algorithms.async_msgd.AsyncMSGD`), so its update rule is one
function whichever driver runs it.

Design of the runtime
---------------------
World rank 0 is a parameter server; ranks 1..P-1 are workers.  The server
owns ``x`` and its version ``k`` (the number of updates applied).

worker
    Holds the latest parameters it was sent and their version ``v``.  It
    computes a payload on them, posts a receive for the reply, sends the
    payload stamped with ``v`` (``Isend``) and polls both requests.  It
    waits only for the server's answer to its own message, never for another
    worker; a slow worker slows nobody else.
server
    Keeps one receive posted per worker and polls them (round robin, from
    after the last one served; ``Comm`` has no ``Waitany``).  For each
    arrival it applies the payload at once, ``x <- apply(x, g)``, records the
    staleness ``k - v`` (updates applied since the worker's copy was made),
    bumps ``k``, and answers that worker alone with ``(x, k)``; then it
    re-posts that worker's receive.
messages
    One buffer per message: a 32-byte header (kind, version, sequence number,
    loss) and the payload (:mod:`~mpiopt.asyncrt.messages`); every message has
    the parameters' size, so each posted receive gets exactly the bytes the
    ledger books for it.  Everything goes through :class:`~mpiopt.comm.Comm`
    (``Irecv``/``Isend``/``Bcast``/``bcast_obj`` on the world communicator).
start
    ``Bcast`` of the server's ``x_0`` (version 0) to every worker.
shutdown
    A worker's last payload is flagged LAST (a worker with no steps sends a
    bare LAST).  The server applies it like any other but does not answer
    yet.  With ``until`` (a stopping rule checked after each update) every
    later message is treated as a worker's last, so the payloads in flight
    are still applied.  When every worker's last message has been applied,
    the server answers each of them STOP, carrying the final parameters, and
    broadcasts the run's record (version, staleness histogram, updates
    applied per rank).  So every message gets exactly one reply, every
    payload sent is applied exactly once (the server checks the sequence
    numbers), every rank ends with bitwise identical parameters, and no
    receive is left posted.  A worker that finished early waits for its STOP
    by polling, not in a spinning collective.
failure
    An exception on any rank (a non-finite gradient on the server, say)
    leaves the others polling for a message that never comes, as any MPI
    program would: run under :func:`mpiopt.abort_on_exception`, which ends
    the job.
idle ranks
    A waiting rank polls ``Request.Test`` (which drives MPI progress) and,
    after 0.1 ms without news, sleeps between polls with a doubling pause up
    to ``max_sleep`` (default 1 ms): ranks are often oversubscribed on one
    machine, and MPICH's blocking waits spin on a core that a worker needs.
    The time spent so is ``AsyncResult.idle_seconds`` (the ledger's wait
    time covers only blocking ``Wait`` calls).

Why a server: the update rule of Async-MSGD (ALGORITHMS.md) is defined on one
sequence of iterates ``x_k``, each update made with a gradient computed at
some earlier ``x_{k - tau_k}``; a single owner of ``x`` gives exactly that
sequence, measurable staleness, and needs only point-to-point messages that
every MPI implements well (one-sided MPI would need passive-target locks and
atomics over the whole buffer to get the same sequence).  The price: the
server computes no gradients, and its link carries ``2 x 4d`` bytes per
update, so it is the bottleneck at large P (a sharded server would spread
it; not needed at the scales tested here).

At one rank the runtime degenerates to :func:`simulate` with delay 0: the
rank computes and applies in turn, staleness 0.
"""

from .messages import SERVER, Message
from .result import ApplyFn, Arrival, AsyncResult, UntilFn, WorkerFn
from .runtime import DEFAULT_MAX_SLEEP, Poller, run_async
from .simulate import FixedDelay, RandomDelay, simulate

__all__ = [
    "run_async",
    "simulate",
    "FixedDelay",
    "RandomDelay",
    "Arrival",
    "AsyncResult",
    "ApplyFn",
    "WorkerFn",
    "UntilFn",
    "SERVER",
    "Poller",
    "Message",
    "DEFAULT_MAX_SLEEP",
]
