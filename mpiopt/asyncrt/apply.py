"""``run_async``: the runtime with the simplest policy, apply every payload where the parameters live.

An algorithm that is an update rule alone (Async-MSGD) needs nothing more:
its ``apply(params, payload, arrival)`` runs on the server for each
gradient, in arrival order, and each worker computes on the latest
parameters it was sent.
"""

from __future__ import annotations

from collections import Counter
from functools import partial
from typing import List, Optional, Sequence, Tuple

import numpy as np

from ..comm import Comm
from .messages import GRADIENT, LAST, PARAMS, SERVER, STOP, Message, Reply
from .result import (
    ApplyFn,
    Arrival,
    AsyncResult,
    UntilFn,
    WorkerFn,
    agree_on_arguments,
    check_count,
    check_run_arguments,
    staleness_counts,
)
from .runtime import DEFAULT_MAX_SLEEP, Link, Policy, run_policy

__all__ = ["run_async", "ApplyPolicy"]


class ApplyPolicy(Policy):
    """Apply each payload at once and answer its sender with the new parameters and their version.

    Parameters
    ----------
    params : numpy.ndarray
        The server's parameters, updated in place.
    apply : callable
        ``apply(params, payload, arrival)``.
    until : callable, optional
        ``until(params, version) -> bool`` after each update; True ends every worker's run.
    size : int
        World size (the record counts updates per rank).
    version : int
        The version of ``params``: the server's counter runs on from it.
    applied_before : sequence of int, optional
        Per world rank, its payloads applied by the runs this one continues:
        an arrival's ``step`` counts on from it.
    """

    def __init__(
        self,
        params: np.ndarray,
        apply: ApplyFn,
        until: Optional[UntilFn],
        size: int,
        version: int = 0,
        applied_before: Optional[Sequence[int]] = None,
    ) -> None:
        self.params, self.apply, self.until = params, apply, until
        self.version = version  # updates applied, this run's and the earlier runs' it continues
        self.before = [0] * size if applied_before is None else list(applied_before)
        self.histogram: Counter = Counter()
        self.applied = [0] * size

    def receive(self, worker: int, message: Message) -> Optional[Reply]:
        if message.kind & GRADIENT:
            staleness = self.version - message.version
            step = self.before[worker] + message.sequence - 1
            arrival = Arrival(worker, step, message.version, staleness, message.loss)
            self.apply(self.params, message.payload, arrival)
            self.version += 1
            self.histogram[staleness] += 1
            self.applied[worker] += 1
            self.stopping = self.stopping or (self.until is not None and bool(self.until(self.params, self.version)))
        return Reply(PARAMS, self.version, (self.params,))

    def stop(self) -> Reply:
        return Reply(STOP, self.version, (self.params,))  # every worker ends with the final parameters

    def record(self) -> Tuple[int, List[int], List[int]]:
        return self.version, staleness_counts(self.histogram).tolist(), self.applied


def _compute(params: np.ndarray, worker_fn: WorkerFn, steps: int, first_step: int, version: int, link: Link) -> int:
    """A worker: compute a payload on the latest parameters it has, send it, take the reply; repeat.

    ``params`` start at the server's ``version``; the payloads are numbered
    from ``first_step``.  Ends on STOP with the final parameters in
    ``params``; returns the number of payloads sent.
    """
    current, sent = params, 0
    while True:
        if sent < steps:
            loss = worker_fn(current, first_step + sent, link.payload())
            link.send(GRADIENT | (LAST if sent + 1 == steps else 0), version, loss, copies=1, reply_copies=1)
            sent += 1
        else:  # no steps at all: say goodbye without a payload
            link.send(LAST, version, reply_copies=1)
        reply = link.wait()
        if reply.kind & STOP:
            params[...] = reply.payload
            return sent
        current, version = reply.payload, reply.version


def _check_before(applied_before: Optional[Sequence[int]], size: int) -> None:
    if applied_before is None:
        return
    if len(applied_before) != size:
        raise ValueError(f"applied_before must have one count per world rank ({size}), got {len(applied_before)}")
    for n in applied_before:
        check_count("applied_before entries", n)


def run_async(
    world: Comm,
    params: np.ndarray,
    apply: ApplyFn,
    worker_fn: WorkerFn,
    steps: int,
    *,
    until: Optional[UntilFn] = None,
    max_sleep: float = DEFAULT_MAX_SLEEP,
    version: int = 0,
    applied_before: Optional[Sequence[int]] = None,
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
        (possibly stale, read-only) copy of the parameters, into ``out``;
        ``step`` counts this rank's payloads (from its ``applied_before``).
    steps : int
        Payloads this rank computes (each rank may pass its own number; the
        server's is ignored when there are workers, but checked).
    until : callable, optional
        ``until(params, version) -> bool``, checked by the server after each
        update; once True, every worker is stopped after its message in flight.
    max_sleep : float
        See :class:`~mpiopt.asyncrt.Poller`.
    version : int
        The version of the server's ``params``: 0 for a first run; to
        continue a run, its result's ``version`` (the counter runs on, and
        staleness is measured against it).  Every rank passes the same.
    applied_before : sequence of int, optional
        To continue runs: per world rank, the updates applied from it by
        those runs (their results' ``applied``, summed); each rank's
        payloads, and the arrivals' ``step``, are numbered on from its
        entry.  None: zeros.  Every rank passes the same.

    Returns
    -------
    AsyncResult
        The staleness histogram and per-worker counts (the same on every rank).

    Raises
    ------
    TypeError, ValueError
        On every rank, when any rank's ``params`` or ``steps`` is bad (the
        message names the ranks and values).
    SetupMismatchError
        On every rank, when ranks pass parameters of different sizes or
        types, or different ``version`` or ``applied_before``.

    Notes
    -----
    At one rank there is nobody to wait for: the rank computes and applies in
    turn (staleness 0 throughout), which is
    :func:`mpiopt.asyncrt.simulated.simulate` with delay 0.
    """
    agree_on_arguments(
        world,
        "run_async",
        lambda: (check_run_arguments(params, steps), check_count("version", version), _check_before(applied_before, world.size)),
    )
    before = [0] * world.size if applied_before is None else [int(n) for n in applied_before]
    signature = {"num_params": int(params.size), "dtype": str(params.dtype), "version": int(version), "applied_before": before}
    world.agree(signature, what="asynchronous run")
    if world.size > 1:
        world.Bcast(params, root=SERVER)
    policy = ApplyPolicy(params, apply, until, world.size, int(version), before)
    work = partial(_compute, params, worker_fn, steps, before[world.rank], int(version))
    outcome = run_policy(world, policy, work, params, max_sleep=max_sleep)
    final, counts, applied = outcome.record
    return AsyncResult(
        version=final,
        start_version=int(version),
        staleness=np.asarray(counts, dtype=np.int64),
        applied=np.asarray(applied, dtype=np.int64),
        sent=outcome.local or 0,
        stopped_early=outcome.stopped_early,
        idle_seconds=outcome.idle_seconds,
    )
