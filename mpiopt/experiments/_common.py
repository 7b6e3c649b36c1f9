"""What the experiments share: image-task runs through the training front end, and the results files."""

from __future__ import annotations

import os
import sys
from typing import Any, Dict, List, Optional, Sequence, Tuple

from ..bench._common import write_json
from ..comm import Topology
from ..metrics import Run, markdown_table, plot_runs, read_metrics, summarize
from ..training.config import TrainConfig

__all__ = ["IMAGE_TASK", "image_config", "image_settings", "image_heading", "train_images", "write_results", "new_figure"]

#: The image task of every experiment: the offline 8x8 digits and the 2-hidden-layer MLP (about 26k parameters).
IMAGE_TASK = dict(dataset="digits", model="mlp", batch_size=32, seed=0)


def image_config(out: str, steps: int, *, hyperparameters: Optional[Dict[str, Any]] = None, **settings: Any) -> TrainConfig:
    """A :class:`TrainConfig` for :data:`IMAGE_TASK`, ``steps`` per rank, 10 evaluations."""
    return TrainConfig(**{**IMAGE_TASK, **settings}, steps=steps, eval_every=max(1, steps // 10), out=out,
                       hyperparameters=dict(hyperparameters or {}), log_every=max(1, steps // 2))


def image_settings(config: TrainConfig, algorithms: Sequence[str], ranks: int, **extra: Any) -> Dict[str, Any]:
    """The ``settings`` of results.json for ``algorithms`` on ``config``'s image task at ``ranks`` ranks, then ``extra``."""
    return {"algorithms": list(algorithms), "ranks": ranks, "task": f"{config.dataset}/{config.model}",
            "batch_size": config.batch_size, "hyperparameters": {a: config.algorithm_hyperparameters(a) for a in algorithms},
            **extra}


def image_heading(config: TrainConfig, ranks: int, detail: str = "") -> str:
    """The line above the image task's table: task, steps and batch per rank, ``ranks`` ranks, then ``detail``."""
    return (f"Image task ({config.dataset}/{config.model}, {config.steps} steps per rank, batch {config.batch_size} per rank, "
            f"{ranks} ranks{detail}):")


def train_images(topology: Topology, config: TrainConfig, algorithms: Sequence[str],
                 prefix: str) -> Tuple[List[Run], List[Dict[str, Any]], List[str], str]:
    """Train each of ``algorithms`` as ``config`` says, one after another (a collective call).

    Every run's files go to ``config.out/<algorithm>/``.  On rank 0, returns
    the runs read back, their :func:`~mpiopt.metrics.summarize` (to
    ``config.target_accuracy``), the figures of
    :func:`~mpiopt.metrics.plot_runs` (``<prefix>accuracy.png``,
    ``<prefix>loss.png``: against steps, wall time and bytes) and the
    summaries' Markdown table; elsewhere ``([], [], [], "")``.
    """
    from ..training.data import load_data
    from ..training.loop import train

    config.validate(algorithms)
    dataset = load_data(config, topology.world)
    stream = sys.stdout if topology.rank == 0 else None
    paths = [train(config, name, topology, dataset, os.path.join(config.out, name), stream=stream) for name in algorithms]
    if topology.rank != 0:
        return [], [], [], ""
    runs = [read_metrics(path) for path in paths]
    figures = plot_runs(runs, config.out, prefix=prefix)
    summaries = [summarize(run, target_accuracy=config.target_accuracy) for run in runs]
    return runs, summaries, figures, markdown_table(summaries)


def write_results(out: str, name: str, quick: bool, settings: Dict[str, Any], numbers: Dict[str, Any], markdown: str,
                  figures: Sequence[str]) -> Dict[str, Any]:
    """Write ``results.json`` and ``results.md`` into ``out`` (rank 0 only) and print the Markdown; return the JSON document."""
    document = {"experiment": name, "quick": quick, "settings": settings, "numbers": numbers,
                "figures": [os.path.basename(path) for path in figures]}
    write_json(os.path.join(out, "results.json"), document)
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
