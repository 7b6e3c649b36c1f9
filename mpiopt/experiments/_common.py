"""What the experiments share: image-task runs through the training front end, and the results files."""

from __future__ import annotations

import json
import os
import sys
from typing import Any, Dict, List, Optional, Sequence, Tuple

from ..comm import Topology
from ..metrics import Run, markdown_table, plot_runs, read_metrics, summarize
from ..training.config import TrainConfig

__all__ = ["IMAGE_TASK", "image_config", "train_images", "summaries", "write_results", "new_figure"]

#: The image task of every experiment: the offline 8x8 digits and the 2-hidden-layer MLP (about 26k parameters).
IMAGE_TASK = dict(dataset="digits", model="mlp", batch_size=32, seed=0)


def image_config(out: str, steps: int, *, hyperparameters: Optional[Dict[str, Any]] = None, **settings: Any) -> TrainConfig:
    """A :class:`TrainConfig` for :data:`IMAGE_TASK`, ``steps`` per rank, 10 evaluations."""
    return TrainConfig(**{**IMAGE_TASK, **settings}, steps=steps, eval_every=max(1, steps // 10), out=out,
                       hyperparameters=dict(hyperparameters or {}), log_every=max(1, steps // 2))


def train_images(topology: Topology, config: TrainConfig, algorithms: Sequence[str], prefix: str) -> Tuple[List[Run], List[str], str]:
    """Train each of ``algorithms`` as ``config`` says, one after another (a collective call).

    Every run's files go to ``config.out/<algorithm>/``.  On rank 0, returns
    the runs read back, the figures of :func:`~mpiopt.metrics.plot_runs`
    (``<prefix>accuracy.png``, ``<prefix>loss.png``: against steps, wall time
    and bytes) and the Markdown table of :func:`~mpiopt.metrics.summarize`;
    elsewhere ``([], [], "")``.
    """
    from ..training.loop import load_data, train

    config.validate(algorithms)
    dataset = load_data(config, topology.world)
    stream = sys.stdout if topology.rank == 0 else None
    paths = [train(config, name, topology, dataset, os.path.join(config.out, name), stream=stream) for name in algorithms]
    if topology.rank != 0:
        return [], [], ""
    runs = [read_metrics(path) for path in paths]
    figures = plot_runs(runs, config.out, prefix=prefix)
    table = markdown_table([summarize(run, target_accuracy=config.target_accuracy) for run in runs])
    return runs, figures, table


def summaries(runs: Sequence[Run], target_accuracy: float) -> List[Dict[str, Any]]:
    """:func:`~mpiopt.metrics.summarize` of each run (plain JSON values)."""
    return [summarize(run, target_accuracy=target_accuracy) for run in runs]


def write_results(out: str, name: str, quick: bool, settings: Dict[str, Any], numbers: Dict[str, Any], markdown: str,
                  figures: Sequence[str]) -> Dict[str, Any]:
    """Write ``results.json`` and ``results.md`` into ``out`` (rank 0 only) and print the Markdown; return the JSON document."""
    document = {"experiment": name, "quick": quick, "settings": settings, "numbers": numbers,
                "figures": [os.path.basename(path) for path in figures]}
    with open(os.path.join(out, "results.json"), "w") as handle:
        json.dump(document, handle, indent=1, default=float)
    with open(os.path.join(out, "results.md"), "w") as handle:
        handle.write(f"# mpiopt experiment {name}{' --quick' if quick else ''}\n\n{markdown}\n")
    print(f"\n{markdown}\n")
    for path in figures:
        print(f"figure:  {path}")
    print(f"results: {os.path.join(out, 'results.json')}, {os.path.join(out, 'results.md')}", flush=True)
    return document


def new_figure(columns: int, width: float = 5.5, height: float = 4.5) -> Tuple[Any, Any]:
    """A matplotlib Figure (object API, no pyplot state) with ``columns`` panels side by side."""
    from matplotlib.figure import Figure

    fig = Figure(figsize=(width * columns, height), layout="constrained")
    axes = fig.subplots(1, columns, squeeze=False)[0]
    return fig, axes
