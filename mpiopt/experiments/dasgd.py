"""DaSGD against synchronous SGD (Zhou et al. 2020): loss curves, and how much of the averaging compute hides.

Claims (docs/algorithms.md "DaSGD"): the loss curve matches synchronous SGD's
within a few percent, and the averaging (a nonblocking Iallreduce of the
weights every ``tau`` steps, merged ``d`` steps later) is hidden behind the
``d`` steps of compute when it fits there.

At 2 ranks, ``sgd`` and ``dasgd`` (``tau = 4``, ``d = 1``, its defaults; no
weight decay, like ``sgd``) train
the image task with the trace on (:class:`~mpiopt.metrics.Tracer`).  From
each rank's trace, :func:`~mpiopt.metrics.overlap_fraction` gives the
fraction of the time the Iallreduce was in flight that ran during the
``compute`` phase (forward and backward) and during any phase at all
(compute, the algorithm's own step, evaluation).  Figures: test accuracy and
training loss against steps, wall time and bytes
(``results-dasgd-accuracy.png``, ``results-dasgd-loss.png``) and the time
split per step (``results-dasgd-split.png``).
"""

from __future__ import annotations

import json
import os
from typing import Any, Dict, List, Sequence

import numpy as np

from ..comm import Topology
from ..metrics import Run, overlap_fraction
from ..metrics.summary import SPLITS
from . import EXPERIMENTS
from ._common import image_config, image_heading, image_settings, new_figure, train_images, write_results

RANKS = EXPERIMENTS["dasgd"].ranks
ALGORITHMS = ("sgd", "dasgd")
STEPS, QUICK_STEPS = 600, 20


def overlaps(trace_path: str, ranks: int) -> Dict[str, List[float]]:
    """Per rank: the in-flight fraction during ``compute``, and during any traced phase."""
    with open(trace_path) as handle:
        events = json.load(handle)["traceEvents"]
    return {
        "behind_compute": [overlap_fraction(events, rank, phases=["compute"]) for rank in range(ranks)],
        "behind_any_phase": [overlap_fraction(events, rank) for rank in range(ranks)],
    }


def plot_split(runs: Sequence[Run], summaries: Sequence[Dict[str, Any]], path: str, title: str) -> str:
    """Stacked bars: the mean step's seconds of compute, algorithm, communication, waiting and the rest, per run.

    The seconds are ``summaries``' time split (:func:`~mpiopt.metrics.summarize` of ``runs``, in order).
    """
    fig, (ax,) = new_figure(1, width=6.5)
    names = [run.algorithm for run in runs]
    bottom = np.zeros(len(runs))
    for key, label in [(key, label) for key, _, label in SPLITS] + [("other", "other")]:
        ms = np.array([1e3 * s[f"{key}_seconds"] / len(run.steps) for run, s in zip(runs, summaries)])
        ax.bar(names, ms, bottom=bottom, label=label, color="0.8" if key == "other" else None)
        bottom += ms
    ax.set_ylabel("mean step time (ms), rank 0")
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=8)
    fig.savefig(path, dpi=100)
    return path


def run(out: str, quick: bool) -> Dict[str, Any]:
    """Train both with the trace (a collective call at :data:`RANKS` ranks); the numbers on rank 0."""
    topology = Topology()
    steps = QUICK_STEPS if quick else STEPS
    # The loop writes the trace of config.algorithm's run to config.trace, every other run's to its folder.
    # DaSGD's default weight decay (the authors' 0.01) floors the training loss near 0.1 on this task: without it
    # the two differ only in the averaging.
    config = image_config(out, steps, algorithm="dasgd", trace=os.path.join(out, "dasgd", "trace.json"),
                          hyperparameters={"dasgd": {"weight_decay": 0.0}})
    runs, summaries, figures, table = train_images(topology, config, ALGORITHMS, prefix="results-dasgd-")
    rank = topology.rank
    topology.Free()
    if rank != 0:
        return {}
    figures.append(plot_split(runs, summaries, f"{out}/results-dasgd-split.png", f"Where a step's time goes ({RANKS} ranks, {steps} steps)"))
    hidden = overlaps(config.trace, RANKS)
    by_name = {s["algorithm"]: s for s in summaries}
    final_loss = {run.algorithm: float(np.mean([s["loss"] for s in run.steps[-max(1, steps // 10):]])) for run in runs}
    markdown = (
        f"{image_heading(config, RANKS)}\n\n{table}\n\n"
        f"Training loss over the last {max(1, steps // 10)} steps: "
        + ", ".join(f"{name} {value:.4f}" for name, value in final_loss.items())
        + f" (dasgd / sgd = {final_loss['dasgd'] / final_loss['sgd']:.2f}).\n\n"
        "DaSGD's Iallreduce in flight behind compute, per rank: "
        + ", ".join(f"{100 * v:.0f} %" for v in hidden["behind_compute"])
        + "; behind any phase: "
        + ", ".join(f"{100 * v:.0f} %" for v in hidden["behind_any_phase"])
        + f".  Step time dasgd / sgd = {by_name['dasgd']['wall_seconds'] / by_name['sgd']['wall_seconds']:.2f}."
    )
    settings = image_settings(config, ALGORITHMS, RANKS, steps=steps)
    numbers = {"image": summaries, "final_loss": final_loss, "overlap": hidden}
    return write_results(out, "dasgd", quick, settings, numbers, markdown, figures)
