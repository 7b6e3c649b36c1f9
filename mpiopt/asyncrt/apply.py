"""``run_async``: the runtime with the simplest policy, apply every payload where the parameters live (Async-MSGD)."""

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
from .runtime import DEFAULT_MAX_SLEEP, Link, Policy, Survivors, run_policy

__all__ = ["run_async", "ApplyPolicy"]


class ApplyPolicy(Policy):
    """Apply each payload at once and answer its sender with the new parameters and their version.

    ``version`` and ``applied_before`` (per world rank, payloads applied by earlier runs) continue earlier runs.
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
    """A worker: compute a payload on its latest parameters, send it, take the reply; at STOP, the final parameters."""
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
    survivors: Optional[Survivors] = None,
) -> AsyncResult:
    """Train asynchronously (collective): rank 0 serves ``apply(params, payload, arrival)``, the others compute payloads.

    Parameters
    ----------
    params : numpy.ndarray
        Flat float parameters; the server's are ``x_0``.  On return every rank holds the final ones, bitwise equal.
    worker_fn : callable
        ``worker_fn(params, step, out) -> loss``: a payload for a (possibly stale, read-only) copy, into ``out``.
    steps : int
        Payloads this rank computes (each rank may pass its own).
    until : callable, optional
        ``until(params, version) -> bool`` after each update; True stops every worker after its message in flight.
    version, applied_before
        To continue earlier runs (docs/internals-asyncrt.md); every rank passes the same.
    survivors : callable, optional
        With survival on: the server drops a lost worker, and ``survivors()`` shrinks the world at the end
        (:func:`~mpiopt.asyncrt.runtime.run_policy`).  The counts stay numbered as the run's world.

    Raises
    ------
    TypeError, ValueError
        On every rank, when any rank's ``params`` or ``steps`` is bad.
    SetupMismatchError
        On every rank, when ranks disagree on the parameters' size or type, ``version`` or ``applied_before``.
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
    outcome = run_policy(world, policy, work, params, max_sleep=max_sleep, survivors=survivors)
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
