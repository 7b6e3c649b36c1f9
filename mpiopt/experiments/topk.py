"""Top-k with error feedback against RegTop-k (Bereyhi et al. 2024/2025): linear regression and the image task.

Claims (docs/algorithms.md "Top-k with error feedback, and RegTop-k"): in the
paper's distributed linear regression Top-k stalls at a fixed distance from
the optimum while RegTop-k converges at the same density; on an image task
at a very low density (ResNet-18 on CIFAR-10 at 0.1 %) RegTop-k is clearly
more accurate than Top-k.

Two parts at 2 ranks:

1. the paper's linear regression (20 workers, d = 100, 500 samples each,
   full-batch gradients, lr 0.01), in one process through
   :func:`mpiopt.bench.regtopk.compare` (the MPI algorithm's own code, N
   workers simulated; see docs/regtopk.md): ``results-topk-linreg.png``;
2. the image task (digits, MLP) trained by ``sgd`` (dense reference),
   ``topk`` and ``regtopk`` (mu 5, the paper's CIFAR value) at density
   0.01 through the training front end (``results-topk-accuracy.png``,
   ``results-topk-loss.png``).
"""

from __future__ import annotations

from typing import Any, Dict

import numpy as np

from ..bench import regtopk as linreg_bench
from ..comm import Topology
from ..tasks.linreg import make_problem
from . import EXPERIMENTS
from ._common import image_config, image_heading, image_settings, train_images, write_results

RANKS = EXPERIMENTS["topk"].ranks
ALGORITHMS = ("sgd", "topk", "regtopk")
DENSITY = 0.01
MU = 5.0
STEPS, QUICK_STEPS = 600, 20
#: Linear regression: densities (every one plotted), RegTop-k's mu, iterations.
LINREG = dict(densities=(0.5, 0.7, 0.9), mus=(4.0,), steps=1500)
QUICK_LINREG = dict(densities=(0.7,), mus=(4.0,), steps=50)


def run(out: str, quick: bool) -> Dict[str, Any]:
    """Both parts (a collective call at :data:`RANKS` ranks; the regression on rank 0); the numbers on rank 0."""
    topology = Topology()
    steps = QUICK_STEPS if quick else STEPS
    # Per-algorithm tables: sgd takes no density.
    config = image_config(out, steps, hyperparameters={"topk": {"density": DENSITY}, "regtopk": {"density": DENSITY, "mu": MU}})
    _, summaries, figures, table = train_images(topology, config, ALGORITHMS, prefix="results-topk-")
    rank = topology.rank
    topology.Free()
    if rank != 0:
        return {}
    grid = QUICK_LINREG if quick else LINREG
    comparison = linreg_bench.compare(make_problem(), grid["densities"], grid["mus"], steps=grid["steps"])
    figures.append(f"{out}/results-topk-linreg.png")
    linreg_bench.plot(comparison, figures[-1], grid["mus"][0], grid["densities"])
    quarter = max(1, grid["steps"] // 4)
    linreg = {
        "k": {str(d): k for d, k in comparison.ks.items()},
        "topk_median_last_quarter": {str(d): float(np.median(v[-quarter:])) for d, v in comparison.topk.items()},
        "regtopk_median_last_quarter": {f"{d}/mu={m}": float(np.median(v[-quarter:])) for (d, m), v in comparison.regtopk.items()},
        "dense_final": float(comparison.dense[-1]),
        "start": float(comparison.dense[0]),
    }
    markdown = (
        f"{image_heading(config, RANKS, f', density {DENSITY:g}, RegTop-k mu {MU:g}')}\n\n{table}\n\n"
        f"Distributed linear regression ({comparison.settings['workers']} workers, d = {comparison.settings['dim']}, "
        f"lr {comparison.settings['lr']:g}, ||x_0 - x*||^2 = {linreg['start']:.1f}):\n\n{linreg_bench.markdown_tables(comparison)}"
    )
    settings = image_settings(config, ALGORITHMS, RANKS, steps=steps,
                              linreg={**comparison.settings, "densities": list(grid["densities"]), "mus": list(grid["mus"])})
    numbers = {"image": summaries, "linreg": linreg}
    return write_results(out, "topk", quick, settings, numbers, markdown, figures)
