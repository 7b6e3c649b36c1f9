"""The one-process twin of :func:`mpiopt.asyncrt.run_async`: the same ``apply``, with a chosen delay ``tau_k``.

Delay models and exact continuation across calls: docs/internals-asyncrt.md.
"""

from __future__ import annotations

from collections import Counter
from typing import Optional, Union

import numpy as np

from .result import ApplyFn, Arrival, AsyncResult, UntilFn, WorkerFn, check_count, check_run_arguments, staleness_counts

__all__ = ["FixedDelay", "RandomDelay", "RecentIterates", "simulate"]


class FixedDelay:
    """``tau_k = min(delay, k)``: ``delay + 1`` equally fast workers in round robin."""

    def __init__(self, delay: int) -> None:
        self.delay = check_count("delay", delay)

    @property
    def max_delay(self) -> int:
        return self.delay

    def delays(self, steps: int, start: int = 0) -> np.ndarray:
        """``tau_start .. tau_{start+steps-1}``."""
        return np.minimum(self.delay, np.arange(start, start + steps))

    def __repr__(self) -> str:
        return f"FixedDelay({self.delay})"


class RandomDelay:
    """``tau_k`` uniform on ``{0, ..., max_delay}`` (from ``seed``), clipped to ``k``."""

    def __init__(self, max_delay: int, seed: int = 0) -> None:
        self.max_delay = check_count("max_delay", max_delay)
        self.seed = seed

    def delays(self, steps: int, start: int = 0) -> np.ndarray:
        """``tau_start .. tau_{start+steps-1}``; the same for every call with the same seed."""
        # Drawn from the start of the stream, so that a continued run gets the delays of one long run.
        drawn = np.random.default_rng(self.seed).integers(0, self.max_delay + 1, size=start + steps)[start:]
        return np.minimum(drawn, np.arange(start, start + steps))

    def __repr__(self) -> str:
        return f"RandomDelay({self.max_delay}, seed={self.seed})"


class RecentIterates:
    """The iterates a later call's delayed payloads may still read, kept by :func:`simulate` between calls.

    ``array``: ``(m, n)``, ``x_{v-m} .. x_{v-1}`` oldest first at server version ``v``; None when none is kept.
    """

    def __init__(self, array: Optional[np.ndarray] = None) -> None:
        self.array = array

    def held(self, params: np.ndarray, version: int) -> int:
        """How many iterates are kept (checked against ``params`` and ``version``)."""
        if self.array is None:
            return 0
        if self.array.ndim != 2 or self.array.shape[1] != params.size or self.array.dtype != params.dtype:
            raise ValueError(
                f"recent iterates must be an (m, {params.size}) array of {params.dtype}, got shape {self.array.shape} of {self.array.dtype}"
            )
        if self.array.shape[0] > version:
            raise ValueError(f"recent iterates: {self.array.shape[0]} kept before version {version}, which has only {version}")
        return self.array.shape[0]


def simulate(
    params: np.ndarray,
    apply: ApplyFn,
    worker_fn: WorkerFn,
    steps: int,
    *,
    delay: Union[int, FixedDelay, RandomDelay] = 0,
    until: Optional[UntilFn] = None,
    version: int = 0,
    recent: Optional[RecentIterates] = None,
) -> AsyncResult:
    """Run ``steps`` updates with a deterministic delay, in this process, without MPI.

    ``worker_fn(stale_params, k, out)`` computes at ``x_{k - tau_k}``; ``delay`` is an int (:class:`FixedDelay`)
    or a delay model.  ``version`` and ``recent`` continue an earlier call; a delay that reaches before
    ``x_version`` further than ``recent`` holds raises ``ValueError``.  ``applied`` has one stream.
    """
    check_run_arguments(params, steps)
    check_count("version", version)
    model = FixedDelay(delay) if not isinstance(delay, (FixedDelay, RandomDelay)) else delay
    taus = model.delays(steps, start=version)
    held = 0 if recent is None else recent.held(params, version)
    reach = int(np.max(taus - np.arange(steps), initial=0))  # iterates before x_version read
    if reach > held:
        raise ValueError(
            f"delay {model!r} from version {version} reads x_{version - reach}, {reach} iterates back, "
            f"but only {held} are kept (recent=RecentIterates() keeps those of an earlier call)"
        )
    keep = model.max_delay if recent is not None else 0
    depth = max(int(taus.max(initial=0)), keep) + 1
    history = np.empty((depth, params.size), dtype=params.dtype) if depth > 1 else None
    for back in range(1, min(held, depth - 1) + 1):
        history[(version - back) % depth] = recent.array[held - back]
    payload = np.empty_like(params)
    histogram: Counter = Counter()
    stopped = False
    for k, tau in zip(range(version, version + steps), taus.tolist()):
        if history is not None:
            history[k % depth] = params
        stale = params if tau == 0 else history[(k - tau) % depth]
        loss = worker_fn(stale, k, payload)
        apply(params, payload, Arrival(worker=0, step=k, version=k - tau, staleness=tau, loss=loss))
        histogram[tau] += 1
        if until is not None and until(params, k + 1):
            stopped = k + 1 < version + steps
            break
    done = sum(histogram.values())
    if recent is not None:
        rows, end = min(keep, held + done), version + done
        recent.array = history[[(end - back) % depth for back in range(rows, 0, -1)]] if rows else None
    return AsyncResult(
        version=version + done,
        start_version=version,
        staleness=staleness_counts(histogram),
        applied=np.array([done], dtype=np.int64),
        sent=done,
        stopped_early=stopped,
    )
