"""Compressed outer exchanges: test loss against bytes sent for ``diloco`` with each codec and for ``sparseloco``.

Claims (docs/algorithms.md "SparseLoCo"; docs/codecs.md): quantizing DiLoCo's pseudo-gradient costs little loss
(bf16 and int8 within 1 % of float32 DiLoCo, fp4 within 3 %, as Streaming DiLoCo's 4-bit exchange), and
SparseLoCo's top-k with 2-bit values and error feedback sends over 140x fewer bytes at a loss within 3 %.
Every run trains the byte-level GPT on the offline text at :data:`RANKS` ranks with inner AdamW for the same
steps; ``sgd`` (data-parallel AdamW) is the reference.  Bytes are rank 0's ledger over the training steps.
"""

from __future__ import annotations

import os
import sys
from typing import Any, Dict, List, NamedTuple, Sequence

import numpy as np

from ..bench._common import markdown_table
from ..comm import Topology
from ..metrics import Run, read_metrics
from ..metrics.summary import format_bytes
from ..training.config import TrainConfig
from . import EXPERIMENTS
from ._common import new_figure, write_results

RANKS = EXPERIMENTS["codecs"].ranks
#: Codecs of diloco's outer exchange, float32 first (the reference of the quality goals).
CODECS = ("none", "bf16", "int8", "int4", "fp4", "sign", "topk")
#: Test loss at most this much above float32 diloco's, by codec (the issue's goals).
QUALITY_GOALS = {"bf16": 0.01, "int8": 0.01, "fp4": 0.03, "sparseloco": 0.03}
#: Bytes per outer step at least this many times fewer than float32 diloco's.
BYTE_GOALS = {"int8": 3.9, "fp4": 7.5, "sparseloco": 140.0}
TEXT = dict(dataset="text", model="gpt", n_layer=2, n_embd=128, n_head=4, block_size=64, batch_size=4, seed=0,
            optimizer="adamw")
QUICK_TEXT = dict(TEXT, n_layer=1, n_embd=32, n_head=2, block_size=32)
STEPS, QUICK_STEPS = 300, 8
PERIOD, QUICK_PERIOD = 30, 4


class Spec(NamedTuple):
    """One run: its label, algorithm, and its own hyperparameters."""

    label: str
    algorithm: str
    hyperparameters: Dict[str, Any]


def plan(period: int) -> List[Spec]:
    """The data-parallel reference, diloco with each codec, then sparseloco, all at the same H."""
    specs = [Spec("sgd (data-parallel)", "sgd", {})]
    specs += [Spec(f"diloco {codec}", "diloco", {"period": period, "codec": codec}) for codec in CODECS]
    return specs + [Spec("sparseloco", "sparseloco", {"period": period})]


def text_config(out: str, steps: int, quick: bool, hyperparameters: Dict[str, Any]) -> TrainConfig:
    """The text task, ``steps`` per rank, 10 evaluations."""
    return TrainConfig(**(QUICK_TEXT if quick else TEXT), steps=steps, eval_every=max(1, steps // 10), out=out,
                       hyperparameters=hyperparameters, log_every=max(1, steps // 3))


def outcome(spec: Spec, run: Run) -> Dict[str, Any]:
    """Bytes per rank (the training steps'), the largest step's bytes, and the last evaluation's test loss."""
    sent = np.array([s["bytes_sent"] for s in run.steps], dtype=np.int64)
    last = run.evals[-1]
    return {"label": spec.label, "algorithm": spec.algorithm, "codec": spec.hyperparameters.get("codec"),
            "bytes_per_rank": int(sent.sum()), "bytes_per_outer_step": int(sent.max()),
            "test_loss": float(last["test_loss"]), "bits_per_byte": float(last["bits_per_byte"]),
            "wall_seconds": float(run.steps[-1]["wall_seconds"])}


def _plot(rows: Sequence[Dict[str, Any]], runs: Sequence[Run], path: str) -> str:
    """Test loss against bytes per rank (log scale), and test loss against steps."""
    fig, (left, right) = new_figure(2)
    for marker, row, run in zip("os^v<>DPX*", rows, runs):
        left.plot(max(row["bytes_per_rank"], 1), row["test_loss"], marker, markersize=8, linestyle="none", label=row["label"])
        right.plot([e["step"] for e in run.evals], [e["test_loss"] for e in run.evals], marker + "-", markersize=4, label=row["label"])
    left.set_xscale("log")
    left.set_xlabel("bytes sent per rank (training steps)")
    right.set_xlabel("step")
    for ax in (left, right):
        ax.set_ylabel("test loss (nats per byte)")
        ax.grid(alpha=0.3)
    left.legend(fontsize=7)
    fig.savefig(path, dpi=100)
    return path


def _verdicts(rows: Sequence[Dict[str, Any]]) -> Dict[str, Dict[str, Any]]:
    """Each goal's measured value and whether it was met, against float32 diloco."""
    by_label = {r["label"]: r for r in rows}
    base = by_label["diloco none"]
    verdicts = {}
    for name, goal in QUALITY_GOALS.items():
        row = by_label["sparseloco" if name == "sparseloco" else f"diloco {name}"]
        excess = row["test_loss"] / base["test_loss"] - 1
        verdicts[f"{name} loss"] = {"measured": excess, "goal": goal, "met": excess <= goal}
    for name, goal in BYTE_GOALS.items():
        row = by_label["sparseloco" if name == "sparseloco" else f"diloco {name}"]
        ratio = base["bytes_per_outer_step"] / max(row["bytes_per_outer_step"], 1)
        verdicts[f"{name} bytes"] = {"measured": ratio, "goal": goal, "met": ratio >= goal}
    return verdicts


def run(out: str, quick: bool) -> Dict[str, Any]:
    """Every run (a collective call at :data:`RANKS` ranks); the numbers on rank 0."""
    from ..training.data import load_data
    from ..training.loop import train

    topology = Topology()
    steps, period = (QUICK_STEPS, QUICK_PERIOD) if quick else (STEPS, PERIOD)
    specs = plan(period)
    dataset = load_data(text_config(out, steps, quick, {}), topology.world)
    stream = sys.stdout if topology.rank == 0 else None
    paths = []
    for spec in specs:
        config = text_config(out, steps, quick, {spec.algorithm: spec.hyperparameters})
        config.validate([spec.algorithm])
        folder = os.path.join(out, spec.label.split(" (")[0].replace(" ", "-"))
        paths.append(train(config, spec.algorithm, topology, dataset, folder, stream=stream))
    rank = topology.rank
    topology.Free()
    if rank != 0:
        return {}
    runs = [read_metrics(path) for path in paths]
    rows = [outcome(spec, r) for spec, r in zip(specs, runs)]
    base = next(r for r in rows if r["label"] == "diloco none")
    for r in rows:
        r["loss_vs_float32_diloco"] = r["test_loss"] / base["test_loss"] - 1
        r["fewer_bytes_than_float32_diloco"] = base["bytes_per_outer_step"] / max(r["bytes_per_outer_step"], 1)
    verdicts = _verdicts(rows)
    figure = _plot(rows, runs, os.path.join(out, "results-codecs-loss-bytes.png"))
    config = text_config(out, steps, quick, {})
    table = markdown_table(
        ["run", "bytes per rank", "bytes per outer step", "fewer than float32 diloco", "test loss", "vs float32 diloco",
         "bits per byte"],
        [[r["label"], format_bytes(r["bytes_per_rank"]), format_bytes(r["bytes_per_outer_step"]),
          f"{r['fewer_bytes_than_float32_diloco']:.1f}x", f"{r['test_loss']:.4f}", f"{100 * r['loss_vs_float32_diloco']:+.2f} %",
          f"{r['bits_per_byte']:.3f}"] for r in rows],
        align="lrrrrrr",
    )
    goals = markdown_table(
        ["goal", "measured", "goal", "met"],
        [[name, f"{100 * v['measured']:+.2f} %" if "loss" in name else f"{v['measured']:.1f}x", (f"<= {100 * v['goal']:.0f} %" if "loss" in name
          else f">= {v['goal']:g}x"), "yes" if v["met"] else "no"] for name, v in verdicts.items()],
        align="lrrl",
    )
    markdown = (
        f"Text task ({config.dataset}/{config.model}, n_layer {config.n_layer}, n_embd {config.n_embd}, block "
        f"{config.block_size}; batch {config.batch_size} per rank, {steps} steps, H = {period}, {RANKS} ranks, inner AdamW):\n\n"
        f"{table}\n\nGoals (loss: test loss above float32 diloco's at equal steps; bytes: the largest step's, an outer "
        f"step's exchange):\n\n{goals}"
    )
    settings = {"ranks": RANKS, "steps": steps, "period": period, "parameters": runs[0].header["parameters"], "task": {k: getattr(config, k) for k in TEXT},
                "runs": [s._asdict() for s in specs]}
    return write_results(out, "codecs", quick, settings, {"runs": rows, "goals": verdicts}, markdown, [figure])
