"""What one step cost a rank: bytes from the ledger, time split into communication, waiting and the algorithm's own."""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass
from typing import Any, Dict, Optional

from ..comm.islands import ISLAND

__all__ = ["StepRecord", "record_step"]


@dataclass
class StepRecord:
    """What one ``step`` cost this rank.

    Attributes
    ----------
    step : int
        Step counter after the step (1 for the first step).
    loss : float or None
        The loss passed to ``step``.
    bytes_sent, bytes_recv : int
        Payload exchanged with other ranks during the step (ledger convention).
    comm_seconds, wait_seconds : float
        Time blocked in blocking MPI calls, and waiting for nonblocking ones.
    algo_seconds : float
        The algorithm's own computation: the step's wall time less the two above.
    skipped : bool
        The step was skipped because some rank's gradient was not finite.
    island_bytes_sent, island_bytes_recv : int
        Of ``bytes_sent`` and ``bytes_recv``, those within this rank's island (islands only: its mean gradient and the
        reassembly of what its rails exchanged); the rest went between workers.
    """

    step: int
    loss: Optional[float]
    bytes_sent: int
    bytes_recv: int
    comm_seconds: float
    wait_seconds: float
    algo_seconds: float
    skipped: bool = False
    island_bytes_sent: int = 0
    island_bytes_recv: int = 0

    def as_dict(self) -> Dict[str, Any]:
        return asdict(self)


def record_step(ledger: Any, before: Any, started: float, step: int, loss: Optional[float], skipped: bool) -> StepRecord:
    """The record of a step that began at ``started`` (``time.perf_counter()``) with the ledger at ``before``."""
    elapsed = time.perf_counter() - started
    delta = ledger.since(before)
    comm, wait = delta.blocked_seconds()
    island, everything = delta.total(ISLAND), delta.total()
    return StepRecord(
        step=step,
        loss=None if loss is None else float(loss),
        bytes_sent=everything.bytes_sent,
        bytes_recv=everything.bytes_recv,
        comm_seconds=comm,
        wait_seconds=wait,
        algo_seconds=max(0.0, elapsed - comm - wait),
        skipped=skipped,
        island_bytes_sent=island.bytes_sent,
        island_bytes_recv=island.bytes_recv,
    )
