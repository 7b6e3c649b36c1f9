"""Comparison plots of several runs: accuracy and loss against steps, wall time and bytes (docs/internals-metrics.md).

matplotlib is imported only when plotting, so the rest of :mod:`mpiopt.metrics` works without it.
"""

from __future__ import annotations

import os
from typing import Any, List, Sequence, Tuple

import numpy as np

from .records import Run

__all__ = ["plot_runs", "running_mean", "SMOOTHING_WINDOW", "LOG_SPAN"]

#: Steps in the training loss's running mean.
SMOOTHING_WINDOW = 25
#: Ratio of the largest to the smallest positive value above which an axis is logarithmic.
LOG_SPAN = 100.0
_X_LABELS = ("steps", "wall time (s)", "bytes sent by rank 0 (MB)")


def running_mean(values: Sequence[float], window: int) -> np.ndarray:
    """Trailing mean of the last ``window`` values at each point, ignoring NaN and infinities."""
    if isinstance(window, bool) or not isinstance(window, int) or window < 1:
        raise ValueError(f"window must be a positive integer, got {window!r}")
    x = np.asarray(values, dtype=np.float64)
    finite = np.isfinite(x)
    sums = np.concatenate(([0.0], np.cumsum(np.where(finite, x, 0.0))))
    counts = np.concatenate(([0], np.cumsum(finite)))
    ends = np.arange(1, len(x) + 1)
    starts = np.maximum(ends - window, 0)
    n = counts[ends] - counts[starts]
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(n > 0, (sums[ends] - sums[starts]) / np.maximum(n, 1), np.nan)


def _labels(runs: Sequence[Run]) -> List[str]:
    """The algorithm names, numbered where two runs share one."""
    names = [run.algorithm for run in runs]
    return [f"{name} ({names[:i].count(name) + 1})" if names.count(name) > 1 else name for i, name in enumerate(names)]


def _auto_log(ax: Any, axis: str, values: Sequence[np.ndarray]) -> None:
    positive = np.concatenate([v[np.isfinite(v) & (v > 0)] for v in values] + [np.empty(0)])
    if positive.size and positive.max() > LOG_SPAN * positive.min():
        (ax.set_xscale if axis == "x" else ax.set_yscale)("log")


def _figure(curves: Sequence[Tuple[str, Sequence[np.ndarray], np.ndarray]], ylabel: str, title: str, path: str) -> str:
    """Three panels (steps, wall time, bytes) with one line per curve ``(label, (x1, x2, x3), y)``, saved to ``path``."""
    fig = _draw(curves, ylabel, title)
    fig.savefig(path, dpi=100)
    return path


def _draw(curves: Sequence[Tuple[str, Sequence[np.ndarray], np.ndarray]], ylabel: str, title: str) -> Any:
    """:func:`_figure`'s figure."""
    from matplotlib.figure import Figure

    fig = Figure(figsize=(15, 4.5), layout="constrained")
    axes = fig.subplots(1, 3, sharey=True)
    for index, (label, xs, y, *band) in enumerate(curves):
        # matplotlib's colours repeat after 10: the next ten curves are dashed, then dotted.
        style = ("-", "--", ":")[index // 10 % 3]
        for ax, x in zip(axes, xs):
            (line,) = ax.plot(x, y, label=label, linestyle=style, marker="o" if len(y) < 30 else None, markersize=3)
            if band:
                ax.fill_between(x, band[0], band[1], color=line.get_color(), alpha=0.2, linewidth=0)
    for panel, (ax, xlabel) in enumerate(zip(axes, _X_LABELS)):
        ax.set_xlabel(xlabel)
        ax.grid(True, alpha=0.3)
        if panel == 2:
            _auto_log(ax, "x", [c[1][2] for c in curves])
    axes[0].set_ylabel(ylabel)
    _auto_log(axes[0], "y", [c[2] for c in curves])
    if curves:  # beside the panels, where it covers no curve (a dozen algorithms fill a corner of any panel)
        fig.legend(*axes[0].get_legend_handles_labels(), loc="outside right upper")
    fig.suptitle(title)
    return fig


def plot_runs(
    runs: Sequence[Run], out_dir: "str | os.PathLike[str]", *, prefix: str = "", smoothing: int = SMOOTHING_WINDOW,
    group_repeats: bool = False,
) -> List[str]:
    """Write ``<prefix>accuracy.png`` and ``<prefix>loss.png`` comparing ``runs`` into ``out_dir``; the paths written.

    ``smoothing``: steps in the loss's trailing running mean (1: none); ``group_repeats``: one median curve per
    algorithm with its range shaded.
    """
    if not runs:
        raise ValueError("runs must hold at least one Run, got none")
    running_mean([], smoothing)  # validates smoothing before any work
    out_dir = os.fspath(out_dir)
    os.makedirs(out_dir, exist_ok=True)
    accuracy, loss = [], []
    for run, label in zip(runs, _labels(runs)):
        evals = [e for e in run.evals if e.get("test_accuracy") is not None]
        evals_x = (_column(evals, "step"), _column(evals, "wall_seconds"), _column(evals, "bytes_sent_total") / 1e6)
        accuracy.append((label, evals_x, 100.0 * _column(evals, "test_accuracy")))
        steps_x = (_column(run.steps, "step"), _column(run.steps, "wall_seconds"), np.cumsum(_column(run.steps, "bytes_sent")) / 1e6)
        loss.append((label, steps_x, running_mean(_column(run.steps, "loss"), smoothing)))
    if group_repeats:
        accuracy, loss = _median_curves(runs, accuracy), _median_curves(runs, loss)
    return [
        _figure(accuracy, "test accuracy (%)", "Test accuracy", os.path.join(out_dir, f"{prefix}accuracy.png")),
        _figure(loss, "training loss", f"Training loss (running mean of {smoothing} steps)", os.path.join(out_dir, f"{prefix}loss.png")),
    ]


def _median_curves(runs: Sequence[Run], curves: Sequence[Tuple[str, Sequence[np.ndarray], np.ndarray]]) -> List[Tuple[Any, ...]]:
    """One curve per algorithm of ``runs``: point-wise medians of x and y over its runs, and y's min and max."""
    by_algorithm: dict = {}
    for run, curve in zip(runs, curves):
        by_algorithm.setdefault(run.algorithm, []).append(curve)
    merged: List[Tuple[Any, ...]] = []
    for name, group in by_algorithm.items():
        n = min(len(c[2]) for c in group)
        ys = np.array([c[2][:n] for c in group])
        xs = tuple(np.nanmedian(np.array([c[1][i][:n] for c in group]), axis=0) if n else np.empty(0) for i in range(3))
        if not n:
            merged.append((name, xs, np.empty(0)))
            continue
        label = f"{name} (median of {len(group)}, range shaded)" if len(group) > 1 else name
        with np.errstate(invalid="ignore"):
            merged.append((label, xs, np.nanmedian(ys, axis=0), np.nanmin(ys, axis=0), np.nanmax(ys, axis=0)))
    return merged


def _column(records: Sequence[dict], field: str) -> np.ndarray:
    return np.array([np.nan if r.get(field) is None else r[field] for r in records], dtype=np.float64)
