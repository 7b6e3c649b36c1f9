"""Collective decisions: every rank runs a check and all agree on the outcome, or all raise the same error.

:meth:`Decisions.decide` is mpiopt's one "all agree or all raise" (set-up, settings, checkpoints, resumes);
:func:`differing_lines` its one printer of tables that differ.
"""

from __future__ import annotations

import hashlib
import json
import time
from dataclasses import dataclass
from typing import Any, Callable, List, Mapping, NoReturn, Optional, Sequence, Tuple, Type

import numpy as np
from mpi4py import MPI

from .abort import OtherRankError

__all__ = ["Decisions", "SetupMismatchError", "Failure", "raise_own_or_name_them", "MISSING", "plain", "differing_lines"]


class SetupMismatchError(ValueError):
    """Ranks disagree on something that must be identical everywhere."""


@dataclass(frozen=True)
class Failure:
    """One rank's failed check in a :meth:`Comm.decide`: its rank, the error's type name and message."""

    rank: int
    kind: str
    message: str


def raise_own_or_name_them(what: str) -> Callable[[List[Failure], Optional[BaseException]], BaseException]:
    """:meth:`Comm.decide`'s default: a failed rank raises its own error, the others
    :class:`~mpiopt.comm.abort.OtherRankError` naming every failed rank and its error."""

    def error(failures: List[Failure], own: Optional[BaseException]) -> BaseException:
        if own is not None:
            return own
        return OtherRankError(
            f"the {what} failed on rank {', '.join(str(f.rank) for f in failures)}:\n"
            + "\n".join(f"  rank {f.rank}: {f.kind}: {f.message}" for f in failures)
        )

    return error


def first_failure(kind: Type[BaseException]) -> Callable[[List[Failure], Optional[BaseException]], BaseException]:
    """A :meth:`Comm.decide` error: ``kind`` with the lowest failed rank's message, naming that rank, on every rank."""
    return lambda failures, own: kind(f"{failures[0].message} on rank {failures[0].rank}")


class Decisions:
    """The decisions of a :class:`~mpiopt.comm.Comm` (``self._comm``, ``self.size``, ``self.name``), not recorded in its ledger."""

    _comm: MPI.Intracomm
    size: int
    name: str
    faults: Any  # the communicator's Survivable: where a lost rank's news goes (comm/survival.py)

    def decide(
        self,
        check: Callable[[], Any],
        what: str,
        *,
        catch: Tuple[Type[BaseException], ...] = (TypeError, ValueError, RuntimeError, OSError),
        agree_on: Any = None,
        error: Optional[Callable[[List[Failure], Optional[BaseException]], BaseException]] = None,
        stuck_after: Optional[float] = None,
        on_stuck: Optional[Callable[[BaseException], NoReturn]] = None,
    ) -> Any:
        """Run ``check`` on every rank and decide together: its value where every rank passed, else an error on every rank.

        The one collective decision of mpiopt: set-up and argument
        agreement, settings, checkpoints, the wait policy all go through it.
        It costs one Allreduce of a byte (of 65 with ``agree_on``) when all
        is well; the failures' texts (or the disagreeing values) travel only
        when something failed.  It is not recorded in the ledger: deciding
        is not an algorithm's traffic.

        Parameters
        ----------
        check : callable
            This rank's check; its return value is returned.
        what : str
            The decision, for messages (``"sgd set-up"``).
        catch : tuple of exception types
            What counts as this rank's failure (anything else propagates at
            once, as a bug would).
        agree_on : JSON-serialisable, optional
            A value every rank must pass alike; when ranks differ, every rank
            raises :class:`SetupMismatchError` naming each differing key and
            each rank's value (before any failure is reported).
        error : callable, optional
            ``error(failures, own) -> exception`` to raise on every rank when
            some rank failed (``own``: this rank's error or None).  Default:
            :func:`raise_own_or_name_them`.
        stuck_after, on_stuck : float, callable, optional
            A rank that failed waits at most ``stuck_after`` seconds for the
            others, then calls ``on_stuck(its error)`` (which ends the job):
            ranks that do not come are stuck in a collective it left.
        """
        try:
            value, own = check(), None
        except catch as err:
            value, own = None, err
        vote = np.zeros(1 if agree_on is None else 65, np.uint8)
        vote[0] = own is not None
        if agree_on is not None:
            text = json.dumps(agree_on, sort_keys=True, default=repr)
            digest = np.frombuffer(hashlib.sha256(text.encode()).digest(), dtype=np.uint8)
            vote[1:33], vote[33:] = digest, 255 - digest  # one MAX finds both the highest and the lowest digest
        if not self.vote(vote, patience=stuck_after if own is not None and on_stuck is not None else None):
            on_stuck(own)
        if agree_on is not None and not np.array_equal(vote[1:33], 255 - vote[33:]):
            with self.faults.guard(self.name):
                everyone = self._comm.allgather(json.loads(text))
            self._mismatch(everyone, what)
        if not vote[0]:
            return value
        with self.faults.guard(self.name):
            reports = self._comm.allgather(None if own is None else (type(own).__name__, str(own)))
        failures = [Failure(rank, *report) for rank, report in enumerate(reports) if report is not None]
        raise (error or raise_own_or_name_them(what))(failures, own)

    def vote(self, values: np.ndarray, *, patience: Optional[float] = None) -> bool:
        """Every rank's ``values`` reduced by elementwise maximum, in place (a collective call, not recorded).

        The verdicts every rank must act on alike (a non-finite gradient to
        skip, a GradScaler overflow, a stop signal) and :meth:`decide`'s first
        phase.  With ``patience``, give up after that many seconds and return
        False (the others did not come); True once the reduction is done.
        """
        if self.size == 1:
            return True
        with self.faults.guard(self.name):
            request = self._comm.Iallreduce(MPI.IN_PLACE, values, MPI.MAX)
            if patience is None:
                request.Wait()
                return True
            deadline = time.monotonic() + patience
            while not request.Test():
                if time.monotonic() > deadline:
                    return False
                time.sleep(0.001)
        return True

    def _mismatch(self, everyone: List[Mapping[str, Any]], what: str) -> NoReturn:
        lines = differing_lines(everyone, [f"rank {r}:" for r in range(len(everyone))], nested=False)
        raise SetupMismatchError(f"ranks disagree on the {what} ({self.name} communicator):\n" + "\n".join(f"  {line}" for line in lines))

    def agree(self, signature: Mapping[str, Any], what: str = "set-up") -> None:
        """Check that every rank passes an identical ``signature`` (:meth:`decide` with ``agree_on``).

        Raises
        ------
        SetupMismatchError
            On every rank, naming each key that differs and each rank's value.
        """
        self.decide(lambda: None, what, agree_on=signature)


class _Missing:
    """An entry one table lacks, shown as ``nothing`` (unquoted, unlike a value)."""

    def __repr__(self) -> str:
        return "nothing"


MISSING = _Missing()


def plain(value: Any) -> Any:
    """``value`` as JSON would carry it (lists for tuples, Python numbers for numpy's), to compare a saved table with."""
    return json.loads(json.dumps(value, default=lambda v: v.tolist() if hasattr(v, "tolist") else repr(v)))


def differing_lines(
    tables: Sequence[Mapping[str, Any]], labels: Sequence[str], *, skip: Any = (), nested: bool = True, prefix: str = "",
) -> List[str]:
    """``"key: label0 X, label1 Y"`` for each key (but ``skip``) whose values differ among ``tables``, ``MISSING`` where absent.

    The one printer of "these tables differ": set-up agreement (``rank 0:``, ``rank 1:``) and resumes
    (``saved``, ``here``).  ``nested``: where every value is a table, one line per differing entry (``key.entry``).
    """
    lines = []
    for key in sorted(set().union(*tables) - set(skip)):
        values = [table.get(key, MISSING) for table in tables]
        if nested and all(isinstance(v, dict) for v in values):
            lines += differing_lines(values, labels, prefix=f"{prefix}{key}.")
        elif any(v != values[0] for v in values):
            lines.append(f"{prefix}{key}: " + ", ".join(f"{label} {v!r}" for label, v in zip(labels, values)))
    return lines
