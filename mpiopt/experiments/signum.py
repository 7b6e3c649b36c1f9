"""Signum majority vote against SGD (Bernstein et al., ICML 2018; ICLR 2019), with adversarial workers.

Claims (docs/algorithms.md "signSGD, Signum and majority vote"): the vote sends
32x fewer bits than a float32 Allreduce and still trains; it tolerates
fewer than half of the workers being adversarial.

Two parts at 4 ranks:

1. the image task (digits, MLP) trained by ``sgd`` and ``signum`` through
   the training front end (``results-signum-accuracy.png``,
   ``results-signum-loss.png``);
2. the flat API on logistic regression with different data per rank
   (:mod:`mpiopt.tasks.logistic`): ranks below ``k`` are adversaries that
   send ``-SCALE`` times their gradient, for every ``k`` from 0 to 3 (0, 1
   below half, 2 exactly half, 3 above), under the sign vote and under SGD's
   average: the global objective's excess over its optimum per step
   (``results-signum-byzantine.png``).  For the vote the adversary only flips
   its signs; SGD's average also feels the scale.
"""

from __future__ import annotations

from typing import Any, Dict, List

import numpy as np

from ..algorithms import create
from ..bench._common import markdown_table
from ..comm import Topology
from ..tasks import logistic
from . import EXPERIMENTS
from ._common import image_config, image_heading, image_settings, new_figure, train_images, write_results

RANKS = EXPERIMENTS["signum"].ranks
ALGORITHMS = ("sgd", "signum")
STEPS, QUICK_STEPS = 600, 20
BYZANTINE_STEPS, QUICK_BYZANTINE_STEPS = 400, 30
#: An adversary sends -SCALE times its gradient.
SCALE = 10.0
#: Flat-API settings of the byzantine part: (algorithm, hyperparameters).
BYZANTINE = (("signum", dict(lr=0.01, momentum=0.9, weight_decay=0.0)), ("sgd", dict(lr=0.5, momentum=0.0, weight_decay=0.0)))
BATCH = 32
#: The ranks' data come from one distribution (no shift of the feature means): the vote's guarantee assumes
#: every honest gradient has the same mean.
SHIFT = 0.0


def byzantine_curves(topology: Topology, steps: int, seed: int = 0) -> Dict[str, Dict[int, List[float]]]:
    """``{algorithm: {adversaries: [f(w_t) - f* for t = 0..steps]}}`` (a collective call; the same on every rank)."""
    data = logistic.make_data(topology.rank, seed=seed, shift=SHIFT)
    everyone = logistic.make_global_data(range(topology.size), seed=seed, shift=SHIFT)
    best = logistic.loss(logistic.optimum(everyone).astype(np.float32), everyone)
    curves: Dict[str, Dict[int, List[float]]] = {}
    for name, hyper in BYZANTINE:
        curves[name] = {}
        for adversaries in range(topology.size):
            w = np.zeros(data.num_features, np.float32)
            alg = create(name, topology, **hyper)
            alg.setup(w)
            rng = np.random.default_rng([seed, topology.rank])
            excess = [float(logistic.loss(w, everyone) - best)]
            for _ in range(steps):
                g = logistic.gradient(w, data.sample(rng, BATCH))
                alg.step(w, -SCALE * g if topology.rank < adversaries else g)
                excess.append(float(logistic.loss(w, everyone) - best))
            curves[name][adversaries] = excess
    return curves


def _plot_byzantine(curves: Dict[str, Dict[int, List[float]]], ranks: int, path: str) -> str:
    fig, axes = new_figure(len(curves), height=4.2)
    for ax, (name, by_count) in zip(axes, curves.items()):
        for adversaries, excess in by_count.items():
            ax.plot(np.maximum(excess, 1e-8), label=f"{adversaries} of {ranks} adversarial")
        ax.set_yscale("log")
        ax.set_xlabel("step")
        ax.set_title({"signum": "majority vote of signs", "sgd": "SGD (mean of gradients)"}[name], fontsize=10)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    axes[0].set_ylabel("f(w) - f*, global logistic loss")
    fig.suptitle(f"Adversaries send -{SCALE:g} x their gradient (logistic regression, different data per rank)")
    fig.savefig(path, dpi=100)
    return path


def run(out: str, quick: bool) -> Dict[str, Any]:
    """Both parts (a collective call at :data:`RANKS` ranks); the numbers on rank 0."""
    topology = Topology()
    steps = QUICK_STEPS if quick else STEPS
    config = image_config(out, steps)
    _, summaries, figures, table = train_images(topology, config, ALGORITHMS, prefix="results-signum-")
    byzantine_steps = QUICK_BYZANTINE_STEPS if quick else BYZANTINE_STEPS
    curves = byzantine_curves(topology, byzantine_steps)
    rank = topology.rank
    topology.Free()
    if rank != 0:
        return {}
    figures.append(_plot_byzantine(curves, RANKS, f"{out}/results-signum-byzantine.png"))
    final = {name: {k: v[-1] for k, v in by_count.items()} for name, by_count in curves.items()}
    start = curves["sgd"][0][0]
    byzantine = markdown_table(["adversaries", *(f"{name}: f - f* at the end" for name in curves)],
                               [[f"{adversaries} of {RANKS}", *(f"{final[name][adversaries]:.2e}" for name in curves)]
                                for adversaries in range(RANKS)], align="r" * (1 + len(curves)))
    markdown = (
        f"{image_heading(config, RANKS)}\n\n{table}\n\n"
        f"Logistic regression, {byzantine_steps} steps, f(0) - f* = {start:.3f}; adversaries send -{SCALE:g} g:\n\n{byzantine}"
    )
    settings = image_settings(config, ALGORITHMS, RANKS, steps=steps,
                              byzantine={"steps": byzantine_steps, "scale": SCALE, "batch_size": BATCH, "hyperparameters": dict(BYZANTINE)})
    numbers = {"image": summaries, "byzantine_final_excess": final, "byzantine_start_excess": start}
    return write_results(out, "signum", quick, settings, numbers, markdown, figures)
