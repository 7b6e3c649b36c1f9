"""The asynchrony-momentum trade-off of Async-MSGD on streaming PCA (deterministic mode).

Claim (Liu et al., NeurIPS 2018; docs/algorithms.md "Async-MSGD"): with staleness ``tau`` the best momentum
``mu`` falls, large ``mu`` with large ``tau`` diverges, and plain SGD hardly notices ``tau``.

    python -m mpiopt.bench.tradeoff --out /tmp/t.png --delays 0,4,16 --momenta 0,0.5,0.9

Prints iterations to accuracy per (delay, momentum), each row's best in bold.  Method: docs/internals-bench.md.
"""

from __future__ import annotations

import argparse
import os
import sys
from dataclasses import dataclass, field
from typing import List, Optional, Sequence

import numpy as np

from ..algorithms.async_msgd import AsyncMSGDRule
from ..asyncrt.simulated import FixedDelay, simulate
from ..tasks.pca import PCAProblem, PCAStream, diverged, make_problem, sin2
from ._common import comma_list, module_main, positive_int, save_figure

__all__ = ["TradeoffGrid", "iterations_to_accuracy", "tradeoff_grid", "markdown_table", "plot", "add_arguments", "run", "main"]

DELAYS = (0, 2, 4, 8, 16, 32, 64)
MOMENTA = (0.0, 0.5, 0.7, 0.8, 0.85, 0.9, 0.95)
LR = 0.02
BATCH_SIZE = 8
ACCURACY = 0.1
MAX_STEPS = 3000
SEEDS = 20

DIVERGED = -1  # iterations_to_accuracy's answer for a run that left the sphere
NOT_REACHED = -2  # ... and for one that did not reach the accuracy in max_steps


def iterations_to_accuracy(
    problem: PCAProblem,
    *,
    lr: float,
    momentum: float,
    delay: int,
    seed: int,
    accuracy: float = ACCURACY,
    max_steps: int = MAX_STEPS,
    batch_size: int = BATCH_SIZE,
) -> int:
    """Updates until ``sin^2 <= accuracy`` for one seed; :data:`DIVERGED` or :data:`NOT_REACHED` otherwise."""
    v = problem.initial(seed)
    rule = AsyncMSGDRule(lr, momentum)
    rule.allocate(v)
    stream = PCAStream(problem, problem.samples(seed, max_steps, batch_size))
    top = problem.top

    def done(x: np.ndarray, version: int) -> bool:
        return diverged(x) or sin2(x, top) <= accuracy

    result = simulate(v, rule, stream, max_steps, delay=FixedDelay(delay), until=done)
    if diverged(v):
        return DIVERGED
    return result.version if sin2(v, top) <= accuracy else NOT_REACHED


@dataclass
class TradeoffGrid:
    """Iterations to accuracy over ``delays`` x ``momenta`` (mean over seeds; NaN where ``status`` is not ``"ok"``)."""

    delays: List[int]
    momenta: List[float]
    iterations: np.ndarray
    status: np.ndarray
    settings: dict = field(default_factory=dict)

    def best_momentum(self) -> List[Optional[float]]:
        """Per delay, the momentum with the fewest iterations (None if no cell converged; ties: the smaller)."""
        best: List[Optional[float]] = []
        for row in self.iterations:
            finite = np.where(np.isfinite(row), row, np.inf)
            best.append(None if not np.isfinite(finite).any() else self.momenta[int(np.argmin(finite))])
        return best


def tradeoff_grid(
    delays: Sequence[int] = DELAYS,
    momenta: Sequence[float] = MOMENTA,
    seeds: Sequence[int] = tuple(range(1, SEEDS + 1)),
    *,
    problem: Optional[PCAProblem] = None,
    lr: float = LR,
    accuracy: float = ACCURACY,
    max_steps: int = MAX_STEPS,
    batch_size: int = BATCH_SIZE,
) -> TradeoffGrid:
    """Run every (delay, momentum, seed); deterministic.  Delays and momenta are sorted ascending."""
    problem = make_problem() if problem is None else problem
    delays, momenta = sorted(delays), sorted(momenta)
    iterations = np.full((len(delays), len(momenta)), np.nan)
    status = np.full((len(delays), len(momenta)), "ok", dtype=object)
    for i, delay in enumerate(delays):
        for j, momentum in enumerate(momenta):
            runs = [
                iterations_to_accuracy(
                    problem, lr=lr, momentum=momentum, delay=delay, seed=seed,
                    accuracy=accuracy, max_steps=max_steps, batch_size=batch_size,
                )
                for seed in seeds
            ]
            if DIVERGED in runs:
                status[i, j] = "diverged"
            elif NOT_REACHED in runs:
                status[i, j] = ">max"
            else:
                iterations[i, j] = float(np.mean(runs))
    settings = dict(
        lr=lr, accuracy=accuracy, max_steps=max_steps, batch_size=batch_size, seeds=list(seeds), dim=problem.dim, gap=problem.gap
    )
    return TradeoffGrid(list(delays), [float(m) for m in momenta], iterations, status, settings)


def markdown_table(grid: TradeoffGrid) -> str:
    """Rows: delay; columns: momentum; cells: mean iterations (best of the row in bold)."""
    lines = ["| delay \\ momentum | " + " | ".join(f"{m:g}" for m in grid.momenta) + " | best momentum |"]
    lines.append("|---:|" + "---:|" * len(grid.momenta) + "---:|")
    for i, delay in enumerate(grid.delays):
        best = grid.best_momentum()[i]
        cells = []
        for j, momentum in enumerate(grid.momenta):
            text = f"{grid.iterations[i, j]:.0f}" if grid.status[i, j] == "ok" else grid.status[i, j]
            cells.append(f"**{text}**" if momentum == best else text)
        lines.append(f"| {delay} | " + " | ".join(cells) + f" | {'-' if best is None else f'{best:g}'} |")
    return "\n".join(lines)


def plot(grid: TradeoffGrid, path: str) -> None:
    """Heat map of log iterations (grey: diverged or not reached; box: each row's best) to ``path``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    values = np.log10(grid.iterations)
    fig, ax = plt.subplots(figsize=(1.0 + 1.1 * len(grid.momenta), 1.2 + 0.6 * len(grid.delays)), dpi=120)
    cmap = matplotlib.colormaps["viridis_r"].copy()
    cmap.set_bad("#d9d9d9")
    image = ax.imshow(np.ma.masked_invalid(values), cmap=cmap, aspect="auto")
    best = grid.best_momentum()
    for i in range(len(grid.delays)):
        for j, momentum in enumerate(grid.momenta):
            ok = grid.status[i, j] == "ok"
            text = f"{grid.iterations[i, j]:.0f}" if ok else ("div" if grid.status[i, j] == "diverged" else ">max")
            dark = ok and values[i, j] > np.nanmean(values)  # viridis_r: many iterations are dark
            ax.text(j, i, text, ha="center", va="center", fontsize=9, color="white" if dark else "black")
            if momentum == best[i]:
                ax.add_patch(plt.Rectangle((j - 0.5, i - 0.5), 1, 1, fill=False, edgecolor="red", linewidth=2))
    ax.set_xticks(range(len(grid.momenta)), [f"{m:g}" for m in grid.momenta])
    ax.set_yticks(range(len(grid.delays)), [str(d) for d in grid.delays])
    ax.set_xlabel("momentum mu")
    ax.set_ylabel("delay tau (updates)")
    s = grid.settings
    ax.set_title(
        f"Async-MSGD, streaming PCA (d={s['dim']}, gap {s['gap']:g}): iterations to sin² ≤ {s['accuracy']:g}\n"
        f"lr {s['lr']:g}, batch {s['batch_size']}, mean of {len(s['seeds'])} seeds; "
        f"red box: best mu; grey: diverged / >{s['max_steps']}",
        fontsize=9,
    )
    fig.colorbar(image, ax=ax, label="log10 iterations")
    fig.tight_layout()
    save_figure(fig, path)



def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--out", default=os.path.join("docs", "img", "tradeoff.png"), help="heat-map PNG")
    parser.add_argument("--delays", type=comma_list(int), default=list(DELAYS), help="comma-separated delays tau")
    parser.add_argument("--momenta", type=comma_list(float), default=list(MOMENTA), help="comma-separated momenta mu")
    parser.add_argument("--seeds", type=positive_int, default=SEEDS, help="seeds 1..N averaged per cell")
    parser.add_argument("--lr", type=float, default=LR, help="learning rate")
    parser.add_argument("--batch-size", type=positive_int, default=BATCH_SIZE, help="samples per update")
    parser.add_argument("--accuracy", type=float, default=ACCURACY, help="target sin^2 to the top eigenvector")
    parser.add_argument("--max-steps", type=positive_int, default=MAX_STEPS, help="updates before a cell counts as not reached")


def run(args: argparse.Namespace) -> int:
    """Run the grid, print its table and write the heat map."""
    grid = tradeoff_grid(
        args.delays, args.momenta, range(1, args.seeds + 1),
        lr=args.lr, accuracy=args.accuracy, max_steps=args.max_steps, batch_size=args.batch_size,
    )
    print(markdown_table(grid))
    plot(grid, args.out)
    print(f"\nheat map: {args.out}", file=sys.stderr)
    return 0


def main(argv: Optional[List[str]] = None) -> int:
    return module_main("tradeoff", __doc__, add_arguments, run, argv)


if __name__ == "__main__":
    sys.exit(main())
