"""Processes started in lost ranks' places, joined with the survivors into one world (``--on-failure respawn``).

The survivors start them with :meth:`Topology.spawn`; both sides then merge the link between them into one
intracommunicator (the survivors first), over which the survivors' rank 0 hands every rank what it needs, and a
:class:`Topology` is built on it.  The links stay open until the end (:func:`disconnect`): MPI's disconnect is
collective over both sides of each.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Any, Iterable, List, Optional, Tuple

from mpi4py import MPI

__all__ = ["JOINS", "Joined", "disconnect", "in_order", "join_as_replacement", "merge_with_replacements",
           "merge_with_survivors", "replacement_args", "spawn_replacements", "started_by_survivors", "to_join", "REPLACEMENT"]

#: The links of this process's joins under ``Topology(on_failure="respawn")``, closed as MPI finalizes.
JOINS: List[MPI.Intercomm] = []
#: The interpreter option (``-X``) that marks a process started in a lost rank's place by :meth:`Topology.recover`.
REPLACEMENT = "mpiopt_replacement"


@dataclass(frozen=True)
class Joined:
    """What the survivors' :meth:`Topology.recover` hands the processes it started (``on_failure="respawn"``)."""

    #: The ranks they replace, numbered as in the job's first world, in the replacements' order (which come after
    #: the survivors in the world rebuilt with them).
    replaced: List[int]
    #: The group size the world is rebuilt with (the islands' size; None: the nodes).
    group_size: Optional[int]
    #: Whether islands were kept whole: the world is put in their order (:func:`in_order`), and their ranks move
    #: together, each keeping its place.
    islands: bool
    #: The survivors' ``on_failure``: a replacement's own may differ (``mpiexec -x`` does not reach it).
    on_failure: str


def spawn_replacements(comm: MPI.Intracomm, args: List[str],
                       hosts: List[Optional[str]]) -> Tuple[Optional[MPI.Intercomm], str, Optional[str]]:
    """Start one process of ``python ARGS`` per entry of ``hosts`` (collective over the survivors' ``comm``) on the
    lost ranks' host: the link to them, or None and MPI's reason where none could start; and why they could not start
    there (None: they did), the launcher then placing them, as it does where the ranks were on several hosts or one is
    unknown (None).  A lost rank's own host keeps the nodes' rank counts, and with them the exchanges' cost: a node
    holding one rank more than before made an Allreduce across the emulated link several times slower
    (docs/failures.md).  Open MPI's launcher still counts a lost process's slot and cores, so they go there
    oversubscribed and unbound; it maps one spawn's processes onto one host list by its own order, so one host only."""
    places = set(hosts)
    misplaced = None if len(places) == 1 and None not in places else f"they were on {len(places)} hosts"
    if misplaced is None:
        info = MPI.Info.Create()
        try:
            for key, value in (("host", hosts[0]), ("map_by", ":OVERSUBSCRIBE"), ("bind_to", "none")):
                info.Set(key, value)
            return comm.Spawn(sys.executable, args=args, maxprocs=len(hosts), root=0, info=info), "", None
        except MPI.Exception as error:  # a host the launcher does not know by that name: its own placement
            misplaced = error.Get_error_string()
        finally:
            info.Free()
    try:
        return comm.Spawn(sys.executable, args=args, maxprocs=len(hosts), root=0), "", misplaced
    except MPI.Exception as error:
        return None, error.Get_error_string(), misplaced


def merge_with_replacements(link: MPI.Intercomm, handed: Any) -> MPI.Intracomm:
    """On the survivors (collective with the processes started through ``link``): the world they form together, the
    survivors first in their order, after ``handed`` (picklable) went from the survivors' rank 0 to every rank."""
    merged = link.Merge(high=False)
    merged.bcast(handed, root=0)
    return merged


def started_by_survivors() -> bool:
    """Whether this process was started by survivors (:meth:`Topology.spawn`), not by a launcher."""
    return MPI.Comm.Get_parent() != MPI.COMM_NULL


def merge_with_survivors() -> Tuple[MPI.Intercomm, MPI.Intracomm, Any]:
    """In a process the survivors started (collective with them): the link to them, the world formed with them (this
    process after the survivors) and what their rank 0 handed over (:func:`merge_with_replacements`)."""
    link = MPI.Comm.Get_parent()
    merged = link.Merge(high=True)
    return link, merged, merged.bcast(None, root=0)


def in_order(merged: MPI.Intracomm, place: int) -> MPI.Intracomm:
    """``merged`` with its ranks in the order of each one's ``place`` (collective); ``merged`` is freed."""
    ordered = merged.Split(0, place)
    merged.Free()
    return ordered


def disconnect(links: Iterable[MPI.Intercomm]) -> None:
    """Close the links to the processes a join started, or to those that started this one (collective over both sides
    of each: every one of them must reach it, or have been lost)."""
    for link in links:
        link.Disconnect()


def replacement_args() -> List[str]:
    """The interpreter's arguments for a process of this program in a lost rank's place: this one's, marked."""
    args = list(sys.orig_argv[1:])
    for i in range(len(args) - 1):  # a replacement starting others: its own mark once only
        if args[i:i + 2] == ["-X", REPLACEMENT]:
            del args[i:i + 2]
            break
    return ["-X", REPLACEMENT, *args]


def to_join() -> bool:
    """Whether :meth:`Topology.recover` started this process (:func:`replacement_args`) and it has not joined the
    survivors yet (:func:`join_as_replacement`)."""
    return REPLACEMENT in sys._xoptions and not JOINS and started_by_survivors()


def join_as_replacement() -> Tuple[MPI.Intracomm, int, Optional[int], Joined]:
    """In a process that the survivors' :meth:`Topology.recover` started (collective with them): the world formed with
    them (in the order the survivors put it), the job rank this process takes, the group size to build it with, and
    what they handed over."""
    from .survival import INJECTION

    INJECTION.points.clear()  # the test hook's points name the first world's processes, not this one
    link, merged, joined = merge_with_survivors()
    JOINS.append(link)
    job_rank = joined.replaced[merged.Get_rank() - (merged.Get_size() - len(joined.replaced))]
    if joined.islands:
        merged = in_order(merged, merged.Get_rank())  # the survivors order theirs by island; this process after them
    return merged, job_rank, joined.group_size, joined
