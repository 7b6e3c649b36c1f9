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
server of :mod:`mpiopt.asyncrt`, whose policy is this module's
:class:`LeaderBook`.

Roles
-----
World rank 0 is a server that computes nothing; ranks 1..P-1 are the
``N = P - 1`` workers.  A worker's group is its topology group
(``topology.group_index``, so ``group_size`` emulates nodes); the server
belongs to none (``group_size=2`` at 4 ranks: worker groups {1} and {2, 3}).

The server's book (:class:`LeaderBook`)
    ``T``, the sum of the step counts the workers report; rounds
    ``r_L = T // (N tau)`` and ``r_G = T // (N tau_G)``.  Each worker's
    latest running-mean loss; per scope (each worker group, and the world)
    the leader: the lowest such loss, ties to the lowest rank, a NaN mean or
    a worker that has not reported yet never elected.  Each worker's latest
    uploaded parameters, with their step count and the rounds when they were
    asked for; per scope the *source*, the leader whose upload serves the
    pulls (the previous one until a new leader's parameters arrive).

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

The server, per message
    A report from ``w`` adds ``w``'s new steps to ``T``.  Every multiple of
    ``N tau`` (``N tau_G``) crossed opens a local (global) round: each
    worker still running owes that pull (one already owing it pulls once for
    both rounds: *merged*), and the leader of each scope with two or more
    workers is asked to refresh its upload.  The report's loss re-elects the
    leaders of ``w``'s scopes; a new leader is asked to upload.  The reply
    goes to ``w`` at once: an upload request if one is due, and for each
    owed pull: nothing to do if ``w`` leads that scope (*as leader*); the
    pull, with the source's parameters, if the source is another worker and
    its copy is newer than the crossing (asked for after ``w``'s debt began)
    or *current* (the source has reported no step since it uploaded: a slow
    or finished leader); else the debt stays and a later reply settles it
    (``w`` goes on meanwhile).  An upload replaces its sender's copy and
    becomes the source of the scopes it leads.

Choices
    Every worker of a scope pulls once per round, in the first reply after
    the crossing that has a copy newer than the crossing: the authors' code
    likewise gives the pull to each worker's next request after the
    crossing, and a pull then moves each worker as often as in the
    synchronous form (once per ``tau`` of its own steps, on average) when
    replies keep up with the rounds.  Rounds that open faster than a worker
    hears back merge into one pull, as with a synchronous ``tau`` that
    small.  Only leaders upload (at most once per round and reply, plus
    leader changes): a worker's parameters cross the network only when
    someone will pull towards them.  A pull never goes towards a copy from
    before its crossing that the leader has since left behind; waiting for a
    fresh one delays the pull, never a step.

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
from dataclasses import dataclass
from functools import partial
from typing import Any, Callable, Dict, List, Mapping, NamedTuple, Optional, Tuple

import numpy as np

from ..asyncrt import (
    DEFAULT_MAX_SLEEP,
    SERVER,
    Link,
    Message,
    Policy,
    Reply,
    WorkerFn,
    agree_on_arguments,
    check_run_arguments,
    run_policy,
)
from ..arrays import empty_apart
from ..asyncrt.messages import LAST, PULL_GLOBAL, PULL_LOCAL, STOP, UPLOAD
from ..asyncrt.state import ServerStateMixin, state_array, state_count
from ..comm import Topology
from .base import BASE, AsynchronousAlgorithm
from .lsgd_rule import LSGD_RULE, LSGDRule, LSGDState, Pull, elect
from .schema import Hyperparameter, Schema, check_positive, positive
from .registry import register

__all__ = ["AsyncLSGD", "AsyncLSGDResult", "LeaderBook"]

LOCAL, GLOBAL = 0, 1  # kinds of pull: columns of the per-rank tables
_WORLD = -1  # scope id of the global leader (local scopes are group indices)


class Answer(NamedTuple):
    """What the server's reply to one report carries (see :meth:`LeaderBook.answer`).

    Attributes
    ----------
    upload : bool
        The worker is to send its parameters.
    leaders : tuple of int
        Per kind (local, global): the rank that settled an owed pull (the
        copy's source, or the worker itself as leader), -1 if none.
    pulling : tuple of bool
        Per kind: a pull towards ``leaders[kind]``'s copy.
    """

    upload: bool
    leaders: Tuple[int, int]
    pulling: Tuple[bool, bool]

    def sources(self) -> List[int]:
        """The copies the reply carries, local first, each once."""
        out: List[int] = []
        for kind in (LOCAL, GLOBAL):
            if self.pulling[kind] and self.leaders[kind] not in out:
                out.append(self.leaders[kind])
        return out


class LeaderBook(Policy):
    """The server's policy: steps, rounds, elections, debts and the leaders' copies (no MPI of its own).

    The book's events (:meth:`note`, :meth:`answer`, :meth:`uploaded`) are
    plain calls, testable on their own; :meth:`receive` maps the runtime's
    messages onto them: a report (no flag) is noted and answered at once, an
    upload (``UPLOAD``, and the final one with ``LAST``) is booked and kept
    (the runtime double-buffers it), so the copies a reply carries are views
    of the latest uploads.

    Parameters
    ----------
    groups : mapping
        World rank of each worker -> its group index.
    period, global_period : int
        ``tau`` and ``tau_G``: a round every ``N tau`` (``N tau_G``) total steps.
    pulls_on : tuple of bool
        Whether local and global pulls are on (a coefficient > 0); rounds are
        counted either way, debts and uploads only when on.

    The book outlives a run: :meth:`begin` starts the next one, which
    continues it; :meth:`state_dict` and :meth:`loader` carry it between
    processes.
    """

    keeps_payloads = True  # the latest uploads serve later replies
    # Per-rank tables that carry over from run to run (``finished`` starts every run False).
    _TABLES = ("steps", "loss", "uploads", "want_upload", "copy_steps", "copy_rounds", "owed", "crossings", "pulls", "as_leader", "merged")

    def __init__(self, groups: Mapping[int, int], period: int, global_period: int, pulls_on: Tuple[bool, bool]) -> None:
        self.workers = sorted(groups)
        size = self.workers[-1] + 1
        self.group = dict(groups)
        self.members: Dict[int, List[int]] = {_WORLD: list(self.workers)}
        for w in self.workers:
            self.members.setdefault(self.group[w], []).append(w)
        self.every = (len(self.workers) * period, len(self.workers) * global_period)
        self.pulls_on = pulls_on
        self.total = 0
        self.rounds = [0, 0]
        self.steps = np.zeros(size, dtype=np.int64)
        self.loss = np.full(size, np.nan)
        self.finished = np.zeros(size, dtype=bool)
        self.uploads = np.zeros(size, dtype=np.int64)
        self.want_upload = np.zeros(size, dtype=bool)
        self.requested: Dict[int, Tuple[int, int]] = {}  # uploads asked for and not yet arrived: rounds at the request
        self.copy_steps = np.full(size, -1, dtype=np.int64)  # steps of each worker's latest upload, -1: none
        self.copy_rounds = np.full((size, 2), -1, dtype=np.int64)  # rounds when that upload was asked for
        self.owed = np.full((size, 2), -1, dtype=np.int64)  # round a debt began, -1: none
        self.crossings = np.zeros((size, 2), dtype=np.int64)
        self.pulls = np.zeros((size, 2), dtype=np.int64)
        self.as_leader = np.zeros((size, 2), dtype=np.int64)
        self.merged = np.zeros((size, 2), dtype=np.int64)
        self.leader = {s: -1 for s in self.members}
        self.source = {s: -1 for s in self.members}  # the worker whose latest upload serves the scope's pulls
        self.latest: Dict[int, np.ndarray] = {}  # each worker's latest upload (a view the runtime keeps intact)
        # Two copies in one reply only when local and global leaders can differ: several worker groups.
        self.reply_copies = 2 if len(set(self.group.values())) > 1 else 1

    def _kind(self, scope: int) -> int:
        return GLOBAL if scope == _WORLD else LOCAL

    def _scope(self, w: int, kind: int) -> int:
        return _WORLD if kind == GLOBAL else self.group[w]

    def _shared(self, scope: int) -> bool:
        """Someone may pull towards this scope's leader: two workers or more, pulls on."""
        return len(self.members[scope]) > 1 and self.pulls_on[self._kind(scope)]

    # -- events --------------------------------------------------------------------------
    def note(self, w: int, steps: int, loss: float) -> None:
        """Worker ``w`` has done ``steps`` steps (in all its runs) and its running-mean loss is ``loss``."""
        self.total += steps - int(self.steps[w])
        self.steps[w] = steps
        self.loss[w] = loss
        for kind in (LOCAL, GLOBAL):
            while self.total >= (self.rounds[kind] + 1) * self.every[kind]:
                self.rounds[kind] += 1
                self._open_round(kind)
        for scope in (self.group[w], _WORLD):
            self._elect(scope)

    def _open_round(self, kind: int) -> None:
        if not self.pulls_on[kind]:
            return
        for w in self.workers:
            if self.finished[w]:
                continue
            self.crossings[w, kind] += 1
            if self.owed[w, kind] < 0:
                self.owed[w, kind] = self.rounds[kind]
            else:
                self.merged[w, kind] += 1
        for scope in self.members:
            if self._kind(scope) == kind and self._shared(scope):
                self._want_copy(self.leader[scope])

    def _want_copy(self, w: int) -> None:
        if w >= 0 and not self.finished[w]:  # a finished worker's last upload is final
            self.want_upload[w] = True

    def _elect(self, scope: int) -> None:
        new = elect((m, self.loss[m]) for m in self.members[scope])
        if new == self.leader[scope]:
            return
        self.leader[scope] = new
        if new >= 0 and self._shared(scope):
            if self.finished[new]:
                self.source[scope] = new  # its LAST parameters: current for ever
            else:
                self._want_copy(new)

    def _serves(self, source: int, kind: int, since: int) -> bool:
        """Whether ``source``'s copy serves a debt that began at round ``since``: asked for after it, or current."""
        return self.copy_rounds[source, kind] >= since or self.copy_steps[source] == self.steps[source]

    def answer(self, w: int) -> Answer:
        """The reply to a report of ``w``: an upload request if due, and the owed pulls that can be settled."""
        upload = bool(self.want_upload[w]) and w not in self.requested
        if upload:
            self.want_upload[w] = False
            self.requested[w] = (self.rounds[LOCAL], self.rounds[GLOBAL])
        leaders, pulling = [-1, -1], [False, False]
        for kind in (LOCAL, GLOBAL):
            since = self.owed[w, kind]
            if since < 0:
                continue
            scope = self._scope(w, kind)
            source = self.source[scope]
            if self.leader[scope] == w:
                self.as_leader[w, kind] += 1
                leaders[kind] = w
            elif source >= 0 and source != w and self._serves(source, kind, since):
                self.pulls[w, kind] += 1
                leaders[kind], pulling[kind] = source, True
            else:
                continue  # no copy newer than the crossing yet: a later reply settles it
            self.owed[w, kind] = -1
        return Answer(upload, (leaders[0], leaders[1]), (pulling[0], pulling[1]))

    def uploaded(self, w: int, steps: int, loss: float, final: bool) -> None:
        """``w``'s parameters arrived (requested, or its LAST); they serve the scopes it leads."""
        self.copy_rounds[w] = self.requested.pop(w, self.rounds)  # LAST comes unasked: as of now
        self.copy_steps[w] = steps
        self.uploads[w] += 1
        if final:
            self.finished[w] = True
            self.merged[w] += self.owed[w] >= 0  # debts it will never settle
            self.owed[w] = -1
        self.note(w, steps, loss)
        for scope in (self.group[w], _WORLD):
            if self.leader[scope] == w and self._shared(scope):
                self.source[scope] = w

    # -- from run to run ---------------------------------------------------------------------------
    def begin(self) -> None:
        """A run starts: every worker runs again; the rest of the book carries on."""
        self.finished[:] = False
        self.stopping = False

    def state_dict(self) -> Dict[str, Any]:
        """The book between two runs as storable values: ``T``, rounds, tables, leaders, sources and copies.

        Of the workers' latest uploads only the sources' are kept: no other
        copy is read before its owner uploads again.  No upload is asked for
        and not yet arrived (a worker acts on its last reply before its LAST).
        """
        scopes = sorted(self.members)
        sources = sorted({self.source[s] for s in scopes if self.source[s] >= 0})
        return {
            "total_steps": self.total,
            "rounds": np.array(self.rounds, dtype=np.int64),
            **{key: getattr(self, key).copy() for key in self._TABLES},
            "leaders": np.array([self.leader[s] for s in scopes], dtype=np.int64),
            "sources": np.array([self.source[s] for s in scopes], dtype=np.int64),
            "copies": {str(w): np.array(self.latest[w]) for w in sources},
        }

    def loader(self, saved: Any, like: np.ndarray) -> Callable[[], None]:
        """Check a :meth:`state_dict` against this book and ``like`` (the parameters); return what restores it.

        Raises
        ------
        ValueError
            Naming the entry that does not fit (another world or grouping,
            a missing copy, another parameter size).
        """
        if not isinstance(saved, Mapping):
            raise ValueError(f"server state must be a mapping (the server's book), got {saved!r}")
        total = state_count(saved, "total_steps")
        rounds = state_array(saved, "rounds", (2,), "iu")
        tables = {}
        for key in self._TABLES:
            current = getattr(self, key)
            kinds = {"b": "b", "f": "f"}.get(current.dtype.kind, "iu")
            tables[key] = state_array(saved, key, current.shape, kinds).astype(current.dtype)
        scopes = sorted(self.members)
        ranks = set(self.workers) | {-1}
        named = {key: state_array(saved, key, (len(scopes),), "iu").tolist() for key in ("leaders", "sources")}
        for key, values in named.items():
            if not set(values) <= ranks:
                raise ValueError(f"server state {key!r}: {values} names ranks that are not workers here ({self.workers})")
        copies = saved.get("copies")
        if not isinstance(copies, Mapping):
            raise ValueError(f"server state 'copies' must be a mapping (worker rank -> parameters), got {copies!r}")
        latest = {w: state_array(copies, str(w), (like.size,), "f").astype(like.dtype) for w in set(named["sources"]) - {-1}}

        def restore() -> None:
            self.total, self.rounds = total, [int(r) for r in rounds]
            for key, table in tables.items():
                setattr(self, key, table)
            self.leader = dict(zip(scopes, named["leaders"]))
            self.source = dict(zip(scopes, named["sources"]))
            self.latest, self.requested = latest, {}

        return restore

    # -- the runtime's policy -------------------------------------------------------------------
    def receive(self, worker: int, message: Message) -> Optional[Reply]:
        """A report: note it, answer at once; an upload: book it, keep it, no answer (LAST: STOP at the end)."""
        loss = math.nan if message.loss is None else message.loss
        if message.kind & UPLOAD:
            self.latest[worker] = message.payload
            self.uploaded(worker, message.version, loss, final=bool(message.kind & LAST))
            return None
        self.note(worker, message.version, loss)
        answer = self.answer(worker)
        kind = UPLOAD if answer.upload else 0
        kind |= (PULL_LOCAL if answer.pulling[LOCAL] else 0) | (PULL_GLOBAL if answer.pulling[GLOBAL] else 0)
        return Reply(kind, self.total, [self.latest[source] for source in answer.sources()], answer.leaders)

    def stop(self) -> Reply:
        return Reply(STOP, self.total, (), (-1, self.global_leader))

    @property
    def global_leader(self) -> int:
        return self.leader[_WORLD]

    def record(self) -> Dict[str, Any]:
        """The run's outcome as plain data (the fields of :class:`AsyncLSGDResult` that every rank shares)."""
        return {
            "total_steps": self.total,
            "steps": self.steps.tolist(),
            "local_rounds": self.rounds[LOCAL],
            "global_rounds": self.rounds[GLOBAL],
            "pulls": self.pulls.tolist(),
            "crossings": self.crossings.tolist(),
            "as_leader": self.as_leader.tolist(),
            "merged": self.merged.tolist(),
            "uploads": self.uploads.tolist(),
            "losses": self.loss.tolist(),
            "local_leaders": {g: self.leader[g] for g in sorted(self.members) if g != _WORLD},
            "global_leader": self.global_leader,
        }


@dataclass
class AsyncLSGDResult:
    """The outcome of :meth:`AsyncLSGD.run`: the same on every rank except the two times.

    Per-rank arrays are indexed by world rank (the server's row is zeros);
    ``(size, 2)`` tables have a local and a global column.  For every rank
    and kind, ``crossings = pulls + as_leader + merged``.  The counts are
    the server's book: they run on over every run of the algorithm (a
    second run, or a resumed one, adds to them); the times are this run's.

    Attributes
    ----------
    total_steps : int
        ``T``, local steps of all workers.
    steps : numpy.ndarray
        Local steps per rank.
    local_rounds, global_rounds : int
        ``T // (N tau)`` and ``T // (N tau_G)``: the multiples crossed.
    pulls : numpy.ndarray
        Pulls applied (the rank moved towards another worker's copy).
    crossings : numpy.ndarray
        Rounds opened while the rank was running (0 where that pull is off).
    as_leader : numpy.ndarray
        Rounds settled without a pull: the rank led that scope.
    merged : numpy.ndarray
        Rounds merged into one pull with an earlier round, or still owed when
        the rank finished.
    uploads : numpy.ndarray
        Parameter uploads per rank (LAST included).
    losses : numpy.ndarray
        Final running-mean loss per rank (NaN: none).
    local_leaders : dict
        Group index -> world rank of its final leader (-1: none).
    global_leader : int
        World rank of the final global leader; its parameters end on rank 0.
    seconds : float
        This rank's wall time in ``run``.
    idle_seconds : float
        This rank's time spent waiting (the server for messages, a worker at
        its end).
    """

    total_steps: int
    steps: np.ndarray
    local_rounds: int
    global_rounds: int
    pulls: np.ndarray
    crossings: np.ndarray
    as_leader: np.ndarray
    merged: np.ndarray
    uploads: np.ndarray
    losses: np.ndarray
    local_leaders: Dict[int, int]
    global_leader: int
    seconds: float = 0.0
    idle_seconds: float = 0.0

    @classmethod
    def from_record(cls, record: Mapping[str, Any], seconds: float, idle_seconds: float) -> "AsyncLSGDResult":
        arrays = {key: np.asarray(record[key]) for key in ("steps", "pulls", "crossings", "as_leader", "merged", "uploads", "losses")}
        scalars = {key: record[key] for key in ("total_steps", "local_rounds", "global_rounds", "local_leaders", "global_leader")}
        return cls(**arrays, **scalars, seconds=seconds, idle_seconds=idle_seconds)

    def as_dict(self) -> Dict[str, Any]:
        """Plain data (for JSON)."""
        return {key: value.tolist() if isinstance(value, np.ndarray) else value for key, value in vars(self).items()}


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

    def __init__(self, topology: Topology, *, lr: float = 0.1, report_every: int = 1, nan_policy: str = "raise", **lsgd: Any) -> None:
        if nan_policy != "raise":
            raise ValueError(
                f"nan_policy must be 'raise' for async_lsgd (skipping is decided collectively, not asynchronously), got {nan_policy!r}"
            )
        super().__init__(topology, lr=lr, nan_policy=nan_policy)
        self.rule = LSGDRule(**lsgd)
        self.report_every = self.schema["report_every"].validate(report_every)
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
