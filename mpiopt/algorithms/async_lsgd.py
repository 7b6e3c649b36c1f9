"""Asynchronous LSGD: leaders kept by a server, pulls scheduled by the total step count.

Teng, Gao, Chalus, Choromanska, Goldfarb and Weller, "Leader Stochastic
Gradient Descent for Distributed Training of Deep Learning Models",
NeurIPS 2019; ALGORITHMS.md "LSGD", "Asynchronous version": workers run
local SGD at their own pace; a pull happens when the total step count (over
all workers) crosses a multiple of ``N tau`` (towards the local leader) or
``N tau_G`` (towards the global leader); a worker never waits for another.

The local step, the pull forms, the proximal pull, the election by running
mean loss and every hyperparameter are those of synchronous
:class:`~mpiopt.algorithms.lsgd.LSGD`, from the rule both use
(:class:`~mpiopt.algorithms.lsgd_rule.LSGDRule`).  What changes is who
decides when to pull and where the leader's parameters come from: the
server of :mod:`mpiopt.asyncrt`, whose policy is
:class:`~mpiopt.algorithms.async_lsgd_server.LeaderBook` (its book, rounds,
elections and replies: :mod:`mpiopt.algorithms.async_lsgd_server`).

Roles
-----
World rank 0 is a server that computes nothing; ranks 1..P-1 are the
``N = P - 1`` workers.  A worker's group is its topology group
(``topology.group_index``, so ``group_size`` emulates nodes); the server
belongs to none (``group_size=2`` at 4 ranks: worker groups {1} and {2, 3}).

A worker's step (inside :meth:`AsyncLSGD.run`; nothing blocks)
    1. if the reply to its report has arrived: upload ``x_t`` if asked, and
       take the pulls it carries;
    2. record the loss (every message to the server carries the running mean
       of the losses of the steps it counts);
    3. the local step with those pulls, as the synchronous step does
       ("paper": differences at ``x_t``, subtracted after the local step;
       "convex": mixes after it);
    4. unless a report is still unanswered, every ``report_every`` steps:
       report (its step count, running-mean loss), 32 bytes.

Messages (:mod:`mpiopt.asyncrt.messages`)
    ===========================  ==================================  =============================
    message                      flags                               bytes
    ===========================  ==================================  =============================
    report (worker -> server)    none                                32
    upload (worker -> server)    ``UPLOAD`` (``| LAST`` at the end)  32 + 4d (float32)
    reply (server -> worker)     ``UPLOAD``, ``PULL_LOCAL``,         32 + k 4d: k = 0, 1 or 2
                                 ``PULL_GLOBAL``                     copies
    ===========================  ==================================  =============================

    A reply's flags say which pulls it carries, its ``ranks`` towards whom;
    with both, two copies when the sources differ (several groups), one
    serving both otherwise.  Uploads are not answered.

Shutdown
    A worker stops after ``steps`` steps or ``seconds`` of wall time (each
    rank its own), waits for the reply to its last report (its pulls are
    applied without a gradient step) and sends its final upload (LAST, with
    its final step count, loss and parameters).  It then owes no pull, but
    stays a candidate leader: the server has its final parameters.  The
    runtime answers every LAST with STOP once all have come; the server
    then writes the final global leader's parameters into its own
    ``params``, and every rank gets the same record
    (:class:`AsyncLSGDResult`).

One rank
    The rank is the only worker and its own server (the runtime's
    :class:`~mpiopt.asyncrt.LocalLink`): the same book, no messages.
    ``N = 1``, rounds every ``tau`` steps, each settled "as leader": local
    SGD (the proximal pull has no copy to go towards).  At two ranks the one
    worker likewise never pulls, and uploads only its LAST.

Continuing and resuming
    The book is the algorithm's, on the server: a second ``run`` continues
    it (``T``, rounds, leaders, their copies, the counts of the record), as
    each worker continues its own state and step count (``worker_fn``'s
    ``step`` too).  ``run`` returns quiescent: every worker's LAST handled,
    no pull owed, no upload asked for and not arrived, no receive posted.
    So ``state_dict()`` on every rank between two runs holds everything
    (the server's book under ``"server"``; each worker's momentum, losses,
    leader copy; the parameters are the caller's), and a fresh instance
    that loaded it runs on as the first would have.  The copies that serve
    pulls are current at the start of the next run (their leaders have not
    stepped since their LAST), so a pull owed early in it may go towards
    them.  At one rank a continued run is bitwise one long run (every count
    but ``uploads``: one LAST per run).

Cost per pull: 4d bytes, as the synchronous Bcast, and no election
collective: a report is 32 bytes each way.  The server keeps each worker's
latest upload twice (one arriving) and a reply buffer per worker (about 3 or
4 copies of the parameters per worker); parameters live in host memory (numpy).

Example
-------
>>> topology = mpiopt.Topology(group_size=4)
>>> alg = mpiopt.create("async_lsgd", topology, lr=0.1, global_period=16)
>>> alg.setup(params)
>>> result = alg.run(params, worker_fn, seconds=600)   # worker_fn(params, step, out) -> loss
>>> result.global_leader, result.pulls[topology.rank]
"""

from __future__ import annotations

import math
import time
from functools import partial
from typing import Any, Callable, Dict, List, Optional

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

__all__ = ["AsyncLSGD", "AsyncLSGDResult"]


@register
class AsyncLSGD(ServerStateMixin, LSGDState, AsynchronousAlgorithm):
    """Asynchronous LSGD (Teng et al. 2019): a server keeps the leaders, workers never wait for each other.

    Parameters
    ----------
    topology : Topology
        World rank 0 serves; the other ranks are workers, grouped by
        ``topology.group_index`` for their local leaders.
    lr : float
        Learning rate of the local steps (default 0.1, as LSGD's).
    pull_local, pull_global, period, global_period, pull_form, proximal, loss_window,
    momentum, dampening, nesterov, weight_decay
        As in :class:`~mpiopt.algorithms.lsgd.LSGD` (same defaults); ``period``
        and ``global_period`` count each worker's steps on average: a round
        every ``N period`` (``N global_period``) steps of all ``N`` workers.
    report_every : int
        Local steps between a worker's reports (>= 1; default 1, 32 bytes each
        way).  A report due while the previous one is unanswered waits for
        that answer (the steps are never held up).
    nan_policy : {"raise"}
        ``"skip"`` is refused: the base class decides it collectively, which
        workers that never wait for each other cannot do.

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

    def hyperparameters(self) -> Dict[str, Any]:
        return {**self.rule.hyperparameters(), "report_every": self.report_every}

    def _allocate(self, params: Any) -> None:
        if not isinstance(params, np.ndarray):
            raise TypeError(f"async_lsgd keeps the parameters in host memory: params must be a numpy array, got {type(params).__name__}")
        self.rule.allocate(params)
        self._leader = empty_apart(params, zero=True)
        groups = self.topology.world.allgather_obj(self.topology.group_index)
        size = self.topology.size
        workers = {w: groups[w] for w in (range(1, size) if size > 1 else [0])}
        self._book = LeaderBook(workers, self.period, self.global_period, (self.pull_local > 0, self.pull_global > 0))

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
        """A worker's local step, in the order of the module docstring."""
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
        """Train asynchronously on every rank of the world (a collective call).

        Parameters
        ----------
        params : numpy.ndarray
            A worker's own parameters, updated in place.  On the server they
            end as the final global leader's (bitwise).
        worker_fn : callable
            ``worker_fn(params, step, out) -> loss``: this worker's stochastic
            gradient at ``params`` (read-only) into ``out`` and its training
            loss (required: it elects the leaders); ``step`` is this worker's
            step count (:attr:`steps`: it runs on from run to run).
        steps : int, optional
            Local steps of this worker (ranks may differ).
        seconds : float, optional
            Wall-time budget of this worker: no step starts after it.  At
            least one of ``steps`` and ``seconds``; the server ignores both
            (but checks them).
        max_sleep : float
            Longest pause of a waiting rank (see :class:`~mpiopt.asyncrt.Poller`).

        The run continues the server's book and each worker's state (see
        "Continuing and resuming" in the module docstring).

        Returns
        -------
        AsyncLSGDResult
            The same record on every rank; its counts run on from the
            earlier runs.

        Raises
        ------
        RuntimeError, TypeError, ValueError
            On every rank, when any rank is not set up or passes bad
            ``params``, ``steps`` or ``seconds`` (the message names the ranks
            and values).
        """
        world = self.topology.world
        agree_on_arguments(world, "async_lsgd.run", lambda: self._check_run(params, steps, seconds))
        started = time.perf_counter()
        book = self._book
        book.begin()
        outcome = run_policy(world, book, partial(self._work, params, worker_fn, steps, seconds), params, max_sleep=max_sleep)
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
