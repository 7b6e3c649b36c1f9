"""Async-MSGD's delay x momentum trade-off (Liu et al., NeurIPS 2018), and asynchrony against a slow worker.

Claims (docs/algorithms.md "Async-MSGD" and "LSGD", asynchronous version): with
staleness ``tau`` the momentum must come down to converge and accelerate
(the best ``mu`` falls as ``tau`` grows; large ``mu`` with large ``tau``
diverges; plain SGD hardly notices ``tau``); and an asynchronous worker
never waits for the slowest one.

Two parts at 4 ranks:

1. the delay x momentum grid on streaming PCA in deterministic mode
   (:func:`mpiopt.bench.tradeoff.tradeoff_grid`, see docs/async.md), its
   rows spread over the ranks: ``results-async-tradeoff.png``;
2. the image task (digits, MLP) under ``sgd``, ``async_msgd`` and
   ``async_lsgd`` for the same wall-clock budget, with world rank
   :data:`SLOW_RANK` sleeping :data:`SLOW_SECONDS` after each gradient (the
   experiment's own compute function, not a product option): training loss
   against wall time, and the gradients each rank computed
   (``results-async-straggler.png``); then the test accuracy of the model
   each algorithm ends with (sgd: every rank's; async_msgd: the server's;
   async_lsgd: the final global leader's).  The asynchronous algorithms
   serve from world rank 0, so 3 ranks compute gradients where sgd has 4.
"""

from __future__ import annotations

import time
from typing import Any, Dict, List, Tuple

import numpy as np
import torch
import torch.nn.functional as F

from ..bench import tradeoff
from ..bench._common import markdown_table
from ..comm import Topology
from ..metrics.plots import running_mean
from ..tasks.images import ShardSampler
from ..tasks.models import build_model
from ..torch import DistributedOptimizer, broadcast_module
from ..torch.threads import set_threads
from . import EXPERIMENTS
from ._common import image_config, image_settings, new_figure, write_results

RANKS = EXPERIMENTS["async"].ranks
ALGORITHMS = ("sgd", "async_msgd", "async_lsgd")
SLOW_RANK = 3
SLOW_SECONDS = 0.02
BUDGET, QUICK_BUDGET = 30.0, 2.0
GRID = dict(delays=(0, 4, 16, 64), momenta=(0.0, 0.5, 0.8, 0.9), seeds=5, max_steps=3000)
QUICK_GRID = dict(delays=(0, 8), momenta=(0.0, 0.9), seeds=1, max_steps=300)


def distributed_grid(topology: Topology, delays, momenta, seeds: int, max_steps: int) -> tradeoff.TradeoffGrid:
    """:func:`~mpiopt.bench.tradeoff.tradeoff_grid`, delay ``i`` on rank ``i % size`` (a collective call)."""
    world = topology.world
    mine = [d for i, d in enumerate(sorted(delays)) if i % world.size == world.rank]
    part = tradeoff.tradeoff_grid(mine, momenta, range(1, seeds + 1), max_steps=max_steps) if mine else None
    parts = [p for p in world.allgather_obj(part) if p is not None]
    rows = sorted((d, p.iterations[i], p.status[i]) for p in parts for i, d in enumerate(p.delays))
    return tradeoff.TradeoffGrid([r[0] for r in rows], parts[0].momenta, np.stack([r[1] for r in rows]),
                                 np.stack([r[2] for r in rows]), parts[0].settings | {"max_steps": max_steps})


def straggler_run(topology: Topology, dataset: Any, config: Any, algorithm: str, budget: float) -> Tuple[float, List[List[Tuple[float, float]]]]:
    """Train ``algorithm`` for ``budget`` seconds with the slowed rank (a collective call).

    Returns the final model's test accuracy and, per world rank, its
    ``(seconds since the start, loss)`` of every gradient it computed.
    """
    world = topology.world
    set_threads(1)  # oversubscribed: one thread per rank
    torch.manual_seed(config.seed)
    model = build_model(config.model, input_shape=dataset.input_shape, num_classes=dataset.num_classes)
    opt = DistributedOptimizer(model.parameters(), algorithm, topology=topology, **config.algorithm_hyperparameters(algorithm))
    broadcast_module(model, topology)
    asynchronous = algorithm != "sgd"
    workers, worker_rank = (world.size - 1, world.rank - 1) if asynchronous else (world.size, world.rank)
    sampler = ShardSampler(len(dataset.y_train), rank=max(0, worker_rank), world_size=workers, batch_size=config.batch_size, seed=config.seed)
    x_train, y_train = torch.from_numpy(dataset.x_train), torch.from_numpy(dataset.y_train)
    log: List[Tuple[float, float]] = []

    def compute(step: int) -> torch.Tensor:
        index = sampler.indices(step)
        loss = F.cross_entropy(model(x_train[index]), y_train[index])
        loss.backward()
        if world.rank == SLOW_RANK:
            time.sleep(SLOW_SECONDS)  # the straggler
        log.append((time.perf_counter() - started, float(loss.detach())))
        return loss

    world.Barrier()
    started = time.perf_counter()
    if algorithm == "async_msgd":
        opt.run(compute, 10**9, until=lambda params, version: time.perf_counter() - started >= budget)
    elif algorithm == "async_lsgd":
        opt.run(compute, seconds=budget)
    else:
        step = 0
        while not world.bcast_obj(time.perf_counter() - started >= budget if world.rank == 0 else None):
            opt.zero_grad()
            loss = compute(step)
            opt.step(loss=loss)
            step += 1
    accuracy = float("nan")
    if world.rank == 0:  # rank 0 holds the model to evaluate under every algorithm (see the module's docstring)
        model.eval()
        with torch.no_grad():
            logits = model(torch.from_numpy(dataset.x_test))
        accuracy = float((logits.argmax(1) == torch.from_numpy(dataset.y_test)).float().mean())
    return accuracy, world.allgather_obj(log)


def _plot_straggler(results: Dict[str, Dict[str, Any]], budget: float, path: str) -> str:
    fig, axes = new_figure(2)
    for name, result in results.items():
        points = sorted(p for rank_log in result["logs"] for p in rank_log)
        if points:
            t, loss = np.array(points).T
            axes[0].plot(t, running_mean(loss, 25), label=f"{name} (test acc. {100 * result['accuracy']:.1f} %)")
    axes[0].set_xlabel("wall time (s)")
    axes[0].set_ylabel("training loss (running mean of 25 gradients)")
    axes[0].set_yscale("log")
    axes[0].legend(fontsize=8)
    axes[0].grid(alpha=0.3)
    width = 0.8 / len(results)
    for i, (name, result) in enumerate(results.items()):
        counts = [len(rank_log) for rank_log in result["logs"]]
        axes[1].bar(np.arange(len(counts)) + (i - (len(results) - 1) / 2) * width, counts, width, label=name)
    axes[1].set_xticks(range(RANKS), [f"rank {r}{' (slow)' if r == SLOW_RANK else ''}" for r in range(RANKS)])
    axes[1].set_ylabel(f"gradients computed in {budget:g} s")
    axes[1].legend(fontsize=8)
    fig.suptitle(f"Rank {SLOW_RANK} sleeps {1e3 * SLOW_SECONDS:g} ms per gradient; async: rank 0 serves")
    fig.savefig(path, dpi=100)
    return path


def run(out: str, quick: bool) -> Dict[str, Any]:
    """Both parts (a collective call at :data:`RANKS` ranks); the numbers on rank 0."""
    from ..training.data import load_data

    topology = Topology()
    world = topology.world
    spec = QUICK_GRID if quick else GRID
    grid = distributed_grid(topology, **spec)
    config = image_config(out, 1)
    dataset = load_data(config, world)
    budget = QUICK_BUDGET if quick else BUDGET
    results = {}
    for name in ALGORITHMS:
        accuracy, logs = straggler_run(topology, dataset, config, name, budget)
        results[name] = {"accuracy": accuracy, "logs": logs}
        if world.rank == 0:
            print(f"{name}: test accuracy {100 * accuracy:.1f} % after {budget:g} s, gradients per rank {[len(l) for l in logs]}", flush=True)
    rank = topology.rank
    topology.Free()
    if rank != 0:
        return {}
    figures = [f"{out}/results-async-tradeoff.png"]
    tradeoff.plot(grid, figures[0])
    figures.append(_plot_straggler(results, budget, f"{out}/results-async-straggler.png"))
    straggler = {
        name: {"test_accuracy": r["accuracy"], "gradients_per_rank": [len(l) for l in r["logs"]],
               "final_loss": float(np.mean([p[1] for l in r["logs"] for p in l[-10:]])) if any(r["logs"]) else None}
        for name, r in results.items()
    }
    rows = []
    for name, s in straggler.items():
        counts = s["gradients_per_rank"]
        rows.append([name, f"{100 * s['test_accuracy']:.1f} %", counts, f"{max(counts[1:SLOW_RANK]) / max(1, counts[SLOW_RANK]):.1f}"])
    table = markdown_table(["algorithm", "test accuracy", f"gradients per rank (0..{RANKS - 1})", "fast / slow rank"], rows, align="lrlr")
    markdown = (
        f"Streaming PCA, iterations to sin^2 <= {grid.settings['accuracy']:g} (mean of {spec['seeds']} seeds):\n\n"
        f"{tradeoff.markdown_table(grid)}\n\n"
        f"Digits/MLP for {budget:g} s each, rank {SLOW_RANK} sleeping {1e3 * SLOW_SECONDS:g} ms per gradient:\n\n{table}"
    )
    settings = image_settings(config, ALGORITHMS, RANKS, grid={**spec, **grid.settings}, budget_seconds=budget,
                              slow_rank=SLOW_RANK, slow_seconds=SLOW_SECONDS)
    numbers = {"grid": {"delays": grid.delays, "momenta": grid.momenta, "iterations": grid.iterations.tolist(),
                        "status": grid.status.tolist(), "best_momentum": grid.best_momentum()},
               "straggler": straggler}
    return write_results(out, "async", quick, settings, numbers, markdown, figures)
