"""``--on-failure respawn``: a process for each lost rank joins the survivors, and all resume from their checkpoint.

The survivors of a lost rank recover as under ``shrink``, save a checkpoint at the shrunk size and leave the run
(:class:`~mpiopt.training.survival.Respawn`).  Here they start one process per lost rank (``MPI_Comm_spawn``, running
:mod:`mpiopt.cli.replacement`), merge with them into a world of the original size, hand them the settings, and every rank
resumes from that checkpoint as a resume on another rank count does (the resize rules): the replacements start with
the survivors' parameters, bitwise.  Where no process can start, the survivors resume at their own size and say so.
What every rank does next is the command's :class:`Plan` (``train``: the one run; ``compare``: its runs from the
broken one on), handed to the replacements as it stands on the survivors.

``python -m mpiopt.cli.replacement`` is the replacements' program: started by the survivors, never by hand.
"""

from __future__ import annotations

import sys
import time
from typing import Any, List, Optional, Protocol, Tuple

from ..comm import Topology
from ..comm.joining import in_order, merge_with_replacements, merge_with_survivors
from ..training.config import TrainConfig
from .session import Session

__all__ = ["Plan", "go_on_with_replacements", "join_survivors"]


class Plan(Protocol):
    """What a command's ranks do from a respawn on (picklable: the survivors hand it to the replacements)."""

    #: The settings the topology is rebuilt with (its group size, what it does with a lost rank).
    config: TrainConfig
    #: The checkpoint the broken run resumes from (None: it starts from step 0).
    resume: Optional[str]

    def go_on(self, session: Session) -> int:
        """Run the rest on ``session``, its report included; the exit code."""


PROGRAM = ["-m", "mpiopt.cli.replacement"]


def go_on_with_replacements(session: Session, respawn: Any, plan: Plan) -> None:
    """On every survivor after a :class:`~mpiopt.training.survival.Respawn` (collective): the broken run of ``plan``
    resumes from the survivors' checkpoint (lost as it started: starts again as it was starting) with processes started
    for the lost ranks, handed ``plan``; where none can start, the survivors go on alone and later losses shrink.  The
    run's wall time counts on from the loss (:attr:`Session.counted_since`)."""
    plan.resume = respawn.checkpoint or plan.resume
    if respawn.checkpoint or session.counted_since is None:  # lost again as the resumed run started: from the first loss
        session.counted_since = respawn.since
    if not _replace_lost(session, respawn, plan):
        plan.config.on_failure = "shrink"  # said once: later losses shrink too


def _replace_lost(session: Session, respawn: Any, plan: Plan) -> bool:
    """Start the replacements, hand them ``plan`` and rebuild the session's topology and data with them (collective);
    False where no process could start (said once)."""
    topology = session.topology
    inter, why = topology.spawn(respawn.replaced, PROGRAM)
    if inter is None:
        if topology.rank == 0:
            print(f"mpiopt: --on-failure respawn: no process could start for {_whose(respawn.lost, respawn.left)} ({why}); "
                  f"going on with {topology.size} ranks, as --on-failure shrink would", file=sys.stderr, flush=True)
        return False
    counted = time.perf_counter() - session.counted_since  # the loss's price so far, for the replacements' clocks
    # Under --islands, the groups' one size (only whole ones survived, in every run); else None, and the replacements
    # follow the survivors as they are.
    size = topology.group_sizes[0] if respawn.islands else None
    merged = merge_with_replacements(inter, (plan, respawn.lost, respawn.left, respawn.replaced, respawn.step, session.out,
                                             session.command, session.ranks_at_start, counted, size))
    session.links.append(inter)
    job_rank = topology.first_ranks[topology.rank]  # a replacement of an earlier loss may be among the survivors
    islands = None if size is None else (topology.group_index * size + topology.group.rank, size)
    topology.Free()
    _rejoin(session, plan.config, merged, job_rank, _whose(respawn.lost, respawn.left), respawn.step, joined=False,
            islands=islands)
    return True


def join_survivors() -> Tuple[Plan, Session]:
    """In a replacement: merge with the survivors who started it, take the plan they hand over, and build the
    topology and data with them (collective).  The plan resumes from their checkpoint."""
    from ..comm.survival import INJECTION

    INJECTION.points.clear()  # the test hook's points name the first world's processes, not this one
    parent, merged, handed = merge_with_survivors()
    plan, lost, left, replaced, step, out, command, ranks_at_start, counted, size = handed
    index = merged.Get_rank() - (merged.Get_size() - len(replaced))  # among the replacements
    job_rank = replaced[index]
    started = time.perf_counter()
    session = Session(None, None, out, command, started, ranks_at_start=ranks_at_start, counted_since=started - counted)
    session.links.append(parent)
    _rejoin(session, plan.config, merged, job_rank, _whose(lost, left), step, joined=True,
            islands=None if size is None else (merged.Get_rank(), size))  # after the survivors: its place
    return plan, session


def _whose(lost: List[int], left: List[int]) -> str:
    """The ranks the replacements take the places of, as the lines say them."""
    return f"lost rank(s) {lost}" + (f" and rank(s) {left} of {'the same island' if len(lost) == 1 else 'their islands'}" if left else "")


def _rejoin(session: Session, config: TrainConfig, merged: Any, job_rank: int, whose: str, step: Optional[int],
            joined: bool, islands: Optional[Tuple[int, int]]) -> None:
    """The session's topology on ``merged`` and its data re-read (collective on the survivors and the replacements;
    ``joined``: this process is a replacement; ``whose``: the ranks replaced, as :func:`_whose` says them).

    With islands (``islands``: this rank's place and the islands' size; None: none to keep) the islands are the
    survivors' whole ones, then the replacements in blocks of that size, in the order of the ranks they replace,
    wherever the launcher put them: grouping by node would make other islands where a node now holds more ranks."""
    from ..training.data import load_data

    if islands is not None:
        merged = in_order(merged, islands[0])
    session.topology = Topology(merged, group_size=config.group_size if islands is None else islands[1],
                                on_failure=config.topology_on_failure, job_rank=job_rank)
    merged.Free()  # the topology's communicators are its own duplicates
    session.dataset = load_data(config, session.topology.world)
    topology = session.topology
    first = topology.first_ranks[topology.rank]
    what = "a replacement for" if joined else "replacements joined for"
    going_on = "starting the run again" if step is None else f"resuming after step {step}"
    print(f"mpiopt: rank {first}: {what} {whose}; the world is {topology.size} ranks again, {going_on}",
          file=sys.stderr, flush=True)
