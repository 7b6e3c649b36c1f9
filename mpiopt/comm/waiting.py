"""How a rank waits for a nonblocking operation: spinning in MPI, or polling and sleeping.

MPI libraries wait by spinning: MPICH's ``MPI_Wait`` polls its queues on a
full core until the operation completes.  With one rank per core that is the
fastest wait.  When a node runs more ranks than it has cores, a rank that
spins in ``Wait`` takes the core from a rank that is still computing; torch's
gloo blocks in the kernel instead.

The *wait policy* of a :class:`~mpiopt.comm.Comm` decides how
:meth:`Request.Wait <mpiopt.comm.Request.Wait>` waits:

``auto`` (default)
    ``passive`` where both pay off together: this node runs more ranks of
    the communicator than it has CPUs, and the bytes cross a network (the
    communicator spans several hosts, or the MPI library is told to use no
    shared memory between ranks of one host); ``active`` elsewhere.
``active``
    ``MPI_Wait`` (the MPI library's own spinning wait).
``passive``
    poll with ``MPI_Test`` for :data:`SPIN_SECONDS`, then sleep between
    polls, doubling the pause from :data:`FIRST_PAUSE` up to
    :data:`LONGEST_PAUSE` (:class:`Backoff`); each poll also advances the
    operation, which MPI does only inside MPI calls.

Passive waiting pays where ranks outnumber cores and the bytes cross a
network, whose kernel moves them while the rank sleeps: a rank spinning in
``MPI_Wait`` takes the core another rank needs to compute or to push its
bytes (docs/benchmarks-ddp.md has the numbers on the emulated link).  It
costs where both sides must poll to move the bytes, as MPICH's
shared-memory transfers do (the quick start's ``sgd`` ran 3.4 times
slower), and gains nothing where every rank has a core of its own.

The policy comes from ``Comm(wait_policy=...)``, else from the environment
variable :data:`WAIT_POLICY_ENV`.  It changes no result, only how the time
is spent: polling completes the same operation as ``MPI_Wait``.  Blocking
collectives (``Comm.Allreduce``, ...) are ``MPI_`` calls of their own and
wait as the library does whatever the policy.
"""

from __future__ import annotations

import os
import time
from typing import Mapping, Optional

__all__ = ["WAIT_POLICY_ENV", "WAIT_POLICIES", "Backoff", "check_wait_policy", "auto_wait_policy", "network_only"]

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


def check_wait_policy(policy: Optional[str]) -> str:
    """One of :data:`WAIT_POLICIES`: ``policy``, or when None :data:`WAIT_POLICY_ENV`, else ``"auto"``.

    This rank's choice only; :class:`~mpiopt.comm.Comm` decides it with the
    other ranks, so that a bad value on any rank raises the same
    ``ValueError`` (naming the rank and the value) on every rank.  Ranks may
    choose differently: the policy is how a rank waits, not what it
    computes.
    """
    source = "wait_policy" if policy is not None else WAIT_POLICY_ENV
    asked = policy if policy is not None else os.environ.get(WAIT_POLICY_ENV, "auto")
    if isinstance(asked, str):
        asked = asked.strip().lower() or "auto"
    if asked not in WAIT_POLICIES:
        raise ValueError(f"{source} must be one of {', '.join(WAIT_POLICIES)}; got {asked!r}")
    return asked


def network_only(environ: Optional[Mapping[str, str]] = None) -> bool:
    """Whether the MPI library is told to move every byte through its network transport, even within a node.

    MPICH: ``MPIR_CVAR_NOLOCAL`` (or ``MPIR_CVAR_CH4_NOLOCAL``) set true;
    Open MPI: ``OMPI_MCA_btl`` a list without its shared-memory transport
    (``sm``, formerly ``vader``), or an exclusion (``^sm``) of it.
    """
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
    """The ``auto`` policy's choice for a rank whose node runs ``node_ranks`` ranks of its communicator.

    ``"passive"`` when they outnumber the node's ``cpus`` (default:
    ``os.cpu_count()``) and the bytes cross a network (``crosses_network``,
    or :func:`network_only`); else ``"active"``.
    """
    cpus = (os.cpu_count() or 1) if cpus is None else cpus
    return "passive" if node_ranks > cpus and (crosses_network or network_only()) else "active"
