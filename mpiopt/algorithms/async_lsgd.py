"""Asynchronous LSGD: leaders kept by a server, pulls scheduled by the total step count.

Teng et al., "Leader Stochastic Gradient Descent for Distributed Training of Deep Learning Models", NeurIPS 2019,
asynchronous version: workers step at their own pace; world rank 0 keeps the leaders and answers reports.
Notes: docs/algorithm-notes.md.
"""

from __future__ import annotations

import math
import time
from functools import partial
from typing import Any, Callable, Dict, List, Optional, Sequence

import numpy as np

from ..asyncrt import (
    DEFAULT_MAX_SLEEP,
    SERVER,
    Link,
    Message,
    WorkerFn,
    agree_on_arguments,
    check_run_arguments,
    run_policy,
)
from ..arrays import empty_apart
from ..asyncrt.messages import LAST, PULL_GLOBAL, PULL_LOCAL, STOP, UPLOAD
from ..asyncrt.state import ServerStateMixin
from ..comm import Topology
from .async_lsgd_server import GLOBAL, LOCAL, AsyncLSGDResult, LeaderBook
from .base import BASE, AsynchronousAlgorithm
from .lsgd_rule import LSGD_RULE, LSGDRule, LSGDState, Pull
from .schema import Hyperparameter, Schema, check_positive, positive
from .registry import register
from .survival import ServerSurvival

__all__ = ["AsyncLSGD", "AsyncLSGDResult"]


@register
class AsyncLSGD(ServerSurvival, ServerStateMixin, LSGDState, AsynchronousAlgorithm):
    """Asynchronous LSGD (Teng et al. 2019): a server keeps the leaders, workers never wait for each other.

    With ``Topology(on_failure="shrink")`` the server drops a lost worker (its scopes elect again) and the others go
    on; a lost server ends the run (:class:`~mpiopt.asyncrt.ServerLost`).

    Attributes
    ----------
    rule : LSGDRule
        The hyperparameters, the running-mean loss and the local step with
        its pulls (LSGD's).
    pulls_local, pulls_global : int
        Pulls this worker has applied (state; the server's count of the last
        run is in :attr:`AsyncLSGDResult.pulls`).
    last_local_leader, last_global_leader : int
        World rank whose copy this worker's latest local (global) pull went
        towards; -1 before any.  (A worker that leads a scope takes no pull
        in it: see :attr:`AsyncLSGDResult.as_leader`.)  The proximal pull
        goes towards the latest copy received, none before the first.
    """

    name = "async_lsgd"
    listing_order = 80
    schema = BASE.with_defaults(lr=0.1) + Schema(
        Hyperparameter("report_every", 1, positive(integer=True), "a worker's steps between reports of its running loss"),
    ) + LSGD_RULE
    evaluates = "leader"
    state_arrays = ("momentum_buffer", "leader_copy", "recent_losses")
    state_scalars = ("losses_seen", "last_local_leader", "last_global_leader", "pulls_local", "pulls_global")

    def __init__(self, topology: Topology, **hyperparameters: Any) -> None:
        super().__init__(topology, **hyperparameters)
        if self.nan_policy != "raise":
            raise ValueError(
                f"nan_policy must be 'raise' for async_lsgd (skipping is decided collectively, not asynchronously), got {self.nan_policy!r}"
            )
        self.rule = LSGDRule(**LSGD_RULE.pick(self._values))
        self.pulls_local = 0
        self.pulls_global = 0
        self.last_local_leader = -1
        self.last_global_leader = -1
        self._book: Optional[LeaderBook] = None  # the server's (used on world rank 0), from run to run
        self._leader: Optional[np.ndarray] = None  # the latest leader copy received: the proximal pull's target
        self._link: Optional[Link] = None  # while run() drives this worker
        self._reported = 0  # self.steps at the latest report (or LAST)
        self.dropped = []  # the losses its runs survived (ServerSurvival)

    def hyperparameters(self) -> Dict[str, Any]:
        return {**self.rule.hyperparameters(), "report_every": self.report_every}

    def _allocate(self, params: Any) -> None:
        if not isinstance(params, np.ndarray):
            raise TypeError(f"async_lsgd keeps the parameters in host memory: params must be a numpy array, got {type(params).__name__}")
        self.rule.allocate(params)
        self._leader = empty_apart(params, zero=True)
        self._book = LeaderBook(self._workers(), self.period, self.global_period, (self.pull_local > 0, self.pull_global > 0))

    def _workers(self) -> Dict[int, int]:
        """Each worker's world rank -> its group index (collective)."""
        groups = self.topology.world.allgather_obj(self.topology.group_index)
        size = self.topology.size
        return {w: groups[w] for w in (range(1, size) if size > 1 else [0])}

    def _keep_ranks(self, kept: Sequence[int]) -> None:
        new = {old: i for i, old in enumerate(kept)}
        self.last_local_leader = new.get(self.last_local_leader, -1)
        self.last_global_leader = new.get(self.last_global_leader, -1)
        self._book = self._book.renumbered(list(kept), self._workers(), self.period, self.global_period)

    # -- the server's book, beside the base class's state -----------------------------------------
    def _server_state(self) -> Optional[Dict[str, Any]]:
        return self._book.state_dict() if self.topology.rank == SERVER else None

    def _server_loader(self, saved: Any) -> Callable[[], None]:
        if self.topology.rank == SERVER:
            return self._book.loader(saved, self._leader)  # shaped like the parameters
        if saved is not None:
            raise ValueError(f"server state on rank {self.topology.rank}: only world rank {SERVER} keeps the book (state saved on another rank?)")
        return lambda: None

    # -- a worker's step (inside run) ------------------------------------------------------------
    def _step(self, params: Any, grad: Any, loss: Optional[float]) -> None:
        """A worker's local step, in the order of docs/algorithm-notes.md."""
        if loss is None:  # found on this rank alone, in the middle of the run
            self.topology.raise_or_abort(
                ValueError(
                    f"async_lsgd: worker_fn returned no loss on rank {self.topology.rank} at step "
                    f"{self.steps}: the lowest running-mean loss elects the leaders"
                ),
                why="the server would wait for its messages for ever",
            )
        # The reply first: a message to the server always carries the running mean of the steps it counts.
        pulls = self._take(params, self._link.poll())
        self.rule.record_loss(loss)
        self._pull_and_step(params, grad, pulls)
        done = self.steps + 1  # the base class counts this step after _step returns
        if not self._link.awaiting and done - self._reported >= self.report_every:
            self._link.send(0, done, self.rule.running_loss())  # a report: no flag, no payload
            self._reported = done

    def _take(self, params: np.ndarray, reply: Optional[Message]) -> List[Pull]:
        """Act on a reply: upload ``x_t`` if asked; its pulls as ``(coefficient, fetch)``, local first."""
        if reply is None:
            return []
        if reply.kind & UPLOAD:
            self._upload(params, UPLOAD)
        pulls: List[Pull] = []
        for kind, flag, coeff in ((LOCAL, PULL_LOCAL, self.pull_local), (GLOBAL, PULL_GLOBAL, self.pull_global)):
            if not reply.kind & flag:
                continue
            copy = reply.copies[min(len(pulls), reply.carried - 1)]  # one copy serves both when the sources agree
            pulls.append((coeff, lambda copy=copy: copy))
            self._leader = copy  # the proximal pull's target: the latest copy (the global one when both came)
            if kind == LOCAL:
                self.last_local_leader = reply.ranks[kind]
                self.pulls_local += 1
            else:
                self.last_global_leader = reply.ranks[kind]
                self.pulls_global += 1
        return pulls

    def _upload(self, params: np.ndarray, kind: int) -> None:
        """Send ``params`` with the step count and the running-mean loss; only LAST is answered."""
        self._link.payload()[...] = params
        self._link.send(kind, self.steps, self.rule.running_loss(), copies=1, answered=bool(kind & LAST))

    # -- the driver ---------------------------------------------------------------------------
    def run(
        self,
        params: np.ndarray,
        worker_fn: WorkerFn,
        steps: Optional[int] = None,
        *,
        seconds: Optional[float] = None,
        max_sleep: float = DEFAULT_MAX_SLEEP,
    ) -> AsyncLSGDResult:
        """Train asynchronously on every rank of the world (a collective call); the same record on every rank.

        ``worker_fn(params, step, out) -> loss`` writes this worker's gradient at
        ``params`` into ``out`` and returns its loss (it elects the leaders).  A
        worker runs ``steps`` local steps or until ``seconds`` (at least one);
        on the server ``params`` end as the final global leader's.  The run
        continues the server's book and each worker's state (docs/algorithm-notes.md);
        bad arguments on any rank raise on every rank.  With ``on_failure="shrink"``
        a lost worker is dropped (:attr:`dropped`; the record stays numbered as
        the run's world); a lost server raises :class:`~mpiopt.asyncrt.ServerLost`.
        """
        started = time.perf_counter()

        def launch(survivors: Any) -> Any:
            world = self.topology.world
            agree_on_arguments(world, "async_lsgd.run", lambda: self._check_run(params, steps, seconds))
            self._book.begin()
            work = partial(self._work, params, worker_fn, steps, seconds)
            return run_policy(world, self._book, work, params, max_sleep=max_sleep, survivors=survivors)

        outcome = self._run_surviving(launch)
        world, book = self.topology.world, self._book
        if world.size > 1 and world.rank == SERVER and book.global_leader >= 0:
            params[...] = book.latest[book.global_leader]
        return AsyncLSGDResult.from_record(outcome.record, time.perf_counter() - started, outcome.idle_seconds)

    def _check_run(self, params: Any, steps: Optional[int], seconds: Optional[float]) -> None:
        if self.num_params is None:
            raise RuntimeError(f"{type(self).__name__}.setup(params) must be called before run()")
        self._check_flat("params", params)
        check_run_arguments(params, 0 if steps is None else steps)
        if seconds is not None:
            check_positive("seconds", seconds)
        elif steps is None:
            raise ValueError("run() needs steps or seconds (or both)")

    def _work(self, params: np.ndarray, worker_fn: WorkerFn, steps: Optional[int], seconds: Optional[float], link: Link) -> None:
        """A worker's run: its steps until ``steps`` or ``seconds`` run out; the last reply's pulls; LAST; STOP."""
        grad = empty_apart(params)
        self._link, self._reported = link, self.steps  # the server has this count already (the last run's LAST)
        deadline = math.inf if seconds is None else time.perf_counter() + seconds
        k = 0
        while (steps is None or k < steps) and time.perf_counter() < deadline:
            loss = worker_fn(params, self.steps, grad)
            self._apply_step(params, grad, loss=loss)  # the base class's checks and accounting around _step
            k += 1
        self._pull_and_step(params, None, self._take(params, link.wait()))
        self._upload(params, UPLOAD | LAST)
        reply = link.wait()
        if not reply.kind & STOP:
            raise RuntimeError(f"async_lsgd worker: expected STOP from the server, got kind {reply.kind}")
        self._link = None
