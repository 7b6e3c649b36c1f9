"""``Topology``: the world, its groups (nodes, or emulated ones of ``MPIOPT_GROUP_SIZE`` ranks) and their leaders.

Creating one installs the abort hooks, so a library user's job ends like a CLI job.
Groups and opting out: docs/internals-comm.md.
"""

from __future__ import annotations

import os
import sys
import traceback
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, Iterator, List, NoReturn, Optional, Tuple

import numpy as np
from mpi4py import MPI

from .abort import ABORT_ENV, abort_job, abort_on_exception
from .buffers import _parse_flag
from .communicator import Comm
from .islands import ISLAND, RAIL, Islands
from .process import host
from .survival import (INJECTION, ON_FAILURE, ON_FAILURE_ENV, IslandLeft, RankLost, Survivable, agreed_ok, faultless,
                       free_quietly, han_caveat, revoke_quietly, shrunk_next, ulfm_problem)
from .finalizing import JOINED, finalize_at_exit
from .joining import (JOINS, Joined, in_order, join_as_replacement, merge_with_replacements, replacement_args,
                      spawn_replacements, to_join)
from .launcher import check_world_size
from .ledger import Ledger

__all__ = ["Topology", "Recovery", "GROUP_SIZE_ENV"]

GROUP_SIZE_ENV = "MPIOPT_GROUP_SIZE"
#: How long a rank whose check failed waits for the others to join the vote
#: of :meth:`Topology.decide` before it concludes that they are stuck
#: in a collective it left.
VOTE_SECONDS = 10.0


def _group_size_from(value: Any, source: str) -> Optional[int]:
    if value is None or (isinstance(value, str) and not value.strip()):
        return None
    try:
        size = int(value)
    except (TypeError, ValueError):
        raise ValueError(f"{source} must be a positive integer, got {value!r}") from None
    if size < 1 or (isinstance(value, float) and value != size):
        raise ValueError(f"{source} must be a positive integer, got {value!r}")
    return size


def _group_size_setting(value: Any) -> Optional[int]:
    size = _group_size_from(value, "group_size")
    return _group_size_from(os.environ.get(GROUP_SIZE_ENV), GROUP_SIZE_ENV) if size is None else size


def _abort_setting(value: Optional[bool]) -> bool:
    if value is not None:
        if not isinstance(value, bool):
            raise TypeError(f"abort_on_error must be True, False or None, got {value!r}")
        return value
    env = os.environ.get(ABORT_ENV, "")
    return _parse_flag(env, ABORT_ENV) if env.strip() else True


def _on_failure_setting(value: Optional[str]) -> str:
    """``on_failure``, else ``MPIOPT_ON_FAILURE``, else abort; ValueError for another value, or one this MPI cannot keep."""
    chosen = value if value is not None else (os.environ.get(ON_FAILURE_ENV, "").strip() or "abort")
    if chosen not in ON_FAILURE:
        raise ValueError(f"on_failure must be one of {', '.join(ON_FAILURE)}, got {chosen!r}")
    problem = ulfm_problem() if chosen != "abort" else None
    if problem is not None:
        raise ValueError(f"on_failure={chosen!r}: {problem}")
    return chosen


@dataclass(frozen=True)
class Recovery:
    """What :meth:`Topology.recover` did: the lost ranks (numbered as in the job's first world), the world's new size,
    the survivors that left with an island that lost a rank (:meth:`Topology.recover`'s ``whole_groups``) and the
    ranks replaced."""

    lost: List[int]
    size: int
    left: List[int] = field(default_factory=list)
    #: Under ``on_failure="respawn"``: the ranks (numbered as in the job's first world) whose places processes
    #: started in took, the world back at its size; empty where none could start.
    replaced: List[int] = field(default_factory=list)


def _outcome(parse: Callable[[], Any]) -> Tuple[Any, Optional[Exception]]:
    """``(value, None)``, or ``(error text, error)`` when ``parse`` rejects its input."""
    try:
        return parse(), None
    except (TypeError, ValueError) as err:
        return f"{type(err).__name__}: {err}", err


class Topology:
    """World, group and leaders communicators sharing one ledger.

    Parameters
    ----------
    group_size : int, optional
        Ranks per emulated node.  Default: ``MPIOPT_GROUP_SIZE``, else the real nodes.
    gpu_aware : bool, optional
        Override the detection of GPU-aware MPI.
    abort_on_error : bool, optional
        Install the abort hooks and let :meth:`raise_or_abort` abort.  Default: ``MPIOPT_ABORT_ON_ERROR``, on.
    on_failure : {"abort", "shrink", "respawn"}, optional
        What a lost rank does: end the job (MPI's default), or raise :class:`~mpiopt.comm.survival.RankLost` on the
        survivors, who :meth:`recover` (needs Open MPI's ULFM: docs/failures.md); under ``"respawn"`` a process of
        the same program starts in each lost rank's place and joins them.  Default: ``MPIOPT_ON_FAILURE``, abort.
    job_rank : int, optional
        This process's rank in the job's first world (:attr:`first_ranks`): a replacement's is the lost rank's.
        Default: its rank in ``MPI.COMM_WORLD``.

    In a process that survivors started under ``on_failure="respawn"`` (:meth:`recover`), the first Topology built
    over the default world (``comm`` None) joins them instead: its world is theirs, its ``job_rank`` the lost rank's,
    its ``group_size`` and ``on_failure`` theirs, whatever was given.

    Raises
    ------
    ValueError, TypeError
        On every rank, when a setting is invalid on any rank; ``SetupMismatchError`` when ranks differ.
    """

    def __init__(
        self,
        comm: Optional[MPI.Intracomm] = None,
        *,
        group_size: Optional[int] = None,
        gpu_aware: Optional[bool] = None,
        abort_on_error: Optional[bool] = None,
        on_failure: Optional[str] = None,
        job_rank: Optional[int] = None,
    ) -> None:
        # Before any communication, each process alone: a launcher that started another number of
        # processes than MPI's world holds (LauncherMismatchError, mpiopt.comm.launcher).
        check_world_size(MPI.COMM_WORLD.Get_size())
        survive, survive_problem = _outcome(lambda: _on_failure_setting(on_failure))
        joined = None
        if comm is None and to_join():  # survivors' recover() started this process in a lost rank's place
            comm, job_rank, group_size, joined = join_as_replacement()
            survive, survive_problem = joined.on_failure, None
            finalize_at_exit()
        self.ledger = Ledger()
        self.faults = Survivable()  # every communicator's: a lost rank revokes them all (on_failure other than abort)
        self.world = Comm(comm, name="world", ledger=self.ledger, gpu_aware=gpu_aware, faults=self.faults)
        abort, abort_problem = _outcome(lambda: _abort_setting(abort_on_error))
        if abort is True:
            abort_on_exception(override=False)
        size, size_problem = _outcome(lambda: _group_size_setting(group_size))
        first = MPI.COMM_WORLD.Get_rank() if job_rank is None else job_rank
        self._start(comm, abort, size, survive, first, (abort_problem, size_problem, survive_problem), joined)
        if joined is not None:
            comm.Free()  # this topology's own duplicates hold the world
        if survive != "abort":
            self.faults.on_fault = self._revoke_all

    def _start(self, comm: Optional[MPI.Intracomm], abort: bool, size: Optional[int], survive: str, first: int,
               problems: Tuple[Optional[Exception], ...] = (), joined: Optional[Joined] = None) -> None:
        """On :attr:`world` (collective): the settings agreed, then the first of ``problems`` raised on every rank; the
        job ranks (``first``: this process's) gathered and the groups built.  The constructor's, and after a respawn
        the survivors' and the replacements' on the world rebuilt with them, call for call (``joined``: what the
        survivors handed over, or None at the job's start, where a respawn run on several nodes is told of coll/han)."""
        try:
            # What each rank made of its settings is agreed before any error is
            # raised: a bad value on one rank must not leave the others below.
            self.world.agree({"abort_on_error": abort, "group_size": size, "on_failure": survive}, what="topology settings")
            for problem in problems:
                if problem is not None:
                    raise problem
        except Exception:
            self.world.Free()
            raise
        self.abort_on_error: bool = abort
        self.group_size_setting = size
        #: What a lost rank does (:data:`~mpiopt.comm.survival.ON_FAILURE`).
        self.on_failure: str = survive
        #: The job's first world rank of each of this world's ranks (a recovery renumbers the survivors).
        self.first_ranks: List[int] = self.world.allgather_obj(first) if survive != "abort" else []
        #: Each world rank's host (``MPI_Get_processor_name``).
        self.hosts: List[str] = self.world.allgather_obj(host())  # before _build, whose ledger starts the algorithms'
        #: The hosts of the job ranks lost (or left with their islands) so far: :meth:`spawn` starts replacements there.
        self._lost_hosts: Dict[int, str] = {}
        if survive != "abort" and joined is None:
            caveat = han_caveat(spans_nodes=len(set(self.hosts)) > 1)
            if caveat and self.world.rank == 0:
                print(f"mpiopt: {caveat}", file=sys.stderr, flush=True)
        self._build(comm, None if size is None else self.world.rank // size)
        #: The world ranks of the processes that took lost ranks' places at the latest :meth:`recover` (on them: at
        #: their start), until the first algorithm set up after it has handed them its state (:attr:`joined_from`).
        self.joined: List[int] = [] if joined is None else list(range(self.size - len(joined.replaced), self.size))
        self._joined_block = size if joined is not None and joined.islands else 1
        if joined is not None:
            JOINED.add(self)

    @property
    def joining(self) -> bool:
        """Whether this process took a lost rank's place and its first algorithm has yet to take the survivors' state."""
        return self.rank in self.joined

    def _build(self, comm: Optional[MPI.Intracomm], group_color: Optional[int]) -> None:
        """Groups (the nodes, or ``group_color``'s), leaders, the control communicator, from :attr:`world` (collective)."""
        self._rank, self._size = self.world.rank, self.world.size  # still known after Free()
        if group_color is None:
            self.group = self.world.Split_shared("group")
        else:
            self.group = self.world.Split(group_color, self.world.rank, "group")
        is_leader = self.group.rank == 0
        self.leaders = self.world.Split(0 if is_leader else -1, self.world.rank, "leaders")
        # Group index = the leader's rank among the leaders, told to the group.
        self.group_index = self.group.bcast_obj(self.leaders.rank if is_leader else None)
        self.num_groups = self.group.bcast_obj(self.leaders.size if is_leader else None)
        self.group_ranks: List[int] = self.group.allgather_obj(self.world.rank)
        #: Every group's size, in group order (islands need them equal).
        self.group_sizes: List[int] = [s for s in self.world.allgather_obj(self.group.size if is_leader else 0) if s]
        self._islands: Optional[Islands] = None  # made at the first islands() call
        # Votes on errors go through their own communicator, so that one never
        # matches a collective that an algorithm left half done; its traffic is
        # not the algorithms' (a ledger of its own).
        self._control = Comm(comm, name="control", ledger=Ledger(), gpu_aware=False, faults=self.faults)
        self.ledger.reset()  # set-up traffic is not the algorithms'

    # -- a lost rank (comm/survival.py) ----------------------------------------------------------------------------
    def _communicators(self) -> List[Comm]:
        islands = [] if self._islands is None else [self._islands.rail, self._islands.island]
        return [c for c in (*islands, self._control, self.leaders, self.group, self.world) if c is not None]

    def _revoke_all(self) -> None:
        """Revoke every communicator of this topology: the survivors blocked in any of them learn of the loss."""
        for comm in self._communicators():
            revoke_quietly(comm._comm)

    def all_ok(self, ok: bool) -> bool:
        """Whether every survivor passes ``ok`` and no rank of the world is known to be lost (ULFM's fault-tolerant
        agreement on the world: it completes on a revoked communicator and despite failures, the same answer on
        every survivor).  A collective that a rank's death broke may still return success with a wrong result (seen
        across nodes), so any loss fails the phase on every survivor, whether or not an error reached it."""
        return agreed_ok(self.world._comm, ok)

    @contextmanager
    def agreed(self, what: str, undo: Optional[Callable[[], None]] = None) -> Iterator[None]:
        """Around a phase (``what``) that the survivors of a lost rank must leave alike: with survival on, they agree
        at its end whether every one of them completed it, and where one did not, all ``undo()`` and raise
        :class:`~mpiopt.comm.survival.RankLost`.  A collective that a dead rank breaks may still complete on some
        survivors, which would otherwise go on a phase ahead of the others.  Nothing under ``abort``."""
        if self.on_failure == "abort":
            yield
            return
        try:
            yield
            completed = True
        except RankLost:
            completed = False
        if not self.all_ok(completed):
            if undo is not None:
                undo()
            raise RankLost(f"a rank was lost during {what}; every survivor leaves it")

    def recover(self, whole_groups: Optional[bool] = None) -> Recovery:
        """After :class:`~mpiopt.comm.survival.RankLost`, on every survivor together: shrink the world to the survivors
        and rebuild the groups (each rank in its old group), leaders and control from it.

        ``whole_groups`` (default: whether :meth:`islands` were made here) keeps islands of one size: a group that lost
        a rank leaves whole, and its other ranks raise :class:`~mpiopt.comm.survival.IslandLeft` (every survivor does
        where no group is whole).  Under ``on_failure="respawn"`` processes of this program then take the places of
        the ranks gone, and the world is rebuilt with them at its size (:meth:`_replace`); the first algorithm set up
        after it hands them its state.
        """
        if self.on_failure == "abort":
            raise RuntimeError("recover() needs Topology(on_failure='shrink') or 'respawn'")
        whole_groups = self._islands is not None if whole_groups is None else whole_groups
        self._revoke_all()
        finalize_at_exit()
        color, sizes = self.group_index, self.group_sizes
        base = original = self.world._comm
        first_ranks, host_of = self.first_ranks, dict(zip(self.first_ranks, self.hosts))
        lost: List[int] = []
        left: List[int] = []
        self._islands = None
        # A rank lost while the survivors rebuild is found by the agreement that ends each phase: they shrink again.
        while True:
            shrunk = base.Shrink()
            INJECTION.reached("recover")
            members = MPI.Group.Translate_ranks(shrunk.Get_group(), list(range(shrunk.Get_size())), base.Get_group())
            lost += [first_ranks[r] for r in sorted(set(range(base.Get_size())) - set(members))]
            first_ranks = [first_ranks[r] for r in members]
            kept, leaving = shrunk, False
            if whole_groups:  # each survivor's group: those with fewer survivors than ranks leave
                ok, colors = faultless(lambda: shrunk.allgather(color))
                if ok:
                    broken = {c for c in colors if colors.count(c) != sizes[c]}
                    leaving = color in broken
                    ok, kept = faultless(lambda: shrunk.Split(MPI.UNDEFINED if leaving else 0, shrunk.Get_rank()))
                if not agreed_ok(shrunk, ok):
                    free_quietly(kept if ok and kept is not shrunk else None)
                    base = shrunk_next(base, shrunk, original)
                    continue
                left += [first for first, c in zip(first_ranks, colors) if c in broken]
                first_ranks = [first for first, c in zip(first_ranks, colors) if c not in broken]
                free_quietly(shrunk)
                if leaving:  # every survivor where no group survived whole (IslandLeft.size 0)
                    raise IslandLeft(lost, left, len(first_ranks))
            ok, _ = faultless(lambda: self._rebuild(kept, color))
            if agreed_ok(kept, ok):
                break
            self._revoke_all()
            base = shrunk_next(base, kept, original)
        self.first_ranks, self.hosts = first_ranks, [host_of[first] for first in first_ranks]
        self._lost_hosts.update((first, host_of[first]) for first in lost + left)
        if base is not original:
            free_quietly(base)
        free_quietly(kept)
        self.joined = []
        if self.on_failure == "respawn":
            return self._replace(Recovery(lost, self.size, left), sizes[0] if whole_groups else None)
        return Recovery(lost, self.size, left)

    def _rebuild(self, comm: MPI.Intracomm, color: int) -> None:
        """The world from ``comm`` (the survivors), and its groups, leaders and control (collective)."""
        self.world = Comm(comm, name="world", ledger=self.ledger, gpu_aware=self.world.gpu_aware, faults=self.faults)
        self._build(self.world._comm, color)

    def _replace(self, recovery: Recovery, island_size: Optional[int]) -> Recovery:
        """After the shrink under ``on_failure="respawn"`` (collective on the survivors): processes of this program take
        the places of the lost ranks and of those that left with their islands, and the world is rebuilt with them,
        the survivors first (with islands: in the survivors' islands, then the new ones in blocks of their size).
        Where none can start, the survivors go on alone, as under ``"shrink"`` from then on, and rank 0 says so."""
        replaced = sorted(recovery.lost + recovery.left)
        link, why = self.spawn(replaced, replacement_args())
        if link is None:
            self.on_failure = "shrink"  # said once: later losses shrink too
            if self.rank == 0:
                print(f"mpiopt: on_failure='respawn': no process could start for rank(s) {replaced} ({why}); going on "
                      f"with {self.size} ranks, as 'shrink' would, from here on", file=sys.stderr, flush=True)
            return recovery
        joined = Joined(replaced, island_size or self.group_size_setting, island_size is not None, self.on_failure)
        merged = merge_with_replacements(link, joined)
        JOINS.append(link)
        if island_size is not None:
            merged = in_order(merged, self.group_index * island_size + self.group.rank)
        job_rank, gpu_aware = self.first_ranks[self.rank], self.world.gpu_aware
        self.Free()
        self.world = Comm(merged, name="world", ledger=self.ledger, gpu_aware=gpu_aware, faults=self.faults)
        self._start(merged, self.abort_on_error, joined.group_size, self.on_failure, job_rank, joined=joined)
        merged.Free()
        return Recovery(recovery.lost, self.size, recovery.left, replaced)

    def joined_from(self, rank: int) -> int:
        """The survivor whose parameters and state the process at world rank ``rank`` takes after a respawn (itself,
        for a survivor): replacement ``r`` follows survivor ``r % S`` of the ``S`` survivors, as a resume on more ranks
        does (with islands, the rank in the same place of survivor island ``i % (S / G)``)."""
        survivors = self.size - len(self.joined)
        if rank < survivors:
            return rank
        block = self._joined_block
        return (rank // block) % (survivors // block) * block + rank % block

    def spawn(self, replaced: List[int], args: List[str]) -> "tuple[Optional[MPI.Intercomm], str]":
        """Start a process of ``python ARGS`` in the place of each job rank of ``replaced`` (collective, on a shrunk world),
        on their host, else (ranks on several hosts, a host the launcher refuses; rank 0 says so) where the launcher puts them: the
        intercommunicator to them, or None and MPI's reason where none could start (a launcher that refuses).  Both
        sides then merge into one world (:mod:`.joining`)."""
        hosts = [self._lost_hosts.get(rank) for rank in replaced]
        link, why, misplaced = spawn_replacements(self.world._comm, args, hosts)
        if misplaced is not None and link is not None and self.rank == 0:
            print(f"mpiopt: on_failure='respawn': no process could start on the host of rank(s) {replaced} "
                  f"({', '.join(sorted(set(map(str, hosts))))}: {misplaced}); the launcher placed them instead, and a node "
                  "with more ranks than before slows every exchange that crosses nodes", file=sys.stderr, flush=True)
        return link, why

    @property
    def control(self) -> Comm:
        """The world's ranks on a communicator and ledger of their own, for votes between steps (same calls on every rank).

        They never match a collective an algorithm left half done, and their bytes are not the algorithms'.
        """
        return self._control

    def islands_problem(self) -> Optional[str]:
        """Why this topology's groups cannot be islands (groups of unequal size), with the fix; None when they can."""
        if len(set(self.group_sizes)) == 1:
            return None
        return (
            f"islands must be of one size, and the {self.size} ranks make groups of {self.group_sizes}: launch a multiple "
            f"of the ranks per node, or give group_size (--group-size) a divisor of {self.size}"
        )

    def islands(self) -> Islands:
        """The groups as islands, each one worker (:mod:`.islands`): collective at the first call, the same object after.

        ValueError (on every rank alike, before any communication) when the groups differ in size.
        """
        if self._islands is None:
            problem = self.islands_problem()
            if problem is not None:
                raise ValueError(problem)
            island = self.world.Split(self.group_index, self.world.rank, ISLAND)
            rail = self.world.Split(self.group.rank, self.group_index, RAIL)
            self._islands = Islands(island, rail)
        return self._islands

    @property
    def rank(self) -> int:
        return self._rank

    @property
    def size(self) -> int:
        return self._size

    @property
    def is_leader(self) -> bool:
        return self.leaders is not None

    @property
    def gpu_aware(self) -> bool:
        return self.world.gpu_aware

    def describe(self) -> Dict[str, Any]:
        """This rank's place in the topology, as plain data."""
        return {
            "world_rank": self.world.rank,
            "world_size": self.world.size,
            "group_index": self.group_index,
            "num_groups": self.num_groups,
            "group_rank": self.group.rank,
            "group_size": self.group.size,
            "is_leader": self.is_leader,
            "leaders_size": self.leaders.size if self.leaders is not None else None,
            "host": MPI.Get_processor_name(),
            "wait_policy": self.world.wait_policy,
        }

    # -- errors found on one rank ------------------------------------------------------
    def decide(self, check: Callable[[], Any], what: str, **options: Any) -> Any:
        """Run ``check`` on every rank and decide together on the control communicator; ``check``'s value where all passed.

        A failed rank raises its own error, the others an ``OtherRankError`` naming it.  A failed rank waits at most
        :data:`VOTE_SECONDS`: ranks that do not come are stuck in a collective it left, so it aborts.
        """
        def stuck(error: BaseException) -> NoReturn:
            self.raise_or_abort(error, why=f"the other ranks did not come to the {what} check within {VOTE_SECONDS:g} s")

        return self._control.decide(check, what, stuck_after=VOTE_SECONDS, on_stuck=stuck, **options)

    def any(self, flag: bool) -> bool:
        """Whether any rank passes a true ``flag`` (one byte, collective): for verdicts every rank must act on alike."""
        vote = np.array([flag], dtype=np.uint8)
        self._control.vote(vote)
        return bool(vote[0])

    def raise_or_abort(self, error: BaseException, why: str = "its other ranks may be waiting in a collective") -> NoReturn:
        """Give up on an ``error`` found on this rank alone, where the others may be waiting in a collective.

        With :attr:`abort_on_error` at more than one rank: print it with ``why`` and abort (catching it could not
        release the others); otherwise raise it.
        """
        if not (self.abort_on_error and self.size > 1):
            raise error
        where = "".join(traceback.format_stack()[:-1] + traceback.format_tb(error.__traceback__))
        abort_job(
            f"mpiopt: {type(error).__name__}: {error}\n"
            f"on rank {self.rank} of {self.size}; aborting the job: {why} "
            f"(with Topology(abort_on_error=False) or {ABORT_ENV}=0 it is raised instead).  It happened here:\n{where}"
        )

    def first(self, ranks: int) -> Optional["Topology"]:
        """A Topology of world ranks ``0 .. ranks - 1`` (collective on the world), for training at fewer ranks; None elsewhere."""
        if isinstance(ranks, bool) or not isinstance(ranks, int) or not 1 <= ranks <= self.size:
            raise ValueError(f"ranks must be an integer in [1, {self.size}], got {ranks!r}")
        raw = self.world._comm.Split(0 if self.rank < ranks else MPI.UNDEFINED, self.rank)
        if raw == MPI.COMM_NULL:
            return None
        try:
            return Topology(raw, group_size=self.group_size_setting, gpu_aware=self.gpu_aware, abort_on_error=self.abort_on_error)
        finally:
            raw.Free()  # Topology duplicates it

    def Free(self) -> None:
        """Release the communicators."""
        islands = () if self._islands is None else (self._islands.rail, self._islands.island)
        for comm in (*islands, self._control, self.leaders, self.group, self.world):
            if comm is not None:
                comm.Free()

    def __repr__(self) -> str:
        return (
            f"Topology(rank={self.rank}, size={self.size}, group={self.group_index}/{self.num_groups}, "
            f"group_rank={self.group.rank}/{self.group.size}, leader={self.is_leader})"
        )
