"""LSGD against EASGD and data-parallel SGD (Teng et al., NeurIPS 2019), and the curse of symmetry.

Claims (docs/algorithms.md "LSGD"): LSGD reaches a lower test error than EASGD
and data-parallel SGD in the same wall-clock time, sending only the
leader's parameters; and it avoids the "curse of symmetry": with workers in
mirror-image minima, EASGD's centre settles at their average (a stationary
point that is not a minimum) while LSGD's workers follow a leader into a
real minimum.

Two parts, 4 ranks in 2 groups of 2:

1. the image task (digits, MLP) trained by ``sgd``, ``easgd`` and ``lsgd``
   through the training front end: test accuracy against steps, wall time
   and bytes (``results-lsgd-accuracy.png``, ``results-lsgd-loss.png``);
2. the flat API on ``f(x) = sum_j (x_j^2 - 1)^2`` in 2 dimensions
   (:mod:`mpiopt.tasks.symmetric`), workers started in mirror-image wells,
   a pull every step: every worker's path under EASGD (and its centre),
   single-leader LSGD and LSGD with 2 groups of 2
   (``results-lsgd-symmetry.png``).
"""

from __future__ import annotations

from typing import Any, Dict

import numpy as np

from ..algorithms import create
from ..bench._common import markdown_table
from ..comm import Topology
from ..tasks import symmetric
from . import EXPERIMENTS
from ._common import image_config, image_heading, image_settings, new_figure, train_images, write_results

RANKS = EXPERIMENTS["lsgd"].ranks
ALGORITHMS = ("sgd", "easgd", "lsgd")
STEPS, QUICK_STEPS = 600, 20
SYMMETRY_STEPS, SYMMETRY_LR = 300, 0.05


#: The curse-of-symmetry runs: (label, algorithm, ranks per group (None: all in one), hyperparameters).
SYMMETRY_RUNS = (
    ("EASGD", "easgd", None, dict(beta=0.9)),
    ("LSGD, one group", "lsgd", None, dict(global_period=4)),
    ("LSGD, 2 groups of 2", "lsgd", 2, dict(global_period=4)),
)


def symmetry_paths(topology: Topology, steps: int, seed: int = 5) -> Dict[str, np.ndarray]:
    """Every worker's path in each of :data:`SYMMETRY_RUNS` from mirror-image starts (a collective call; the same on every rank).

    Returns, per label, ``(workers, steps + 1, 2)`` positions, and under
    ``"centre"`` EASGD's centre, ``(steps + 1, 2)``.  Full-batch gradient
    steps, a pull every step, no momentum (the setting of
    tests/mpi/test_lsgd.py's curse-of-symmetry test).  Workers ``2k`` and
    ``2k + 1`` start as mirror images, so with groups of 2 each group holds
    one worker in each well.
    """
    start = symmetric.mirrored_starts(topology.size, 2, seed=seed)[topology.rank]
    grad = np.empty_like(start)
    paths: Dict[str, np.ndarray] = {}
    for label, name, group_size, hyper in SYMMETRY_RUNS:
        topo = Topology(group_size=group_size or topology.size)
        params = start.copy()
        alg = create(name, topo, lr=SYMMETRY_LR, period=1, momentum=0.0, nesterov=False, weight_decay=0.0, **hyper)
        alg.setup(params)
        own, centre = [params.copy()], [np.array(getattr(alg, "center", params))]
        for _ in range(steps):
            alg.step(params, symmetric.gradient(params, out=grad), loss=symmetric.loss(params))
            own.append(params.copy())
            centre.append(np.array(getattr(alg, "center", params)))
        paths[label] = np.stack(topology.world.allgather_obj(np.stack(own)))
        if name == "easgd":
            paths["centre"] = np.stack(centre)
        topo.Free()
    return paths


def _plot_symmetry(paths: Dict[str, np.ndarray], path: str) -> str:
    labels = [label for label, *_ in SYMMETRY_RUNS]
    fig, axes = new_figure(len(labels), width=4.8)
    grid = np.linspace(-1.8, 1.8, 181)
    X, Y = np.meshgrid(grid, grid)
    F = (X**2 - 1) ** 2 + (Y**2 - 1) ** 2
    for ax, label in zip(axes, labels):
        ax.contour(X, Y, F, levels=[0.05, 0.2, 0.5, 1, 1.5, 2, 3, 5], colors="0.75", linewidths=0.6)
        for worker, trail in enumerate(paths[label]):
            ax.plot(trail[:, 0], trail[:, 1], "-", linewidth=1.2, label=f"worker {worker}")
            ax.plot(trail[0, 0], trail[0, 1], "o", color="black", markersize=4)
            ax.plot(trail[-1, 0], trail[-1, 1], "*", color="black", markersize=9)
        if label == "EASGD":
            centre = paths["centre"]
            ax.plot(centre[:, 0], centre[:, 1], "s", color="red", markersize=7, label="EASGD centre")
        ax.set_title(f"{label}: o start, * end", fontsize=10)
        ax.set_xlabel("x_1")
        ax.set_aspect("equal")
        ax.legend(fontsize=7, loc="lower right")
    axes[0].set_ylabel("x_2")
    fig.suptitle(f"Curse of symmetry on f(x) = sum (x_j^2 - 1)^2 (maximum at 0): workers start in mirror-image wells "
                 f"(lr {SYMMETRY_LR:g}, a pull every step)", fontsize=10)
    fig.savefig(path, dpi=100)
    return path


def run(out: str, quick: bool) -> Dict[str, Any]:
    """Both parts (a collective call at :data:`RANKS` ranks); the numbers on rank 0."""
    topology = Topology(group_size=2)
    steps = QUICK_STEPS if quick else STEPS
    config = image_config(out, steps, group_size=2, target_accuracy=0.9)
    _, summaries, figures, table = train_images(topology, config, ALGORITHMS, prefix="results-lsgd-")
    paths = symmetry_paths(topology, QUICK_STEPS if quick else SYMMETRY_STEPS)
    rank = topology.rank
    topology.Free()
    if rank != 0:
        return {}
    figures.append(_plot_symmetry(paths, f"{out}/results-lsgd-symmetry.png"))
    centre = paths["centre"][-1]
    symmetry = {
        "easgd_centre": centre.tolist(),
        "easgd_centre_gradient_norm": float(np.linalg.norm(symmetric.gradient(centre))),
        "easgd_centre_min_hessian_eigenvalue": float(symmetric.hessian_eigenvalues(centre).min()),
        "easgd_centre_loss": symmetric.loss(centre),
    }
    for label, *_ in SYMMETRY_RUNS:
        ends = paths[label][:, -1]
        symmetry[label] = {"workers": ends.tolist(), "workers_loss": [symmetric.loss(x) for x in ends],
                           "workers_at_a_minimum": [symmetric.is_local_minimum(x, tol=1e-4) for x in ends]}
    markdown = (
        f"{image_heading(config, RANKS, ' in 2 groups')}\n\n{table}\n\n"
        f"Curse of symmetry ({RANKS} workers, 2-D, {QUICK_STEPS if quick else SYMMETRY_STEPS} steps): "
        f"EASGD's centre ends at {np.round(centre, 4).tolist()} (f = {symmetry['easgd_centre_loss']:.3f}, "
        f"|grad| = {symmetry['easgd_centre_gradient_norm']:.1e}, smallest Hessian eigenvalue "
        f"{symmetry['easgd_centre_min_hessian_eigenvalue']:.2f}).\n\n"
        + markdown_table(["run", "f of each worker at the end", "at a minimum"],
                         [[label, ", ".join(f"{v:.1e}" for v in symmetry[label]["workers_loss"]), symmetry[label]["workers_at_a_minimum"]]
                          for label, *_ in SYMMETRY_RUNS], align="lll")
    )
    settings = image_settings(config, ALGORITHMS, RANKS, steps=steps, groups=2)
    numbers = {"image": summaries, "symmetry": symmetry}
    return write_results(out, "lsgd", quick, settings, numbers, markdown, figures)
