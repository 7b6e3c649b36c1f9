"""How a rank waits for a nonblocking operation: spinning in ``MPI_Wait`` (``active``) or polling and sleeping (``passive``).

Spinning takes the core from a rank still computing when ranks outnumber cores; ``auto`` picks ``passive``
only where that and a network both hold.  The policy changes no result.  Details: docs/internals-comm.md.
"""

from __future__ import annotations

import os
import time
from typing import Any, Mapping, Optional

__all__ = ["WAIT_POLICY_ENV", "WAIT_POLICIES", "Backoff", "check_wait_policy", "auto_wait_policy", "wait_policy_here", "network_only"]

#: Environment variable giving the wait policy when ``Comm`` gets none.
WAIT_POLICY_ENV = "MPIOPT_WAIT_POLICY"
#: The policies a user may ask for.
WAIT_POLICIES = ("auto", "active", "passive")
#: Poll without sleeping this long first: a short operation completes within it.
SPIN_SECONDS = 1e-4
#: First and longest pause between two polls once spinning is over (seconds).
FIRST_PAUSE = 1e-5
LONGEST_PAUSE = 5e-4


class Backoff:
    """Pauses between polls: none for ``spin`` seconds, then sleeps doubling up to ``longest`` (0: never sleep).

    Call :meth:`pause` after each poll that found nothing; ``longest`` bounds how late a completion is noticed.
    """

    def __init__(self, longest: float = LONGEST_PAUSE, spin: float = SPIN_SECONDS) -> None:
        if not longest >= 0:
            raise ValueError(f"longest must be >= 0 seconds, got {longest!r}")
        self.longest = float(longest)
        self._spin_until = time.perf_counter() + spin
        self._pause = min(FIRST_PAUSE, self.longest)

    def pause(self) -> None:
        """Sleep the current pause (once the spinning time is over) and double it."""
        if self.longest and time.perf_counter() > self._spin_until:
            time.sleep(self._pause)
            self._pause = min(2 * self._pause, self.longest)


def check_wait_policy(policy: Optional[str]) -> str:
    """One of :data:`WAIT_POLICIES`: ``policy``, else :data:`WAIT_POLICY_ENV`, else ``"auto"``; this rank's choice only."""
    source = "wait_policy" if policy is not None else WAIT_POLICY_ENV
    asked = policy if policy is not None else os.environ.get(WAIT_POLICY_ENV, "auto")
    if isinstance(asked, str):
        asked = asked.strip().lower() or "auto"
    if asked not in WAIT_POLICIES:
        raise ValueError(f"{source} must be one of {', '.join(WAIT_POLICIES)}; got {asked!r}")
    return asked


def network_only(environ: Optional[Mapping[str, str]] = None) -> bool:
    """Whether the MPI library is told to move every byte through its network transport, even within a node."""
    env = os.environ if environ is None else environ
    for name in ("MPIR_CVAR_NOLOCAL", "MPIR_CVAR_CH4_NOLOCAL"):
        if env.get(name, "").strip().lower() in ("1", "true", "yes", "on"):
            return True
    btl = env.get("OMPI_MCA_btl", "").replace(" ", "")
    if not btl:
        return False
    shared = {"sm", "vader"}
    if btl.startswith("^"):
        return bool(shared & set(btl[1:].split(",")))
    return not shared & set(btl.split(","))


def auto_wait_policy(node_ranks: int, crosses_network: bool, cpus: Optional[int] = None) -> str:
    """``"passive"`` when ``node_ranks`` outnumber the node's ``cpus`` and the bytes cross a network; else ``"active"``."""
    cpus = (os.cpu_count() or 1) if cpus is None else cpus
    return "passive" if node_ranks > cpus and (crosses_network or network_only()) else "active"


def wait_policy_here(comm: Any) -> str:
    """The ``auto`` wait policy's choice for this rank of mpi4py ``comm`` (a collective call: host names and a shared-memory split).

    Ranks with this rank's host name share its CPUs; their bytes cross a
    network where some rank is on another host, or where the MPI library
    puts fewer of them in one shared-memory group than share the host
    (MPICH's ``MPIR_CVAR_NOLOCAL`` does).
    """
    from mpi4py import MPI

    hosts = comm.allgather(MPI.Get_processor_name())
    node = comm.Split_type(MPI.COMM_TYPE_SHARED, key=comm.Get_rank())
    shared = node.Get_size()
    node.Free()
    here = hosts.count(hosts[comm.Get_rank()])
    return auto_wait_policy(here, crosses_network=len(set(hosts)) > 1 or shared < here)
