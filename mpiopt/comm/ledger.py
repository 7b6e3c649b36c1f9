"""Byte and time accounting for every communication call, and the bytes an algorithm's plan will cost.

Running totals per operation, never a list of calls, so a long run uses constant memory.
Byte convention, spans and plans: docs/internals-comm.md, "The ledger".
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Callable, Dict, Iterable, Iterator, Mapping, Optional, Tuple

__all__ = ["OpStats", "Ledger", "Call", "PLANNED_OPS", "LEVELS", "call_bytes", "plan_bytes", "NONBLOCKING_OPS", "SPAN_KINDS"]

# Operations whose ``seconds`` run from posting to completion (overlapping
# other work); only their ``wait_seconds`` is time this rank was blocked.
NONBLOCKING_OPS = frozenset({"Iallreduce", "Iallgather", "Ialltoall", "Ibarrier", "Isend", "Irecv"})

#: The ``kind`` argument of :attr:`Ledger.listener` calls.
SPAN_KINDS = ("blocking", "inflight", "wait")


@dataclass
class OpStats:
    """Running totals for one operation name."""

    calls: int = 0
    bytes_sent: int = 0
    bytes_recv: int = 0
    seconds: float = 0.0
    wait_seconds: float = 0.0

    # Field by field, not through dataclasses.fields: every step reads its ledger's totals.
    def __sub__(self, other: "OpStats") -> "OpStats":
        return OpStats(self.calls - other.calls, self.bytes_sent - other.bytes_sent, self.bytes_recv - other.bytes_recv,
                       self.seconds - other.seconds, self.wait_seconds - other.wait_seconds)

    def __add__(self, other: "OpStats") -> "OpStats":
        return OpStats(self.calls + other.calls, self.bytes_sent + other.bytes_sent, self.bytes_recv + other.bytes_recv,
                       self.seconds + other.seconds, self.wait_seconds + other.wait_seconds)

    def as_tuple(self) -> tuple:
        return (self.calls, self.bytes_sent, self.bytes_recv, self.seconds, self.wait_seconds)


@dataclass
class Ledger:
    """Per-operation totals of calls, bytes and seconds for one rank, shared by the communicators of a topology.

    ``listener``, when set, is told the time span of every call (for a tracer).
    """

    ops: Dict[str, OpStats] = field(default_factory=dict)
    listener: Optional[Callable[[str, float, float, str], None]] = field(default=None, compare=False, repr=False)

    def record(self, op: str, sent: int, recv: int, seconds: float = 0.0, calls: int = 1) -> OpStats:
        """Add one call's bytes and time to ``op``'s totals and return the totals."""
        stats = self.ops.get(op)
        if stats is None:
            stats = self.ops[op] = OpStats()
        stats.calls += calls
        stats.bytes_sent += int(sent)
        stats.bytes_recv += int(recv)
        stats.seconds += seconds
        return stats

    def add_time(self, op: str, seconds: float, wait_seconds: float = 0.0) -> None:
        """Add time to an operation already recorded (nonblocking completion)."""
        stats = self.ops[op]
        stats.seconds += seconds
        stats.wait_seconds += wait_seconds

    # -- reading -------------------------------------------------------------
    def __iter__(self) -> Iterator[str]:
        return iter(sorted(self.ops))

    def __getitem__(self, op: str) -> OpStats:
        return self.ops.get(op, OpStats())

    def total(self, comm: Optional[str] = None) -> OpStats:
        """Totals over all operations, or over those of the communicator named ``comm`` (``"island"``)."""
        out = OpStats()
        for op, stats in self.ops.items():
            if comm is None or op.startswith(comm + "."):
                out = out + stats
        return out

    def blocked_seconds(self) -> "tuple[float, float]":
        """Time this rank spent blocked in MPI: (in blocking calls, waiting on nonblocking ones)."""
        comm = wait = 0.0
        for op, stats in self.ops.items():
            if op.rsplit(".", 1)[-1] in NONBLOCKING_OPS:
                wait += stats.wait_seconds
            else:
                comm += stats.seconds
        return comm, wait

    @property
    def bytes_sent(self) -> int:
        return self.total().bytes_sent

    @property
    def bytes_recv(self) -> int:
        return self.total().bytes_recv

    def snapshot(self) -> "Ledger":
        """An independent copy, to be subtracted later with :meth:`since`."""
        return Ledger({op: OpStats(*s.as_tuple()) for op, s in self.ops.items()})

    def since(self, earlier: "Ledger") -> "Ledger":
        """What was recorded after ``earlier`` (a snapshot of this ledger)."""
        diff = {}
        for op, stats in self.ops.items():
            delta = stats - earlier[op]
            if delta.calls or delta.bytes_sent or delta.bytes_recv or delta.seconds:
                diff[op] = delta
        return Ledger(diff)

    def reset(self) -> None:
        """Forget every total."""
        self.ops.clear()

    def as_dict(self) -> Dict[str, Dict[str, float]]:
        """Plain nested dict (for JSON and HDF5 metadata)."""
        return {op: dict(zip((f.name for f in fields(OpStats)), s.as_tuple())) for op, s in sorted(self.ops.items())}

    @classmethod
    def from_dict(cls, data: Mapping[str, Mapping[str, float]]) -> "Ledger":
        """Inverse of :meth:`as_dict`."""
        return cls({op: OpStats(**dict(v)) for op, v in data.items()})

    def table(self, title: Optional[str] = None) -> str:
        """A Markdown table of the totals, one row per operation."""
        lines = [f"### {title}", ""] if title else []
        lines.append("| operation | calls | bytes sent | bytes received | seconds | waiting s |")
        lines.append("|---|---:|---:|---:|---:|---:|")
        for op in self:
            s = self.ops[op]
            lines.append(f"| {op} | {s.calls} | {s.bytes_sent} | {s.bytes_recv} | {s.seconds:.6f} | {s.wait_seconds:.6f} |")
        return "\n".join(lines)


#: The collectives a :class:`Call` can name: ``twophase`` is the sign vote's Alltoall of chunks plus Allgather of one.
PLANNED_OPS = ("allreduce", "iallreduce", "allgather", "allgatherv", "bcast", "twophase")
#: Where a call's bytes travel: between workers (across the link), or within an island (the node's own links).
LEVELS = ("link", "node")


@dataclass(frozen=True)
class Call:
    """One collective of an algorithm's plan: ``op`` with an ``nbytes`` message over ``ranks`` ranks, ``count`` times.

    ``phase``, ``overlap_steps`` and ``progress_rounds`` (calls beside each other or beside computation, and how
    far MPI moves a call in flight): docs/internals-comm.md.  ``copies``: communicators of ``ranks`` that make the
    call side by side (islands: one per rail, or one per island); ``level``: one of :data:`LEVELS`.
    """

    op: str
    nbytes: float
    ranks: int
    count: float = 1.0
    phase: int = 0
    overlap_steps: int = 0
    progress_rounds: Optional[int] = None
    copies: int = 1
    level: str = "link"

    def __post_init__(self) -> None:
        if self.op not in PLANNED_OPS:
            raise ValueError(f"op must be one of {', '.join(PLANNED_OPS)}, got {self.op!r}")
        if self.level not in LEVELS:
            raise ValueError(f"level must be one of {', '.join(LEVELS)}, got {self.level!r}")


def call_bytes(op: str, ranks: int, nbytes: float) -> Tuple[float, float]:
    """(sent, received) bytes of one ``ranks``-rank call, summed over its ranks, in the ledger's convention."""
    P, n = ranks, nbytes
    if op not in PLANNED_OPS:
        raise ValueError(f"op must be one of {', '.join(PLANNED_OPS)}, got {op!r}")
    if P < 2:
        return 0.0, 0.0
    if op in ("allreduce", "iallreduce"):
        return P * n, P * n
    if op in ("allgather", "allgatherv"):
        return P * n, P * (P - 1) * n
    if op == "bcast":
        return n, (P - 1) * n
    return P * P * n, 2 * P * (P - 1) * n  # twophase: Alltoall of P chunks (one stays), then Allgather of one


def plan_bytes(calls: Iterable[Call], ranks: int, steps: float = 1, level: Optional[str] = None) -> Dict[str, float]:
    """``{"sent", "recv"}``: bytes per step of the mean rank of a ``ranks``-rank world under ``calls`` over ``steps``
    (``level``: of its calls at that level only)."""
    sent = recv = 0.0
    for call in calls:
        if level is not None and call.level != level:
            continue
        s, r = call_bytes(call.op, call.ranks, call.nbytes)
        sent += call.count * call.copies * s
        recv += call.count * call.copies * r
    return {"sent": sent / ranks / steps, "recv": recv / ranks / steps}
