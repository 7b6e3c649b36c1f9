"""Asynchronous LSGD: leaders kept by a server, pulls scheduled by the total step count.

Teng, Gao, Chalus, Choromanska, Goldfarb and Weller, "Leader Stochastic
Gradient Descent for Distributed Training of Deep Learning Models",
NeurIPS 2019; ALGORITHMS.md "LSGD", "Asynchronous version": workers run
local SGD at their own pace; a pull happens when the total step count (over
all workers) crosses a multiple of ``N tau`` (towards the local leader) or
``N tau_G`` (towards the global leader); a worker never waits for another.

The local step, the pull forms, the proximal pull, the election by running
mean loss and every hyperparameter are those of synchronous
:class:`~mpiopt.algorithms.lsgd.LSGD`, which this class extends (the step
with its pulls is ``LSGD._pull_and_step``).  What changes is who decides
when to pull and where the leader's parameters come from.

Roles
-----
World rank 0 is a server that computes nothing; ranks 1..P-1 are the
``N = P - 1`` workers.  A worker's group is its topology group
(``topology.group_index``, so ``group_size`` emulates nodes); the server
belongs to none (``group_size=2`` at 4 ranks: worker groups {1} and {2, 3}).

The server's book (:class:`LeaderBook`, no MPI)
    ``T``, the sum of the step counts the workers report; rounds
    ``r_L = T // (N tau)`` and ``r_G = T // (N tau_G)``.  Each worker's
    latest running-mean loss; per scope (each worker group, and the world)
    the leader: the lowest such loss, ties to the lowest rank, a NaN mean or
    a worker that has not reported yet never elected.  Each worker's latest
    uploaded parameters, with their step count and the rounds when they were
    asked for; per scope the *source*, the leader whose upload serves the
    pulls (the previous one until a new leader's parameters arrive).

A worker's step (``step``, inside :meth:`AsyncLSGD.run`; nothing blocks)
    1. if the reply to its report has arrived (``Iprobe``): upload ``x_t`` if
       asked, and take the pulls it carries;
    2. record the loss (every message to the server carries the running mean
       of the losses of the steps it counts);
    3. the local step with those pulls, as the synchronous step does
       ("paper": differences at ``x_t``, subtracted after the local step;
       "convex": mixes after it);
    4. unless a report is still unanswered, every ``report_every`` steps:
       report (steps so far in this run, running-mean loss), 32 bytes.

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

Messages
    One buffer each (:class:`~mpiopt.asyncrt.Message` with this module's
    headers :data:`UP` and :data:`DOWN`); a receiver ``Iprobe``\\ s and then
    ``Recv``\\ s exactly the size the tag announces, so the ledger counts
    what crossed and no receive is ever left posted.

    ===========================  =========  =======================================
    message                      tag        bytes
    ===========================  =========  =======================================
    report (worker -> server)    REPORT     32
    upload (worker -> server)    UPLOAD     32 + 4d (float32): leaders, and LAST
    reply (server -> worker)     REPLY + k  32 + k 4d: k = 0, 1 or 2 copies
    ===========================  =========  =======================================

    A reply's flags say which pulls it carries; with both, two copies when the
    sources differ (several groups), one serving both otherwise.

Shutdown
    A worker stops after ``steps`` steps or ``seconds`` of wall time (each
    rank its own), waits for the reply to its last report (its pulls are
    applied without a gradient step) and sends LAST, an upload with its
    final step count, loss and parameters.  It then owes no pull, but stays a
    candidate leader: the server has its final parameters.  When every
    worker has sent LAST, the server answers each STOP, writes the final
    global leader's parameters into its own ``params`` and broadcasts the
    record (:class:`AsyncLSGDResult`), so every rank ends with the same
    record.  A worker waits for STOP by polling (sleeping, see
    :class:`~mpiopt.asyncrt.Poller`), not in a spinning collective.  An
    exception on one rank leaves the others polling: run under
    :func:`mpiopt.abort_on_exception`, as every mpiopt job.

One rank
    The rank is the only worker and its own server: the same book, no
    messages.  ``N = 1``, rounds every ``tau`` steps, each settled "as
    leader": local SGD (the proximal pull has no copy to go towards).  At
    two ranks the one worker likewise never pulls, and uploads only its LAST.

Cost per pull: 4d bytes, as the synchronous Bcast, and no election
collective: a report is 32 bytes each way.  The server keeps each worker's
latest upload and a reply buffer per worker (about 2 or 3 copies of the
parameters per worker); parameters live in host memory (numpy).

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
from typing import Any, Callable, Dict, List, Mapping, NamedTuple, Optional, Tuple

import numpy as np

from ..asyncrt import DEFAULT_MAX_SLEEP, SERVER, Message, Poller, WorkerFn
from ..asyncrt.messages import LAST, STOP
from ..asyncrt.result import check_run_arguments
from ..comm import ANY_TAG, Comm, Topology
from .base import check_positive
from .lsgd import LSGD
from .registry import register

__all__ = ["AsyncLSGD", "AsyncLSGDResult", "LeaderBook", "UP", "DOWN"]

#: Worker -> server header (reports and uploads): ``steps`` in this run, running-mean ``loss``.
UP = np.dtype([("kind", "<i8"), ("steps", "<i8"), ("sequence", "<i8"), ("loss", "<f8")])
#: Server -> worker header (replies, STOP): total steps ``T``; per scope the rank that settled a pull, or -1.
DOWN = np.dtype([("kind", "<i8"), ("total", "<i8"), ("local_leader", "<i8"), ("global_leader", "<i8")])

# Tags on the world communicator (a Dup: never an application's messages).
TAG_REPORT = 0x15D1
TAG_UPLOAD = 0x15D2
TAG_REPLY = 0x15D4  # + number of copies carried (0, 1 or 2)

# Kinds (bit flags) besides the runtime's LAST (a worker's final message) and STOP (the run is over).
UPLOAD = 16  # server -> worker: send your parameters; worker -> server: here they are
PULL_LOCAL = 32
PULL_GLOBAL = 64

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


class LeaderBook:
    """The server's bookkeeping, without MPI: steps, rounds, elections, debts and copies.

    Parameters
    ----------
    groups : mapping
        World rank of each worker -> its group index.
    period, global_period : int
        ``tau`` and ``tau_G``: a round every ``N tau`` (``N tau_G``) total steps.
    pulls_on : tuple of bool
        Whether local and global pulls are on (a coefficient > 0); rounds are
        counted either way, debts and uploads only when on.
    """

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

    def _kind(self, scope: int) -> int:
        return GLOBAL if scope == _WORLD else LOCAL

    def _scope(self, w: int, kind: int) -> int:
        return _WORLD if kind == GLOBAL else self.group[w]

    def _shared(self, scope: int) -> bool:
        """Someone may pull towards this scope's leader: two workers or more, pulls on."""
        return len(self.members[scope]) > 1 and self.pulls_on[self._kind(scope)]

    # -- events --------------------------------------------------------------------------
    def note(self, w: int, steps: int, loss: float) -> None:
        """Worker ``w`` has done ``steps`` steps in this run and its running-mean loss is ``loss``."""
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
        candidates = [m for m in self.members[scope] if np.isfinite(self.loss[m])]
        new = min(candidates, key=lambda m: (self.loss[m], m)) if candidates else -1
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
    and kind, ``crossings = pulls + as_leader + merged``.

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


class _Reply(NamedTuple):
    """A reply as the worker reads it: flags, ``T``, settling ranks and the copies' parameters."""

    kind: int
    total: int
    leaders: Tuple[int, int]
    copies: List[np.ndarray]


class _Probe:
    """``Comm.Iprobe`` as a request for :class:`~mpiopt.asyncrt.Poller`: ``Test()`` is True once a match waits."""

    def __init__(self, comm: Comm, source: int) -> None:
        self._comm, self._source = comm, source
        self.status: Any = None  # the MPI status of the message found

    def Test(self) -> bool:
        self.status = self._comm.Iprobe(self._source, ANY_TAG)
        return self.status is not None


def _reply_bytes(copies: int, num_params: int, itemsize: int) -> int:
    return DOWN.itemsize + copies * num_params * itemsize


class _ServerLink:
    """A worker's connection to the server: a report in flight at most, uploads, the final handshake."""

    def __init__(self, world: Comm, reply: Message, copies: int, poller: Poller) -> None:
        self.world, self.reply_message, self.poller = world, reply, poller
        self.num_params = n = reply.payload.size // copies
        self.report_message = Message(0, reply.payload.dtype, header=UP)
        self.upload_message = Message(n, reply.payload.dtype, header=UP)
        self.probe = _Probe(world, SERVER)
        self.sequence = 0
        self.report_send = self.upload_send = None

    @property
    def awaiting(self) -> bool:
        return self.report_send is not None

    def report(self, steps: int, loss: float) -> None:
        self.sequence += 1
        self.report_message.header[0] = (0, steps, self.sequence, loss)
        self.report_send = self.world.Isend(self.report_message.buffer, SERVER, TAG_REPORT)

    def poll(self) -> Optional[_Reply]:
        return self._receive() if self.awaiting and self.probe.Test() else None

    def wait(self) -> Optional[_Reply]:
        if not self.awaiting:
            return None
        self.poller.wait_any([self.probe])
        return self._receive()

    def _receive(self) -> _Reply:
        tag = self.probe.status.Get_tag()
        copies = tag - TAG_REPLY
        if not 0 <= copies <= 2:
            raise RuntimeError(f"async_lsgd worker: unexpected message with tag {tag:#x} from the server")
        message, n = self.reply_message, self.num_params
        self.world.Recv(message.buffer[: _reply_bytes(copies, n, message.payload.itemsize)], SERVER, tag)
        self.report_send.Wait()  # complete: the server answered it
        self.report_send = None
        h = message.header[0]
        views = [message.payload[i * n : (i + 1) * n] for i in range(copies)]
        return _Reply(int(h["kind"]), int(h["total"]), (int(h["local_leader"]), int(h["global_leader"])), views)

    def upload(self, params: np.ndarray, steps: int, loss: float, kind: int = UPLOAD) -> None:
        if self.upload_send is not None:
            self.upload_send.Wait()  # the server has long received it (it probes all the time)
        self.upload_message.header[0] = (kind, steps, self.sequence, loss)
        self.upload_message.payload[...] = params
        self.upload_send = self.world.Isend(self.upload_message.buffer, SERVER, TAG_UPLOAD)

    def close(self, params: np.ndarray, steps: int, loss: float) -> None:
        """Send LAST with the final parameters, then wait for STOP."""
        self.upload(params, steps, loss, kind=UPLOAD | LAST)
        self.poller.wait_any([self.probe])
        tag = self.probe.status.Get_tag()
        self.world.Recv(self.reply_message.buffer[: DOWN.itemsize], SERVER, tag)
        if tag != TAG_REPLY or not self.reply_message.header["kind"][0] & STOP:
            raise RuntimeError(f"async_lsgd worker: expected STOP from the server, got tag {tag:#x}")
        self.upload_send.Wait()


class _SelfLink:
    """The one rank's connection to itself: the same book, no messages, never a copy (it is the only worker)."""

    def __init__(self, book: LeaderBook) -> None:
        self.book = book
        self.pending: Optional[_Reply] = None

    @property
    def awaiting(self) -> bool:
        return self.pending is not None

    def report(self, steps: int, loss: float) -> None:
        self.book.note(0, steps, loss)
        answer = self.book.answer(0)
        self.pending = _Reply(0, self.book.total, answer.leaders, [])

    def poll(self) -> Optional[_Reply]:
        reply, self.pending = self.pending, None
        return reply

    wait = poll

    def close(self, params: np.ndarray, steps: int, loss: float) -> None:
        self.book.uploaded(0, steps, loss, final=True)


class _Server:
    """World rank 0's loop: keep the book, answer each report at once, take uploads without blocking.

    Each worker has one slot, polled round robin (:class:`~mpiopt.asyncrt.Poller`):
    a probe for its next message or, while its parameters arrive, their
    ``Irecv`` (a large upload may need the sender's progress; the other
    workers are served meanwhile).  Probing one worker at a time also takes
    each worker's messages in the order it sent them.
    """

    def __init__(self, world: Comm, book: LeaderBook, params: np.ndarray, copies: int, poller: Poller) -> None:
        self.world, self.book, self.poller = world, book, poller
        self.num_params, dtype = params.size, params.dtype
        self.latest = {w: Message(params.size, dtype, header=UP) for w in book.workers}  # each worker's latest upload
        # Uploads land here and are swapped into `latest` once complete: a reply never reads a half-received copy.
        self.incoming = {w: Message(params.size, dtype, header=UP) for w in book.workers}
        self.outbox = {w: Message(copies * params.size, dtype, header=DOWN) for w in book.workers}
        self.report = Message(0, dtype, header=UP)
        self.sends: Dict[int, Any] = dict.fromkeys(book.workers)
        self.sequence = dict.fromkeys(book.workers, 0)

    def run(self) -> None:
        """Serve until every worker has sent LAST, then answer each STOP."""
        workers = self.book.workers
        probes = [_Probe(self.world, w) for w in workers]
        slots: List[Any] = list(probes)  # None once the worker is done
        while any(slot is not None for slot in slots):
            i = self.poller.wait_any(slots)
            w = workers[i]
            if slots[i] is not probes[i]:  # its upload has arrived
                slots[i] = None if self._uploaded(w) else probes[i]
                continue
            tag = probes[i].status.Get_tag()
            if tag == TAG_REPORT:
                self._answer(w)
            elif tag == TAG_UPLOAD:
                slots[i] = self.world.Irecv(self.incoming[w].buffer, w, TAG_UPLOAD)
            else:
                raise RuntimeError(f"async_lsgd server: unexpected message with tag {tag:#x} from rank {w}")
        stops = []
        for w in workers:
            self._wait_send(w)
            self.outbox[w].header[0] = (STOP, self.book.total, -1, self.book.global_leader)
            stops.append(self.world.Isend(self.outbox[w].buffer[: DOWN.itemsize], w, TAG_REPLY))
        self.poller.wait_all(stops)

    def _answer(self, w: int) -> None:
        """Take ``w``'s report (small: a blocking receive of a message that is there) and reply at once."""
        self.world.Recv(self.report.buffer, w, TAG_REPORT)
        h = self.report.header[0]
        self.sequence[w] += 1
        if h["sequence"] != self.sequence[w]:
            raise RuntimeError(f"async_lsgd server: report {h['sequence']} from rank {w}, expected {self.sequence[w]}")
        self.book.note(w, int(h["steps"]), float(h["loss"]))
        answer = self.book.answer(w)
        self._wait_send(w)
        out, n = self.outbox[w], self.num_params
        sources = answer.sources()
        for i, source in enumerate(sources):
            out.payload[i * n : (i + 1) * n] = self.latest[source].payload
        kind = (UPLOAD if answer.upload else 0) | (PULL_LOCAL if answer.pulling[LOCAL] else 0) | (PULL_GLOBAL if answer.pulling[GLOBAL] else 0)
        out.header[0] = (kind, self.book.total, answer.leaders[LOCAL], answer.leaders[GLOBAL])
        size = _reply_bytes(len(sources), n, out.payload.itemsize)
        self.sends[w] = self.world.Isend(out.buffer[:size], w, TAG_REPLY + len(sources))

    def _uploaded(self, w: int) -> bool:
        """Book ``w``'s completed upload; True if it was its LAST."""
        self.latest[w], self.incoming[w] = self.incoming[w], self.latest[w]
        h = self.latest[w].header[0]
        final = bool(h["kind"] & LAST)
        self.book.uploaded(w, int(h["steps"]), float(h["loss"]), final)
        return final

    def _wait_send(self, w: int) -> None:
        if self.sends[w] is not None:
            self.sends[w].Wait()  # complete or nearly: the worker has received it before writing again
            self.sends[w] = None


@register
class AsyncLSGD(LSGD):
    """Asynchronous LSGD (Teng et al. 2019): a server keeps the leaders, workers never wait for each other.

    Parameters
    ----------
    topology : Topology
        World rank 0 serves; the other ranks are workers, grouped by
        ``topology.group_index`` for their local leaders.
    lr, pull_local, pull_global, period, global_period, pull_form, proximal, loss_window,
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
    state_scalars = LSGD.state_scalars + ("pulls_local", "pulls_global")

    def __init__(self, topology: Topology, *, report_every: int = 1, nan_policy: str = "raise", **lsgd: Any) -> None:
        if nan_policy != "raise":
            raise ValueError(
                f"nan_policy must be 'raise' for async_lsgd (skipping is decided collectively, not asynchronously), got {nan_policy!r}"
            )
        super().__init__(topology, nan_policy=nan_policy, **lsgd)
        self.report_every = check_positive("report_every", report_every, integer=True)
        self.pulls_local = 0
        self.pulls_global = 0
        self._groups: List[int] = []  # world rank -> group index
        self._reply: Optional[Message] = None  # a worker's receive buffer for replies
        self._copies = 1  # most copies one reply carries
        self._link: Any = None  # _ServerLink or _SelfLink while run() drives this worker
        self._first_step = 0  # self.steps when the run began
        self._reported = 0  # steps of this run at the latest report

    def hyperparameters(self) -> Dict[str, Any]:
        return {**super().hyperparameters(), "report_every": self.report_every}

    def _allocate(self, params: Any) -> None:
        if not isinstance(params, np.ndarray):
            raise TypeError(f"async_lsgd keeps the parameters in host memory: params must be a numpy array, got {type(params).__name__}")
        super()._allocate(params)
        self._groups = self.topology.world.allgather_obj(self.topology.group_index)
        # Two copies in one reply only when local and global leaders can differ: several worker groups.
        self._copies = 2 if len(set(self._worker_groups().values())) > 1 else 1
        self._reply = Message(self._copies * params.size, params.dtype, header=DOWN)
        self._leader = self._reply.payload[: params.size]  # the latest copy received (LSGD's proximal pull and state)

    def _worker_groups(self) -> Dict[int, int]:
        size = self.topology.size
        return {w: self._groups[w] for w in (range(1, size) if size > 1 else [0])}

    # -- a worker's step --------------------------------------------------------------------
    def _step(self, params: Any, grad: Any, loss: Optional[float]) -> None:
        """A worker's local step (see the module docstring); only inside :meth:`run`."""
        if self._link is None:
            raise RuntimeError("async_lsgd: step() is a worker's local step inside run(params, worker_fn, ...); call run()")
        # The reply first: a message to the server always carries the running mean of the steps it counts.
        pulls = self._take(params, self._link.poll())
        self._record_loss(loss)
        self._pull_and_step(params, grad, pulls)
        done = self.steps + 1 - self._first_step  # the base class counts this step after _step returns
        if not self._link.awaiting and done - self._reported >= self.report_every:
            self._link.report(done, self.running_loss())
            self._reported = done

    def _take(self, params: np.ndarray, reply: Optional[_Reply]) -> List[Tuple[float, Callable[[], Optional[np.ndarray]]]]:
        """Act on a reply: upload ``x_t`` if asked; its pulls as ``(coefficient, fetch)`` for ``_pull_and_step``."""
        if reply is None:
            return []
        if reply.kind & UPLOAD:
            self._link.upload(params, self.steps - self._first_step, self.running_loss())
        pulls = []
        for kind, flag, coeff in ((LOCAL, PULL_LOCAL, self.pull_local), (GLOBAL, PULL_GLOBAL, self.pull_global)):
            if not reply.kind & flag:
                continue
            copy = reply.copies[min(len(pulls), len(reply.copies) - 1)]  # one copy serves both when the sources agree
            pulls.append((coeff, lambda copy=copy: copy))
            self._leader = copy  # the proximal pull's anchor: the latest copy (the global one when both came)
            if kind == LOCAL:
                self.last_local_leader = reply.leaders[kind]
                self.pulls_local += 1
            else:
                self.last_global_leader = reply.leaders[kind]
                self.pulls_global += 1
        return pulls

    def _finish(self, params: Any) -> None:
        """A worker's end: the last reply's pulls (no gradient step), LAST, then STOP."""
        if self._link is None:
            return
        self._pull_and_step(params, None, self._take(params, self._link.wait()))
        self._link.close(params, self.steps - self._first_step, self.running_loss())
        self._link = None

    # -- the driver -------------------------------------------------------------------------
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
            loss (required: it elects the leaders); ``step`` counts from 0 in
            each run.
        steps : int, optional
            Local steps of this worker (ranks may differ).
        seconds : float, optional
            Wall-time budget of this worker: no step starts after it.  At
            least one of ``steps`` and ``seconds``; the server ignores both.
        max_sleep : float
            Longest pause of a waiting rank (see :class:`~mpiopt.asyncrt.Poller`).

        Returns
        -------
        AsyncLSGDResult
            The same record on every rank.
        """
        if self.num_params is None:
            raise RuntimeError(f"{type(self).__name__}.setup(params) must be called before run()")
        self._check_flat("params", params)
        check_run_arguments(params, 0 if steps is None else steps)
        if seconds is not None:
            check_positive("seconds", seconds)
        elif steps is None:
            raise ValueError("run() needs steps or seconds (or both)")
        world, poller = self.topology.world, Poller(max_sleep)
        started = time.perf_counter()
        if world.size == 1:
            book = self._new_book()
            self._link = _SelfLink(book)
            self._run_worker(params, worker_fn, steps, seconds)
            record = book.record()
        else:
            if world.rank == SERVER:
                record = self._serve(params, poller)
            else:
                self._link = _ServerLink(world, self._reply, self._copies, poller)
                self._run_worker(params, worker_fn, steps, seconds)
                record = None
            record = world.bcast_obj(record, root=SERVER)
        return AsyncLSGDResult.from_record(record, time.perf_counter() - started, poller.idle_seconds)

    def _new_book(self) -> LeaderBook:
        return LeaderBook(self._worker_groups(), self.period, self.global_period, (self.pull_local > 0, self.pull_global > 0))

    def _run_worker(self, params: np.ndarray, worker_fn: WorkerFn, steps: Optional[int], seconds: Optional[float]) -> None:
        """A worker's loop: its steps until ``steps`` or ``seconds`` run out, then :meth:`finish`."""
        grad = np.empty_like(params)
        self._first_step, self._reported = self.steps, 0
        deadline = math.inf if seconds is None else time.perf_counter() + seconds
        k = 0
        while (steps is None or k < steps) and time.perf_counter() < deadline:
            loss = worker_fn(params, k, grad)
            self.step(params, grad, loss=loss)
            k += 1
        self.finish(params)

    def _serve(self, params: np.ndarray, poller: Poller) -> Dict[str, Any]:
        """The server: run the loop, then hold the final global leader's parameters."""
        server = _Server(self.topology.world, self._new_book(), params, self._copies, poller)
        server.run()
        if server.book.global_leader >= 0:
            params[...] = server.latest[server.book.global_leader].payload
        return server.book.record()
