"""Processes started in lost ranks' places, joined with the survivors into one world (``--on-failure respawn``).

The survivors start them with :meth:`Topology.spawn`; both sides then merge the link between them into one
intracommunicator (the survivors first), over which the survivors' rank 0 hands every rank what it needs, and a
:class:`Topology` is built on it.  The links stay open until the end (:func:`disconnect`): MPI's disconnect is
collective over both sides of each.
"""

from __future__ import annotations

from typing import Any, Iterable, Tuple

from mpi4py import MPI

__all__ = ["disconnect", "in_order", "merge_with_replacements", "merge_with_survivors", "started_by_survivors"]


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
