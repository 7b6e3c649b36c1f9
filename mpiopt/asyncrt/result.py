"""What the drivers share: the callback types, an arrival's description, the result, the argument checks."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Dict, List, NamedTuple, Optional, Tuple

import numpy as np

from ..comm import Comm

__all__ = [
    "Arrival",
    "AsyncResult",
    "ApplyFn",
    "WorkerFn",
    "UntilFn",
    "staleness_counts",
    "check_run_arguments",
    "agree_on_arguments",
]


class Arrival(NamedTuple):
    """One message as the server applies it.

    Attributes
    ----------
    worker : int
        World rank of the sender (0 in the deterministic mode and at one rank).
    step : int
        The sender's index of this payload (its ``worker_fn`` step argument).
    version : int
        Server version the payload was computed at (the ``s`` of ``x_s``).
    staleness : int
        ``tau = server version at application - version``.
    loss : float or None
        What the worker function returned for this payload.
    """

    worker: int
    step: int
    version: int
    staleness: int
    loss: Optional[float]


#: ``worker_fn(params, step, out) -> loss``: write the payload (a gradient)
#: for the read-only ``params`` into ``out``; ``step`` numbers this worker's
#: payloads from 0 (the deterministic mode has one stream: ``step = k``).
WorkerFn = Callable[[np.ndarray, int, np.ndarray], Optional[float]]
#: ``apply(params, payload, arrival)``: the server's update, in place on ``params``.
ApplyFn = Callable[[np.ndarray, np.ndarray, Arrival], None]
#: ``until(params, version) -> bool``: checked after every applied update; True ends the run.
UntilFn = Callable[[np.ndarray, int], bool]


def staleness_counts(histogram: Dict[int, int]) -> np.ndarray:
    """``{staleness: count}`` as a dense int64 array indexed by staleness."""
    counts = np.zeros(max(histogram, default=-1) + 1, dtype=np.int64)
    for tau, n in histogram.items():
        counts[tau] = n
    return counts


@dataclass
class AsyncResult:
    """The outcome of an asynchronous run, identical on every rank except ``sent`` and ``idle_seconds``.

    Attributes
    ----------
    version : int
        Updates applied in all (the server's final version).
    staleness : numpy.ndarray
        ``staleness[t]`` = number of applied updates whose staleness was ``t``.
    applied : numpy.ndarray
        ``applied[r]`` = updates applied from world rank ``r``.
    sent : int
        Payloads this rank sent (its own count; ``applied[rank]`` when none was lost).
    stopped_early : bool
        ``until`` ended the run before every worker had done its steps.
    idle_seconds : float
        This rank's time spent waiting: the server for arrivals, a worker
        for the server's replies (polling; not in the ledger's wait time).
    """

    version: int
    staleness: np.ndarray
    applied: np.ndarray
    sent: int
    stopped_early: bool = False
    idle_seconds: float = 0.0

    @property
    def mean_staleness(self) -> float:
        """Average staleness of the applied updates (0 when none was applied)."""
        total = int(self.staleness.sum())
        return float(np.arange(self.staleness.size) @ self.staleness) / total if total else 0.0

    @property
    def max_staleness(self) -> int:
        """Largest staleness seen (0 when none was applied)."""
        nonzero = np.flatnonzero(self.staleness)
        return int(nonzero[-1]) if nonzero.size else 0

    def histogram(self) -> Dict[int, int]:
        """``{staleness: count}`` for the values that occurred."""
        return {int(t): int(n) for t, n in enumerate(self.staleness) if n}

    def as_dict(self) -> Dict[str, Any]:
        """Plain data (for JSON and checkpoints' metadata)."""
        return {
            "version": self.version,
            "staleness": self.histogram(),
            "applied": [int(n) for n in self.applied],
            "sent": self.sent,
            "stopped_early": self.stopped_early,
            "idle_seconds": self.idle_seconds,
        }


def check_run_arguments(params: Any, steps: Any) -> None:
    """The checks both drivers make: a flat host float array and a step count >= 0."""
    if not isinstance(params, np.ndarray):
        raise TypeError(
            f"params must be a numpy array (the asynchronous runtime keeps them in host memory), got {type(params).__name__}"
        )
    if params.ndim != 1 or not params.flags.c_contiguous or params.dtype.kind != "f":
        raise ValueError(f"params must be a contiguous 1-D float array, got shape {params.shape} of {params.dtype}")
    if isinstance(steps, bool) or not isinstance(steps, (int, np.integer)):
        raise TypeError(f"steps must be an integer, got {steps!r}")
    if steps < 0:
        raise ValueError(f"steps must be >= 0, got {steps!r}")


def agree_on_arguments(world: Any, what: str, check: Callable[[], None]) -> None:
    """Run this rank's argument checks; if any rank's failed, raise the same error on every rank.

    The ranks of an asynchronous run may pass their own arguments (``steps``,
    ``seconds``), so a bad value can sit on one rank only; raising there
    alone would leave the others waiting for it.  So every rank runs
    ``check`` (which raises ``TypeError``, ``ValueError`` or ``RuntimeError``)
    and the verdicts are exchanged in one small collective before the first
    message (an ``allgather`` of ``None`` when all is well).

    Parameters
    ----------
    world : Comm
        The run's communicator.  Anything else: nobody to agree with, so
        this rank's error is raised as it is, or a ``TypeError`` for ``world``.
    what : str
        The call, for the message (``"async_lsgd.run"``).
    check : callable
        This rank's checks.

    Raises
    ------
    TypeError, ValueError or RuntimeError
        The type of the lowest failing rank's error, with every failing
        rank's message: ``"run_async: rank 2: steps must be >= 0, got -1"``.
    """
    try:
        check()
        verdict: Optional[Tuple[type, str]] = None
    except (TypeError, ValueError, RuntimeError) as err:
        if not isinstance(world, Comm):
            raise
        verdict = (type(err), str(err))
    if not isinstance(world, Comm):
        raise TypeError(f"world must be an mpiopt.comm.Comm, got {type(world).__name__}")
    failed = [(rank, v) for rank, v in enumerate(world.allgather_obj(verdict)) if v is not None]
    if not failed:
        return
    by_message: Dict[str, List[int]] = {}
    for rank, (_, message) in failed:
        by_message.setdefault(message, []).append(rank)
    lines = [
        f"{'rank' if len(ranks) == 1 else 'ranks'} {', '.join(map(str, ranks))}: {message}" for message, ranks in by_message.items()
    ]
    raise failed[0][1][0](f"{what}: " + "; ".join(lines))
