"""The real runtime: a parameter server (world rank 0) and workers that never wait for each other.

See the package docstring (:mod:`mpiopt.asyncrt`) for the design and the
shutdown protocol; this module is the code.
"""

from __future__ import annotations

import time
from collections import Counter
from typing import List, Optional, Sequence, Tuple

import numpy as np

from ..comm import Comm, Request
from .messages import GRADIENT, LAST, PARAMS, SERVER, STOP, TAG_REPLY, TAG_UPDATE, Message
from .result import ApplyFn, Arrival, AsyncResult, UntilFn, WorkerFn, check_run_arguments, staleness_counts
from .simulate import simulate

__all__ = ["Poller", "run_async", "DEFAULT_MAX_SLEEP"]

#: Longest pause between two polls of an idle rank (seconds).
DEFAULT_MAX_SLEEP = 1e-3
# Poll without sleeping this long first: a reply usually comes within microseconds.
_SPIN_SECONDS = 1e-4
_FIRST_SLEEP = 1e-5


class Poller:
    """Wait for one of several requests by polling ``Request.Test`` (``Comm`` has no Waitany).

    Polling drives MPI progress; when nothing completes for
    ``_SPIN_SECONDS`` the poller sleeps between sweeps, doubling the pause up
    to ``max_sleep``, so that an idle rank leaves the core to a busy one (ranks
    are often oversubscribed on one machine, and MPICH's blocking waits spin).
    Completed requests are served in turn, starting after the last one
    served, so a fast sender cannot starve the others.

    Parameters
    ----------
    max_sleep : float
        Longest pause in seconds (0: never sleep).

    Attributes
    ----------
    idle_seconds : float
        Total time spent in :meth:`wait_any` and :meth:`wait_all`.
    """

    def __init__(self, max_sleep: float = DEFAULT_MAX_SLEEP) -> None:
        if not max_sleep >= 0:
            raise ValueError(f"max_sleep must be >= 0 seconds, got {max_sleep!r}")
        self.max_sleep = float(max_sleep)
        self.idle_seconds = 0.0
        self._next = 0

    def wait_any(self, requests: Sequence[Optional[Request]]) -> int:
        """Index of a completed request (None entries are skipped); blocks until one completes."""
        if all(r is None for r in requests):
            raise ValueError("wait_any needs at least one request")
        started = time.perf_counter()
        spin_until = started + _SPIN_SECONDS
        pause = min(_FIRST_SLEEP, self.max_sleep)
        n = len(requests)
        while True:
            for i in range(n):
                j = (self._next + i) % n
                request = requests[j]
                if request is not None and request.Test():
                    self._next = (j + 1) % n
                    self.idle_seconds += time.perf_counter() - started
                    return j
            if self.max_sleep and time.perf_counter() > spin_until:
                time.sleep(pause)
                pause = min(2 * pause, self.max_sleep)

    def wait_all(self, requests: Sequence[Optional[Request]]) -> None:
        """Block until every request (None entries skipped) has completed."""
        pending: List[Optional[Request]] = list(requests)
        while any(r is not None for r in pending):
            pending[self.wait_any(pending)] = None


def run_async(
    world: Comm,
    params: np.ndarray,
    apply: ApplyFn,
    worker_fn: WorkerFn,
    steps: int,
    *,
    until: Optional[UntilFn] = None,
    max_sleep: float = DEFAULT_MAX_SLEEP,
) -> AsyncResult:
    """Train asynchronously: rank 0 serves, the other ranks compute payloads.

    A collective call (every rank of ``world`` calls it).

    Parameters
    ----------
    world : Comm
        The communicator (``topology.world``); its rank 0 is the server.
    params : numpy.ndarray
        Flat float parameters.  The server's are ``x_0`` (sent to every
        worker at the start); on return every rank holds the final
        parameters, bitwise identical.
    apply : callable
        ``apply(params, payload, arrival)``: the update, run on the server
        for every payload in arrival order.
    worker_fn : callable
        ``worker_fn(params, step, out) -> loss``: a worker's payload for its
        (possibly stale, read-only) copy of the parameters, into ``out``.
    steps : int
        Payloads this rank computes (each rank may pass its own number; the
        server's is ignored when there are workers).
    until : callable, optional
        ``until(params, version) -> bool``, checked by the server after each
        update; once True, every worker is stopped after its message in flight.
    max_sleep : float
        See :class:`Poller`.

    Returns
    -------
    AsyncResult
        The staleness histogram and per-worker counts (the same on every rank).

    Notes
    -----
    At one rank there is nobody to wait for: the rank computes and applies in
    turn, which is :func:`~mpiopt.asyncrt.simulate` with delay 0 (staleness 0
    throughout).
    """
    check_run_arguments(params, steps)
    world.agree({"num_params": int(params.size), "dtype": str(params.dtype)}, what="asynchronous run")
    if world.size == 1:
        return simulate(params, apply, worker_fn, steps, until=until)
    poller = Poller(max_sleep)
    world.Bcast(params, root=SERVER)
    if world.rank == SERVER:
        version, histogram, applied, stopped = _serve(world, params, apply, until, poller)
        sent = 0
        summary = (version, staleness_counts(histogram).tolist(), applied, stopped)
    else:
        sent = _work(world, params, worker_fn, steps, poller)
        summary = None
    version, counts, applied, stopped = world.bcast_obj(summary, root=SERVER)
    return AsyncResult(
        version=version,
        staleness=np.asarray(counts, dtype=np.int64),
        applied=np.asarray(applied, dtype=np.int64),
        sent=sent,
        stopped_early=stopped,
        idle_seconds=poller.idle_seconds,
    )


def _serve(
    world: Comm, params: np.ndarray, apply: ApplyFn, until: Optional[UntilFn], poller: Poller
) -> Tuple[int, Counter, List[int], bool]:
    """The server loop: apply every payload as it arrives, answer its sender at once.

    Every worker message gets exactly one reply: PARAMS at once while
    training goes on; STOP with the final parameters, after the loop, to a
    worker's last message (LAST, or any message once ``until`` has fired).
    """
    size = world.size
    # Indexed by world rank; entry 0 (the server) is never used.
    inbox = [Message(params.size, params.dtype) if w != SERVER else None for w in range(size)]
    outbox = [Message(params.size, params.dtype) if w != SERVER else None for w in range(size)]
    receives: List[Optional[Request]] = [None] + [world.Irecv(inbox[w].buffer, w, TAG_UPDATE) for w in range(1, size)]
    sends: List[Optional[Request]] = [None] * size
    received = [0] * size
    applied = [0] * size
    histogram: Counter = Counter()
    version = 0
    stopping = False  # ``until`` has fired
    cut_short = False  # some worker was stopped before its last message
    active = size - 1
    while active:
        w = poller.wait_any(receives)
        message = inbox[w]
        received[w] += 1
        if message.sequence != received[w]:
            raise RuntimeError(f"asynchronous server: message {message.sequence} from rank {w}, expected {received[w]}")
        if message.kind & GRADIENT:
            staleness = version - message.version
            apply(params, message.payload, Arrival(w, message.sequence - 1, message.version, staleness, message.loss))
            version += 1
            histogram[staleness] += 1
            applied[w] += 1
            stopping = stopping or (until is not None and bool(until(params, version)))
        if message.kind & LAST or stopping:
            cut_short = cut_short or not message.kind & LAST
            receives[w] = None  # its STOP goes out after the loop
            active -= 1
            continue
        receives[w] = world.Irecv(message.buffer, w, TAG_UPDATE)
        if sends[w] is not None:
            sends[w].Wait()  # complete already: the worker sent a message after receiving it
        outbox[w].stamp(PARAMS, version)
        outbox[w].payload[...] = params
        sends[w] = world.Isend(outbox[w].buffer, w, TAG_REPLY)
    # Every payload is applied: the final parameters go to all workers (concurrent
    # sends of one buffer are allowed since MPI-3).
    final = Message(params.size, params.dtype)
    final.stamp(STOP, version)
    final.payload[...] = params
    poller.wait_all(sends + [world.Isend(final.buffer, w, TAG_REPLY) for w in range(1, size)])
    return version, histogram, applied, cut_short


def _work(world: Comm, params: np.ndarray, worker_fn: WorkerFn, steps: int, poller: Poller) -> int:
    """A worker: compute a payload on the latest parameters it has, send it, take the reply; repeat.

    Ends on STOP with the final parameters in ``params``; returns the number
    of payloads sent.
    """
    update = Message(params.size, params.dtype)
    reply = Message(params.size, params.dtype)
    reply.payload[...] = params
    version = 0
    sent = 0
    while True:
        if sent < steps:
            loss = worker_fn(reply.payload, sent, update.payload)
            update.stamp(GRADIENT | (LAST if sent + 1 == steps else 0), version, sent + 1, loss)
        else:  # no steps at all: say goodbye without a payload
            update.stamp(LAST, version, 1)
        # Post the receive for the reply before sending, so it has somewhere to land.
        receive = world.Irecv(reply.buffer, SERVER, TAG_REPLY)
        send = world.Isend(update.buffer, SERVER, TAG_UPDATE)
        poller.wait_all([receive, send])
        sent += bool(update.kind & GRADIENT)
        if reply.kind & STOP:
            params[...] = reply.payload
            return sent
        version = reply.version
