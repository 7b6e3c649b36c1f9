"""The twin of :func:`mpiopt.asyncrt.run_async`: one process plays the server and its workers with a chosen delay.

At step ``k`` the payload is computed at the stale iterate ``x_{k - tau_k}``
and applied to ``x_k`` by the same ``apply`` the real server uses, so an
experiment here and a run on MPI differ only in where ``tau_k`` comes from:

- :class:`FixedDelay` ``(tau)``: ``tau_k = min(tau, k)``.  This is exactly
  the schedule of ``tau + 1`` equally fast workers served in turn by the
  real runtime (each fetches the parameters, and ``tau`` other updates land
  before its own), warm-up included.
- :class:`RandomDelay` ``(max_delay, seed)``: ``tau_k`` uniform on
  ``{0, ..., max_delay}``, clipped to ``k``; the same seed gives the same
  delays.

The last ``max_delay + 1`` iterates are kept in a ring buffer (one copy of
the parameters per step when the delay is not 0).
"""

from __future__ import annotations

from collections import Counter
from typing import Optional, Union

import numpy as np

from ..asyncrt.result import ApplyFn, Arrival, AsyncResult, UntilFn, WorkerFn, check_run_arguments, staleness_counts

__all__ = ["FixedDelay", "RandomDelay", "simulate"]


def _check_delay(value: object, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"{name} must be an integer, got {value!r}")
    if value < 0:
        raise ValueError(f"{name} must be >= 0, got {value!r}")
    return int(value)


class FixedDelay:
    """``tau_k = min(delay, k)``: ``delay + 1`` equally fast workers in round robin."""

    def __init__(self, delay: int) -> None:
        self.delay = _check_delay(delay, "delay")

    def delays(self, steps: int) -> np.ndarray:
        """``tau_0 .. tau_{steps-1}``."""
        return np.minimum(self.delay, np.arange(steps))

    def __repr__(self) -> str:
        return f"FixedDelay({self.delay})"


class RandomDelay:
    """``tau_k`` uniform on ``{0, ..., max_delay}`` (from ``seed``), clipped to ``k``."""

    def __init__(self, max_delay: int, seed: int = 0) -> None:
        self.max_delay = _check_delay(max_delay, "max_delay")
        self.seed = seed

    def delays(self, steps: int) -> np.ndarray:
        """``tau_0 .. tau_{steps-1}``; the same for every call with the same seed."""
        drawn = np.random.default_rng(self.seed).integers(0, self.max_delay + 1, size=steps)
        return np.minimum(drawn, np.arange(steps))

    def __repr__(self) -> str:
        return f"RandomDelay({self.max_delay}, seed={self.seed})"


def simulate(
    params: np.ndarray,
    apply: ApplyFn,
    worker_fn: WorkerFn,
    steps: int,
    *,
    delay: Union[int, FixedDelay, RandomDelay] = 0,
    until: Optional[UntilFn] = None,
) -> AsyncResult:
    """Run ``steps`` updates with a deterministic delay, in this process, without MPI.

    Parameters
    ----------
    params : numpy.ndarray
        Flat float parameters ``x_0``, updated in place to the last iterate.
    apply : callable
        ``apply(params, payload, arrival)``: the server's update rule.
    worker_fn : callable
        ``worker_fn(stale_params, k, out) -> loss``: the payload for step ``k``
        computed at ``x_{k - tau_k}`` (read-only) into ``out``.
    steps : int
        Number of updates (at most, with ``until``).
    delay : int, FixedDelay or RandomDelay
        The staleness model; an int means :class:`FixedDelay`.
    until : callable, optional
        ``until(params, version) -> bool`` after each update; True stops.

    Returns
    -------
    AsyncResult
        With one stream: ``applied = [version]``.
    """
    check_run_arguments(params, steps)
    model = FixedDelay(delay) if not isinstance(delay, (FixedDelay, RandomDelay)) else delay
    taus = model.delays(steps)
    depth = int(taus.max(initial=0)) + 1
    history = np.empty((depth, params.size), dtype=params.dtype) if depth > 1 else None
    payload = np.empty_like(params)
    histogram: Counter = Counter()
    stopped = False
    for k in range(steps):
        tau = int(taus[k])
        if history is not None:
            history[k % depth] = params
        stale = params if tau == 0 else history[(k - tau) % depth]
        loss = worker_fn(stale, k, payload)
        apply(params, payload, Arrival(worker=0, step=k, version=k - tau, staleness=tau, loss=loss))
        histogram[tau] += 1
        if until is not None and until(params, k + 1):
            stopped = k + 1 < steps
            break
    version = sum(histogram.values())
    return AsyncResult(
        version=version,
        staleness=staleness_counts(histogram),
        applied=np.array([version], dtype=np.int64),
        sent=version,
        stopped_early=stopped,
    )
