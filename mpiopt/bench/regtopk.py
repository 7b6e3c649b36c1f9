"""Top-k vs RegTop-k on the paper's distributed linear regression: distance to the optimum after T iterations.

Claim (Bereyhi et al.; docs/algorithms.md "Top-k with error feedback, and RegTop-k"): at the same density
Top-k with error feedback stalls at a distance from the optimum while RegTop-k converges, for suitable mu and k.

    python -m mpiopt.bench.regtopk --plot docs/img/regtopk.png    # tables and the curves

Method: docs/internals-bench.md; results: docs/regtopk.md.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence

import numpy as np

from ..algorithms.topk import Sparsifier
from ..sim.topk import simulate
from ..tasks.linreg import LinRegProblem, make_problem
from ..training.config import UsageError
from ._common import comma_list, module_main, positive_int, save_figure

__all__ = ["Comparison", "compare", "markdown_tables", "plot", "add_arguments", "run", "main"]

DENSITIES = (0.4, 0.5, 0.6, 0.7, 0.8, 0.9)
MUS = (2.0, 4.0, 8.0)
STEPS = 1500
LR = 0.01


@dataclass
class Comparison:
    """Squared distances to the optimum, ``(T + 1,)`` each: ``topk[density]``, ``regtopk[density, mu]``, ``dense``, ``ks``."""

    densities: List[float]
    mus: List[float]
    topk: Dict[float, np.ndarray]
    regtopk: Dict[tuple, np.ndarray]
    dense: np.ndarray
    ks: Dict[float, int]
    settings: dict = field(default_factory=dict)


def compare(
    problem: LinRegProblem,
    densities: Sequence[float] = DENSITIES,
    mus: Sequence[float] = MUS,
    *,
    steps: int = STEPS,
    lr: float = LR,
) -> Comparison:
    """Run Top-k and RegTop-k (each mu) at every density; deterministic."""
    densities, mus = sorted(float(v) for v in densities), sorted(float(v) for v in mus)
    topk, regtopk, ks = {}, {}, {}
    for density in densities:
        ks[density] = Sparsifier(density=density).count(problem.dim)
        topk[density] = simulate(problem, Sparsifier(density=density), steps, lr=lr).squared_distance
        for mu in mus:
            regtopk[density, mu] = simulate(problem, Sparsifier(density=density, mu=mu), steps, lr=lr).squared_distance
    dense = simulate(problem, Sparsifier(density=1.0), steps, lr=lr).squared_distance
    settings = dict(workers=problem.num_workers, dim=problem.dim, steps=steps, lr=lr)
    return Comparison(densities, mus, topk, regtopk, dense, ks, settings)


def _row_value(trajectory: np.ndarray, which: str) -> float:
    if which == "final":
        return float(trajectory[-1])
    quarter = (trajectory.shape[0] - 1) // 4
    return float(np.median(trajectory[-quarter:]))


def markdown_tables(result: Comparison) -> str:
    """The two tables (value at T; median over the last T/4), with the dense reference under each."""
    steps = result.settings["steps"]
    blocks = []
    titles = {
        "final": f"||x_T - x*||^2 after T = {steps} iterations",
        "median": f"median of ||x_t - x*||^2 over the last {steps // 4} iterations",
    }
    for which, title in titles.items():
        lines = [f"**{title}**", ""]
        lines.append("| density | k | Top-k | " + " | ".join(f"RegTop-k mu={mu:g}" for mu in result.mus) + " |")
        lines.append("|---:|---:|---:|" + "---:|" * len(result.mus))
        for density in result.densities:
            cells = [f"{_row_value(result.topk[density], which):.1e}"]
            cells += [f"{_row_value(result.regtopk[density, mu], which):.1e}" for mu in result.mus]
            lines.append(f"| {density:g} | {result.ks[density]} | " + " | ".join(cells) + " |")
        lines.append("")
        lines.append(f"dense distributed SGD (density 1): {_row_value(result.dense, which):.1e}")
        blocks.append("\n".join(lines))
    return "\n\n".join(blocks)


def plot(result: Comparison, path: str, mu: float, densities: Sequence[float]) -> None:
    """log10 ||x_t - x*||^2 vs t: Top-k dashed, RegTop-k (``mu``) solid, one colour per density; dense SGD black.

    ``mu`` and ``densities`` must be among those of ``result``.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.8), dpi=120)
    t = np.arange(result.dense.shape[0])
    for density in sorted(densities):
        label = f"density {density:g} (k={result.ks[density]})"
        (line,) = ax.plot(t, np.log10(result.topk[density]), "--", linewidth=1.0, label=f"Top-k, {label}")
        ax.plot(t, np.log10(result.regtopk[density, mu]), "-", color=line.get_color(), linewidth=0.8, label=f"RegTop-k, {label}")
    ax.plot(t, np.log10(result.dense), "-", color="black", linewidth=1.0, label="dense SGD")
    s = result.settings
    ax.set_xlabel("iteration t")
    ax.set_ylabel("log10 ||x_t - x*||^2")
    ax.set_title(
        f"Distributed linear regression: {s['workers']} workers, d={s['dim']}, lr {s['lr']:g}; RegTop-k mu={mu:g}", fontsize=9
    )
    ax.legend(fontsize=7, ncol=2, loc="upper right")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    save_figure(fig, path)



def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--densities", type=comma_list(float), default=list(DENSITIES), help="comma-separated densities k/d")
    parser.add_argument("--mus", type=comma_list(float), default=list(MUS), help="comma-separated RegTop-k mu values")
    parser.add_argument("--steps", type=positive_int, default=STEPS, help="iterations T")
    parser.add_argument("--lr", type=float, default=LR, help="learning rate")
    parser.add_argument("--workers", type=positive_int, default=20, help="workers N")
    parser.add_argument("--dim", type=positive_int, default=100, help="dimension d")
    parser.add_argument("--samples", type=positive_int, default=500, help="samples per worker")
    parser.add_argument("--seed", type=int, default=0, help="seed of the problem")
    parser.add_argument("--plot", metavar="PATH", default=None, help="also write the curves (PNG) to PATH")
    parser.add_argument("--plot-mu", type=float, default=4.0, help="RegTop-k's mu in the plot")
    parser.add_argument("--plot-densities", type=comma_list(float), default=[0.5, 0.7, 0.9], help="densities in the plot")


def run(args: argparse.Namespace) -> int:
    """Run both algorithms at every density and print the tables (and the plot)."""
    if args.plot and (not set(args.plot_densities) <= set(args.densities) or args.plot_mu not in args.mus):
        raise UsageError("--plot-densities must be among --densities, and --plot-mu among --mus")
    problem = make_problem(args.workers, args.dim, args.samples, seed=args.seed)
    result = compare(problem, args.densities, args.mus, steps=args.steps, lr=args.lr)
    print(
        f"Distributed linear regression (mpiopt.tasks.linreg, seed {args.seed}): {args.workers} workers, d = {args.dim}, "
        f"{args.samples} samples each, full-batch gradients, lr {args.lr:g}, x_0 = 0 "
        f"(||x_0 - x*||^2 = {result.dense[0]:.1f}).\n"
    )
    print(markdown_tables(result))
    if args.plot:
        plot(result, args.plot, args.plot_mu, args.plot_densities)
        print(f"\nplot: {args.plot}", file=sys.stderr)
    return 0


def main(argv: Optional[List[str]] = None) -> int:
    return module_main("regtopk", __doc__, add_arguments, run, argv)


if __name__ == "__main__":
    sys.exit(main())
