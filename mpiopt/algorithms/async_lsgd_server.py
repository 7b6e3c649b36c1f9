"""The server of asynchronous LSGD: its book of steps, rounds, leaders and their copies (:class:`LeaderBook`).

The policy :mod:`mpiopt.asyncrt` runs on world rank 0, and the record of a run (:class:`AsyncLSGDResult`);
the book does no MPI of its own.  Notes: docs/algorithm-notes.md.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Mapping, NamedTuple, Optional, Tuple

import numpy as np

from ..asyncrt import Message, Policy, Reply
from ..asyncrt.messages import LAST, PULL_GLOBAL, PULL_LOCAL, STOP, UPLOAD
from ..asyncrt.state import state_array, state_count
from .lsgd_rule import elect

__all__ = ["LeaderBook", "Answer", "AsyncLSGDResult", "LOCAL", "GLOBAL"]

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

    def drop(self, w: int) -> None:
        """Worker ``w`` is lost (survival on): it runs no more, leaves its scopes (each re-elects its leader, who is
        asked for a copy), owes and is owed nothing; its latest upload serves the pulls its scopes owe until the new
        leader's arrives (its parameters stay a valid target)."""
        self.finished[w], self.want_upload[w] = True, False
        self.requested.pop(w, None)
        self.owed[w] = -1
        for scope in (self.group[w], _WORLD):
            self.members[scope].remove(w)
            if self.leader[scope] == w:
                self.leader[scope] = -1
            self._elect(scope)

    def renumbered(self, kept: List[int], groups: Mapping[int, int], period: int, global_period: int) -> "LeaderBook":
        """This book for the survivors of a lost worker, between runs: ``kept`` their ranks here, in the order of
        their new ranks, ``groups`` the new worker ranks' group indices.  Tables, leaders, sources and copies follow
        them; a lost rank's leadership or copy is forgotten (its scope elects again at the next report)."""
        book = LeaderBook(groups, period, global_period, self.pulls_on)
        new = {old: i for i, old in enumerate(kept)}
        # Rounds go on at the smaller world's cadence from its next multiple: no burst of rounds opened at once.
        book.total = self.total
        book.rounds = [max(r, self.total // every) for r, every in zip(self.rounds, book.every)]
        for key in self._TABLES:
            setattr(book, key, getattr(self, key)[kept].copy())
        book.latest = {new[w]: copy for w, copy in self.latest.items() if w in new}
        for scope in book.members:
            leader = new.get(self.leader.get(scope, -1), -1)
            if leader < 0:  # a lost leader: the survivors elect one, whose last upload (its LAST) serves its scope
                leader = elect((m, book.loss[m]) for m in book.members[scope])
            source = new.get(self.source.get(scope, -1), -1)
            book.leader[scope] = leader
            book.source[scope] = leader if source < 0 and leader in book.latest else source
        return book

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
    """The outcome of :meth:`~mpiopt.algorithms.async_lsgd.AsyncLSGD.run`: the same on every rank except the two times.

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
