"""DiLoCo's communication against quality (Douillard et al. 2023), and Streaming DiLoCo's peak bytes (2025).

Claims (docs/algorithms.md "DiLoCo"): ``H`` inner AdamW steps, then an outer
Nesterov step on the ranks' mean pseudo-gradient, reach data-parallel
training's loss with about ``H`` times fewer bytes; quality degrades slowly
as ``H`` grows; more workers help.  Streaming DiLoCo: exchanging ``F``
fragments at staggered steps cuts the peak bytes of a step about ``F``-fold.

Every run trains the image task (digits, MLP) through the training front
end with inner ``torch.optim.AdamW`` (``--optimizer adamw``, lr 1e-3, its
defaults) for the same steps per rank:

1. at :data:`RANKS` ranks: ``sgd`` (data-parallel AdamW on the mean
   gradient), ``dasgd``, ``lsgd`` and ``easgd`` (their defaults, AdamW as
   local update), ``diloco`` at each ``H`` of the sweep (outer lr 0.7,
   Nesterov momentum 0.9, the paper's) and ``streaming_diloco`` with
   :data:`FRAGMENTS` fragments (overlap 1 step, alpha 0.5, its defaults);
2. at :data:`FEW_RANKS` ranks (world ranks 0 and 1, :meth:`Topology.first`,
   while the others wait): ``sgd`` and the ``diloco`` sweep.

Bytes are the training steps' own (rank 0's ``bytes_sent`` summed over the
step records, the ledger's convention); the peak is the largest step's.
The training loss is rank 0's on its own batches, of its own model: for the
local methods (all but ``sgd``) that model between averagings, fitted to
rank 0's shard, so the test loss and accuracy (of the model each algorithm
evaluates; for ``diloco`` the ranks' common model after the last outer
step) are the fair measures of quality.  Figures: final
training loss (mean of the last 10 % of steps), test loss and test accuracy
against bytes per rank, and the bytes of each step of ``diloco`` and
``streaming_diloco`` at the same ``H`` (``results-diloco-bytes.png``);
test accuracy and training loss curves of the :data:`RANKS`-rank runs
(``results-diloco-accuracy.png``, ``results-diloco-loss.png``).
"""

from __future__ import annotations

import dataclasses
import os
import sys
from typing import Any, Dict, List, NamedTuple, Optional, Sequence

import numpy as np

from ..bench._common import markdown_table
from ..comm import Topology
from ..metrics import Run, plot_runs, read_metrics
from ..metrics.summary import format_bytes
from . import EXPERIMENTS
from ._common import image_config, image_heading, new_figure, write_results

RANKS = EXPERIMENTS["diloco"].ranks
FEW_RANKS = 2
BASELINES = ("sgd", "dasgd", "lsgd", "easgd")
FRAGMENTS = 4
STEPS, QUICK_STEPS = 600, 20
#: The H sweep, and the H of the streaming run.
PERIODS, QUICK_PERIODS = (1, 10, 50, 100), (1, 2, 5, 10)
STREAMING_PERIOD, QUICK_STREAMING_PERIOD = 50, 5


class Spec(NamedTuple):
    """One training run: its label, algorithm, ranks, H (None: no period) and its own hyperparameters."""

    label: str
    algorithm: str
    ranks: int
    period: Optional[int]
    hyperparameters: Dict[str, Any]

    @property
    def folder(self) -> str:
        return f"{self.ranks}ranks-{self.algorithm}" + ("" if self.period is None else f"-H{self.period}")


def plan(periods: Sequence[int], streaming_period: int) -> List[Spec]:
    """Every run, the :data:`RANKS`-rank ones first."""
    specs = [Spec(name, name, RANKS, None, {}) for name in BASELINES]
    specs += [Spec(f"diloco H={h}", "diloco", RANKS, h, {"period": h}) for h in periods]
    specs.append(Spec(f"streaming_diloco H={streaming_period} F={FRAGMENTS}", "streaming_diloco", RANKS, streaming_period,
                      {"period": streaming_period, "fragments": FRAGMENTS}))
    specs.append(Spec(f"sgd, {FEW_RANKS} ranks", "sgd", FEW_RANKS, None, {}))
    return specs + [Spec(f"diloco H={h}, {FEW_RANKS} ranks", "diloco", FEW_RANKS, h, {"period": h}) for h in periods]


def train_specs(topology: Topology, specs: Sequence[Spec], out: str, steps: int) -> List[str]:
    """Train each of ``specs`` at ``topology``'s size (a collective call on it); the metrics files on rank 0."""
    from ..training.data import load_data
    from ..training.loop import train

    dataset = load_data(image_config(out, steps, optimizer="adamw"), topology.world)
    stream = sys.stdout if topology.rank == 0 else None
    paths = []
    for spec in specs:
        config = image_config(out, steps, optimizer="adamw", hyperparameters={spec.algorithm: spec.hyperparameters})
        config.validate([spec.algorithm])
        paths.append(train(config, spec.algorithm, topology, dataset, os.path.join(out, spec.folder), stream=stream))
    return paths


def outcome(spec: Spec, run: Run, steps: int) -> Dict[str, Any]:
    """The numbers of one run: bytes per rank and at the busiest step, final training loss, test loss and accuracy."""
    sent = np.array([s["bytes_sent"] for s in run.steps], dtype=np.int64)
    last = run.evals[-1]
    return {"label": spec.label, "algorithm": spec.algorithm, "ranks": spec.ranks, "period": spec.period,
            "bytes_per_rank": int(sent.sum()), "peak_bytes_per_step": int(sent.max()),
            "final_train_loss": float(np.mean([s["loss"] for s in run.steps[-max(1, steps // 10):]])),
            "test_loss": float(last["test_loss"]), "test_accuracy": float(last["test_accuracy"]),
            "wall_seconds": float(run.steps[-1]["wall_seconds"])}


def _plot_bytes(rows: Sequence[Dict[str, Any]], per_step: Dict[str, np.ndarray], period: int, path: str) -> str:
    """Training loss, test loss and test accuracy against bytes per rank (one marker per run), then ``per_step``'s bytes."""
    fig, axes = new_figure(4, width=4.5)
    panels = (("final_train_loss", 1.0, "training loss, last 10 % of steps"), ("test_loss", 1.0, "test loss"),
              ("test_accuracy", 100.0, "test accuracy (%)"))
    for ax, (key, scale, ylabel) in zip(axes, panels):
        for ranks, style in ((RANKS, "o-"), (FEW_RANKS, "s--")):
            sweep = [r for r in rows if r["algorithm"] == "diloco" and r["ranks"] == ranks]
            x, y = [r["bytes_per_rank"] for r in sweep], [scale * r[key] for r in sweep]
            ax.plot(x, y, style, label=f"diloco, {ranks} ranks")
            for r, xi, yi in zip(sweep, x, y):
                ax.annotate(f"H={r['period']}", (xi, yi), textcoords="offset points", xytext=(4, 4), fontsize=7)
        for marker, r in zip("^v<>DPX*", [r for r in rows if r["algorithm"] != "diloco"]):
            ax.plot(r["bytes_per_rank"], scale * r[key], marker, markersize=8, linestyle="none", label=r["label"])
        ax.set_xscale("log")
        ax.set_xlabel("bytes sent per rank (training steps)")
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)
    axes[0].set_yscale("log")
    axes[0].legend(fontsize=7)
    for label, sent in per_step.items():
        shown = sent[: 2 * period + 2]
        axes[3].plot(np.arange(1, len(shown) + 1), shown / 1e3, drawstyle="steps-mid", label=label)
    axes[3].set_xlabel("step")
    axes[3].set_ylabel("kB sent by rank 0 in the step")
    axes[3].set_title(f"Bytes per step, first {2 * period + 2} steps", fontsize=9)
    axes[3].legend(fontsize=7)
    fig.savefig(path, dpi=100)
    return path


def run(out: str, quick: bool) -> Dict[str, Any]:
    """Every run (a collective call at :data:`RANKS` ranks); the numbers on rank 0."""
    topology = Topology()
    steps = QUICK_STEPS if quick else STEPS
    streaming_period = QUICK_STREAMING_PERIOD if quick else STREAMING_PERIOD
    specs = plan(QUICK_PERIODS if quick else PERIODS, streaming_period)
    paths = train_specs(topology, [s for s in specs if s.ranks == RANKS], out, steps)
    few = topology.first(FEW_RANKS)
    if few is not None:
        paths += train_specs(few, [s for s in specs if s.ranks == FEW_RANKS], out, steps)
        few.Free()
    topology.world.Barrier(sleeping=True)  # the few ranks' runs take a while: the others must not take their cores
    rank = topology.rank
    topology.Free()
    if rank != 0:
        return {}
    runs = [read_metrics(path) for path in paths]
    rows = [outcome(spec, r, steps) for spec, r in zip(specs, runs)]
    sgd_bytes = {r["ranks"]: r["bytes_per_rank"] for r in rows if r["algorithm"] == "sgd"}
    for r in rows:
        r["bytes_ratio_to_sgd"] = r["bytes_per_rank"] / sgd_bytes[r["ranks"]]
    by_label = {r["label"]: r for r in rows}
    diloco, streaming = by_label[f"diloco H={streaming_period}"], next(r for r in rows if r["algorithm"] == "streaming_diloco")
    per_step = {s.label: np.array([x["bytes_sent"] for x in r.steps], dtype=float) for s, r in zip(specs, runs)
                if s.label in (diloco["label"], streaming["label"])}
    labelled = [dataclasses.replace(r, header={**r.header, "algorithm": s.label}) for s, r in zip(specs, runs) if s.ranks == RANKS]
    figures = plot_runs(labelled, out, prefix="results-diloco-")
    figures.append(_plot_bytes(rows, per_step, streaming_period, f"{out}/results-diloco-bytes.png"))
    config = image_config(out, steps, optimizer="adamw")
    table = markdown_table(
        ["run", "ranks", "H", "bytes per rank", "ratio to sgd", "training loss, last 10 %", "test loss", "test accuracy",
         "peak bytes per step"],
        [[r["label"], r["ranks"], r["period"] or "—", format_bytes(r["bytes_per_rank"]), f"{r['bytes_ratio_to_sgd']:.3g}",
          f"{r['final_train_loss']:.2e}", f"{r['test_loss']:.3f}", f"{100 * r['test_accuracy']:.1f} %",
          format_bytes(r["peak_bytes_per_step"])] for r in rows],
        align="lrrrrrrrr",
    )
    peak_ratio = diloco["peak_bytes_per_step"] / streaming["peak_bytes_per_step"]
    markdown = (
        f"{image_heading(config, RANKS, f' and {FEW_RANKS}; inner AdamW lr 1e-3')}\n\n{table}\n\n"
        f"Peak bytes per step at H = {streaming_period}: diloco {format_bytes(diloco['peak_bytes_per_step'])}, "
        f"streaming_diloco with {FRAGMENTS} fragments {format_bytes(streaming['peak_bytes_per_step'])} "
        f"({peak_ratio:.2f}x lower), for {streaming['bytes_per_rank'] / diloco['bytes_per_rank']:.2f}x diloco's total bytes."
    )
    settings = {"ranks": [RANKS, FEW_RANKS], "task": f"{config.dataset}/{config.model}", "batch_size": config.batch_size,
                "steps": steps, "optimizer": "adamw", "runs": [s._asdict() for s in specs]}
    numbers = {"runs": rows, "streaming_peak_ratio": peak_ratio}
    return write_results(out, "diloco", quick, settings, numbers, markdown, figures)
