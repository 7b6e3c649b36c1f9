"""How a rank waits for a nonblocking operation: spinning in MPI, or polling and sleeping.

MPI libraries wait by spinning: MPICH's ``MPI_Wait`` polls its queues on a
full core until the operation completes.  With one rank per core that is the
fastest wait.  When a node runs more ranks than it has cores, a rank that
spins in ``Wait`` takes the core from a rank that is still computing; torch's
gloo blocks in the kernel instead.

The *wait policy* of a :class:`~mpiopt.comm.Comm` decides how
:meth:`Request.Wait <mpiopt.comm.Request.Wait>` waits:

``active`` (default)
    ``MPI_Wait`` (the MPI library's own spinning wait).
``passive``
    poll with ``MPI_Test`` for :data:`SPIN_SECONDS`, then sleep between
    polls, doubling the pause from :data:`FIRST_PAUSE` up to
    :data:`LONGEST_PAUSE` (:class:`Backoff`); each poll also advances the
    operation, which MPI does only inside MPI calls.

Passive waiting pays where ranks outnumber cores and the bytes cross a
network, whose kernel moves them while the rank sleeps (docs/benchmarks-ddp.md
has the overlap's numbers on the emulated link).  It costs where both sides
must poll to move the bytes, as MPICH's shared-memory transfers do (DaSGD's
small averages in ``tools/run.sh`` slowed down).  Hence not the default.

The policy comes from ``Comm(wait_policy=...)``, else from the environment
variable :data:`WAIT_POLICY_ENV`.  It changes no result, only how the time
is spent: polling completes the same operation as ``MPI_Wait``.  Blocking
collectives (``Comm.Allreduce``, ...) are ``MPI_`` calls of their own and
wait as the library does whatever the policy.
"""

from __future__ import annotations

import os
import time
from typing import Optional

__all__ = ["WAIT_POLICY_ENV", "WAIT_POLICIES", "Backoff", "check_wait_policy"]

#: Environment variable giving the wait policy when ``Comm`` gets none.
WAIT_POLICY_ENV = "MPIOPT_WAIT_POLICY"
#: The policies a user may ask for.
WAIT_POLICIES = ("active", "passive")
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
    """``"active"`` or ``"passive"``: ``policy``, or when None :data:`WAIT_POLICY_ENV`, else ``"active"``.

    This rank's choice only; :class:`~mpiopt.comm.Comm` decides it with the
    other ranks, so that a bad value on any rank raises the same
    ``ValueError`` (naming the rank and the value) on every rank.  Ranks may
    choose differently: the policy is how a rank waits, not what it
    computes.
    """
    source = "wait_policy" if policy is not None else WAIT_POLICY_ENV
    asked = policy if policy is not None else os.environ.get(WAIT_POLICY_ENV, "active")
    if isinstance(asked, str):
        asked = asked.strip().lower() or "active"
    if asked not in WAIT_POLICIES:
        raise ValueError(f"{source} must be one of {', '.join(WAIT_POLICIES)}; got {asked!r}")
    return asked
