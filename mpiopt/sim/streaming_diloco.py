"""One-process twin of ``streaming_diloco``: P simulated ranks, given gradients, no MPI (float64 by default).

An independent re-computation for the tests, none of the MPI path's code.  Schedule: docs/internals-sim.md.
"""

from __future__ import annotations

from typing import Callable, List, Sequence

import numpy as np

__all__ = ["simulate"]


def simulate(
    initial: Sequence[np.ndarray], grad: Callable[[int, int, np.ndarray], np.ndarray], steps: int, *, lr: float,
    momentum: float = 0.0, period: int, fragments: int, overlap_steps: int, alpha: float, outer_lr: float,
    outer_momentum: float, outer_nesterov: bool = True, layout: str = "contiguous", stride_blocks: int = 8, dtype=np.float64,
) -> List[np.ndarray]:
    """Every rank's parameters after ``steps`` steps and the final merges; ``grad(rank, step, x)`` gives the gradients."""
    P = len(initial)
    start = np.mean([np.asarray(x, dtype) for x in initial], axis=0)
    x = [start.copy() for _ in range(P)]
    d = start.shape[0]
    if layout == "strided":
        blocks = fragments * stride_blocks
        owner = np.empty(d, np.int64)  # each position's fragment
        for i in range(blocks):
            owner[i * d // blocks : (i + 1) * d // blocks] = i % fragments
        parts = [np.flatnonzero(owner == f) for f in range(fragments)]
    else:
        parts = [np.arange(f * d // fragments, (f + 1) * d // fragments) for f in range(fragments)]
    offsets = [f * period // fragments for f in range(fragments)]
    buf = [None] * P
    outer_buf = np.zeros(d, dtype)
    pending = {}  # fragment -> (merge step, mean of the local fragments at the start)

    def merge(f):
        part = parts[f]
        _, mean = pending.pop(f)
        delta = start[part] - mean
        outer_buf[part] = outer_momentum * outer_buf[part] + delta
        g = delta + outer_momentum * outer_buf[part] if outer_nesterov and outer_momentum else outer_buf[part]
        start[part] = start[part] - outer_lr * g
        for r in range(P):
            x[r][part] = alpha * x[r][part] + (1 - alpha) * start[part]

    for t in range(1, steps + 1):
        for r in range(P):
            g = np.asarray(grad(r, t, x[r]), dtype)
            buf[r] = g if buf[r] is None else momentum * buf[r] + g
            x[r] = x[r] - lr * (buf[r] if momentum else g)
        for f in [f for f, (due, _) in pending.items() if due == t]:
            merge(f)
        for f in range(fragments):
            if t % period == offsets[f]:
                pending[f] = (t + overlap_steps, np.mean([xr[parts[f]] for xr in x], axis=0))
                if overlap_steps == 0:
                    merge(f)
    for f in list(pending):
        merge(f)
    return x
