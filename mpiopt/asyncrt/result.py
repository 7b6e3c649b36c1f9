"""What the drivers share: the callback types, an arrival's description, the result, the argument checks."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Dict, List, NamedTuple, Optional

import numpy as np

from ..comm import Comm
from ..comm.communicator import Failure

__all__ = [
    "Arrival",
    "AsyncResult",
    "ApplyFn",
    "WorkerFn",
    "UntilFn",
    "staleness_counts",
    "add_counts",
    "check_count",
    "check_run_arguments",
    "agree_on_arguments",
    "PER_RUN_SUMS",
    "job_fields",
]


class Arrival(NamedTuple):
    """One message as the server applies it: sender, its step, the version it was computed at, staleness, loss."""

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


def add_counts(total: np.ndarray, more: np.ndarray) -> np.ndarray:
    """Two dense count arrays (staleness histograms) added, the shorter one padded with zeros."""
    out = np.zeros(max(total.size, more.size), dtype=np.int64)
    out[: total.size] += total
    out[: more.size] += more
    return out


@dataclass
class AsyncResult:
    """The outcome of an asynchronous run, identical on every rank except ``sent`` and ``idle_seconds``.

    ``version`` runs on across continued runs; the counts (``staleness[t]``, ``applied[rank]``) are this run's,
    which applied ``version - start_version`` updates.  ``idle_seconds`` is polling time, not in the ledger.
    """

    version: int
    staleness: np.ndarray
    applied: np.ndarray
    sent: int
    stopped_early: bool = False
    idle_seconds: float = 0.0
    start_version: int = 0

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
            "start_version": self.start_version,
            "staleness": self.histogram(),
            "applied": [int(n) for n in self.applied],
            "sent": self.sent,
            "stopped_early": self.stopped_early,
            "idle_seconds": self.idle_seconds,
        }


def check_count(name: str, value: Any) -> int:
    """An integer >= 0 (a step count, a version); the error names ``name`` and ``value``."""
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"{name} must be an integer, got {value!r}")
    if value < 0:
        raise ValueError(f"{name} must be >= 0, got {value!r}")
    return int(value)


def check_run_arguments(params: Any, steps: Any) -> None:
    """The checks both drivers make: a flat host float array and a step count >= 0."""
    if not isinstance(params, np.ndarray):
        raise TypeError(
            f"params must be a numpy array (the asynchronous runtime keeps them in host memory), got {type(params).__name__}"
        )
    if params.ndim != 1 or not params.flags.c_contiguous or params.dtype.kind != "f":
        raise ValueError(f"params must be a contiguous 1-D float array, got shape {params.shape} of {params.dtype}")
    check_count("steps", steps)


def agree_on_arguments(world: Any, what: str, check: Callable[[], None]) -> None:
    """Run this rank's ``check``; if any rank's failed, raise the same error on every rank before the first message.

    A bad value on one rank alone would otherwise leave the others waiting for it.  The error has the type of the
    lowest failing rank's and every failing rank's message; a ``world`` that is not a ``Comm`` agrees with nobody.
    """
    if not isinstance(world, Comm):
        check()  # nobody to agree with: this rank's error stands
        raise TypeError(f"world must be an mpiopt.comm.Comm, got {type(world).__name__}")
    kinds = {kind.__name__: kind for kind in (TypeError, ValueError, RuntimeError)}

    def error(failures: List[Failure], own: Optional[BaseException]) -> BaseException:
        by_message: Dict[str, List[int]] = {}
        for failure in failures:
            by_message.setdefault(failure.message, []).append(failure.rank)
        lines = [f"{'rank' if len(ranks) == 1 else 'ranks'} {', '.join(map(str, ranks))}: {message}" for message, ranks in by_message.items()]
        return kinds[failures[0].kind](f"{what}: " + "; ".join(lines))

    world.decide(check, what, catch=tuple(kinds.values()), error=error)


#: Fields of an asynchronous run's result that count that run only; the others run on from run to run.
PER_RUN_SUMS = ("sent", "seconds", "idle_seconds")


def job_fields(results: List[Any]) -> Dict[str, Any]:
    """The scalar fields of a job's asynchronous runs (its segments, in order) as those of one run.

    Running counts are the last run's; per-run ones (:data:`PER_RUN_SUMS`) are summed.
    """
    merged = {k: v for k, v in vars(results[-1]).items() if isinstance(v, (int, float, str, bool))}
    for key in PER_RUN_SUMS:
        if key in merged:
            merged[key] = sum(getattr(r, key) for r in results)
    if "start_version" in merged:
        merged["start_version"] = results[0].start_version
    if "stopped_early" in merged:
        merged["stopped_early"] = any(r.stopped_early for r in results)
    return merged
