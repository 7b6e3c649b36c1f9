"""How a rank waits for a nonblocking operation: spinning in MPI, or polling and sleeping.

MPI libraries wait by spinning: MPICH's ``MPI_Wait`` polls its network
queues on a full core until the operation completes.  With one rank per core
that is the fastest wait.  When a node runs more ranks than it has cores
(a laptop, a CI machine, an oversubscribed test allocation), a rank that spins
in ``Wait`` takes the core from a rank that is still computing, so everybody's
step waits for the slowest rank twice.  torch's gloo blocks in the kernel
instead, which is one reason DDP beats an MPI step on such a node.

The *wait policy* of a :class:`~mpiopt.comm.Comm` decides how
:meth:`Request.Wait <mpiopt.comm.Request.Wait>` waits:

``active``
    ``MPI_Wait`` (the MPI library's own spinning wait).
``passive``
    poll with ``MPI_Test`` for :data:`SPIN_SECONDS`, then sleep between
    polls, doubling the pause from :data:`FIRST_PAUSE` up to
    :data:`LONGEST_PAUSE` (:class:`Backoff`); each poll also advances the
    operation, which MPI does only inside MPI calls.
``auto`` (default)
    ``passive`` on a node whose ranks (of the communicator being wrapped)
    outnumber the CPUs they may run on together, ``active`` elsewhere.

The policy comes from ``Comm(wait_policy=...)``, else from the environment
variable :data:`WAIT_POLICY_ENV`.  It changes no result, only how the time
is spent: polling completes the same operation as ``MPI_Wait``.  Blocking
collectives (``Comm.Allreduce``, ...) are ``MPI_`` calls of their own and
wait as the library does whatever the policy.
"""

from __future__ import annotations

import os
import time
from typing import Iterable, List, Optional

from mpi4py import MPI

__all__ = ["WAIT_POLICY_ENV", "WAIT_POLICIES", "Backoff", "choose_wait_policy", "resolve_wait_policy"]

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
    """Pauses between polls: none for ``spin`` seconds, then sleeps doubling up to ``longest``.

    Call :meth:`pause` after each poll that found nothing to do.  The longest
    pause bounds how late a completion is noticed (0.5 ms by default, under 1 %
    of a transfer worth overlapping); ``longest=0`` never sleeps.

    Parameters
    ----------
    longest : float
        Longest pause in seconds (>= 0).
    spin : float
        Seconds of polling without sleeping, from construction.
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


def choose_wait_policy(policy: str, ranks_on_node: int, cpus_of_node_ranks: Iterable[Iterable[int]]) -> str:
    """The policy ``"active"`` or ``"passive"`` that ``policy`` means for one node.

    Parameters
    ----------
    policy : str
        One of :data:`WAIT_POLICIES`.
    ranks_on_node : int
        Ranks of the communicator on this node.
    cpus_of_node_ranks : iterable of iterables of int
        Each of those ranks' CPUs (its affinity mask); ``auto`` is passive
        when the ranks outnumber the CPUs of all their masks together.
    """
    if policy not in WAIT_POLICIES:
        raise ValueError(f"wait policy must be one of {', '.join(WAIT_POLICIES)}; got {policy!r}")
    if policy != "auto":
        return policy
    cpus = set().union(*(set(c) for c in cpus_of_node_ranks))
    return "passive" if ranks_on_node > len(cpus) else "active"


def _affinity() -> List[int]:
    """The CPUs this process may run on (all of the machine's where the OS cannot say)."""
    try:
        return sorted(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return list(range(os.cpu_count() or 1))


def resolve_wait_policy(policy: Optional[str], comm: MPI.Intracomm) -> str:
    """``"active"`` or ``"passive"``: what ``policy`` means for this rank of ``comm``.

    ``policy`` None takes :data:`WAIT_POLICY_ENV`, else ``auto``.  Collective
    over ``comm``: one Allgather of each rank's policy, host and CPU mask,
    so that ``auto`` sees the node's ranks and a bad value on any rank raises
    the same ``ValueError`` (naming the rank and the value) on every rank
    instead of leaving the others waiting.  Ranks may choose differently:
    the policy is how a rank waits, not what it computes.
    """
    source = "wait_policy" if policy is not None else WAIT_POLICY_ENV
    asked = policy if policy is not None else os.environ.get(WAIT_POLICY_ENV, "auto")
    if isinstance(asked, str):
        asked = asked.strip().lower() or "auto"
    entries = comm.allgather((asked, source, MPI.Get_processor_name(), _affinity()))
    for rank, (value, named, _, _) in enumerate(entries):
        if value not in WAIT_POLICIES:
            raise ValueError(f"{named} must be one of {', '.join(WAIT_POLICIES)}; got {value!r} on rank {rank}")
    mine, _, host, _ = entries[comm.Get_rank()]
    masks = [mask for _, _, other, mask in entries if other == host]
    return choose_wait_policy(mine, len(masks), masks)
