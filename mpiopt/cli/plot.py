"""``mpiopt plot``: redraw the figures and the results table from metrics files.

Reads ``metrics.jsonl`` files (from ``train`` or ``compare``; a folder is
searched for them) and writes ``accuracy.png``, ``loss.png`` and
``results.md`` into ``--out``.  Runs in one process; no MPI launcher needed.
Several files of one algorithm (``compare --repeats``) make one row of the
table: each column's median over them and its range.
"""

from __future__ import annotations

import argparse
import glob
import math
import os
from typing import Any, List, Optional, Sequence, Tuple

from ..training.config import TEXT_TARGET_LOSS, UsageError


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("files", nargs="+", metavar="FILE", help="metrics.jsonl files, or folders searched for them")
    parser.add_argument("--out", required=True, metavar="DIR", help="folder for the figures and results.md (created if missing)")
    parser.add_argument("--target-accuracy", type=float, default=0.9, metavar="X", help="test accuracy for the to-target columns (default: 0.9)")
    parser.add_argument("--target-loss", type=float, default=None, metavar="X",
                        help="test loss for the to-target columns instead of --target-accuracy (the table then shows the test loss too; "
                        f"default for language models: {TEXT_TARGET_LOSS:g})")
    parser.add_argument("--budget-seconds", type=float, default=None, metavar="T",
                        help="add a column: the test loss at the last evaluation within T seconds of training (default: none)")
    parser.add_argument("--baseline", default=None, metavar="ALGORITHM",
                        help="add a column: each run's speed-up to the target over this algorithm's run of the same seed, "
                        "e.g. ddp (default: none)")


def write_report(
    runs: Sequence[Any], out: str, target_accuracy: float, heading: str = "", groups: "Sequence[Sequence[Any]] | None" = None,
    target_loss: Optional[float] = None, budget_seconds: Optional[float] = None, baseline: Optional[str] = None,
) -> Tuple[str, str, List[str]]:
    """``OUT/results.md`` (``heading`` first, then the table of ``runs``) and the figures; returns (table, its path, figures).

    With ``groups`` (the runs again, one list per algorithm of its repeats) the
    table has one row per algorithm: medians over the repeats and their ranges.
    A ``target_loss`` replaces ``target_accuracy`` as the target (language models: default ``TEXT_TARGET_LOSS``); ``budget_seconds`` adds the loss within that budget;
    ``baseline`` (an algorithm among the runs) adds each run's speed-up to the target over it, from the same seed.
    """
    from ..metrics import add_speedups, markdown_table, plot_runs, repeats_table, summarize

    if target_loss is None and runs and all(any("bits_per_byte" in e for e in run.evals) for run in runs):
        target_loss = TEXT_TARGET_LOSS  # language models: a loss to reach, not a next-byte accuracy
    target = dict(target_accuracy=target_accuracy) if target_loss is None else dict(target_loss=target_loss)
    target["budget_seconds"] = budget_seconds
    summaries = [[summarize(run, **target) for run in group] for group in (groups or [runs])]
    if baseline is not None:
        add_speedups([s for group in summaries for s in group], baseline)
    table = repeats_table(summaries) if groups else markdown_table(summaries[0])
    results = os.path.join(out, "results.md")
    with open(results, "w") as handle:
        handle.write(f"{heading}\n\n{table}\n" if heading else f"{table}\n")
    return table, results, plot_runs(runs, out, group_repeats=bool(groups))


def run(args: argparse.Namespace) -> int:
    from ..metrics import read_metrics

    if not (0 < args.target_accuracy <= 1):
        raise UsageError(f"--target-accuracy must be in (0, 1], got {args.target_accuracy}")
    if args.target_loss is not None and not (math.isfinite(args.target_loss) and args.target_loss > 0):
        raise UsageError(f"--target-loss must be a finite loss > 0, got {args.target_loss}")
    if args.budget_seconds is not None and not (math.isfinite(args.budget_seconds) and args.budget_seconds > 0):
        raise UsageError(f"--budget-seconds must be a finite number of seconds > 0, got {args.budget_seconds}")
    paths = []
    for item in args.files:
        if os.path.isdir(item):
            found = sorted(glob.glob(os.path.join(item, "**", "metrics.jsonl"), recursive=True))
            if not found:
                raise UsageError(f"folder {item!r} holds no metrics.jsonl")
            paths += found
        elif os.path.isfile(item):
            paths.append(item)
        else:
            raise UsageError(f"no such file or folder: {item!r}")
    try:
        runs = [read_metrics(p) for p in paths]
    except ValueError as err:
        raise UsageError(str(err)) from None
    os.makedirs(args.out, exist_ok=True)
    by_algorithm: dict = {}
    for one in runs:
        by_algorithm.setdefault(one.algorithm, []).append(one)
    repeated = list(by_algorithm.values()) if any(len(g) > 1 for g in by_algorithm.values()) else None
    if args.baseline is not None and args.baseline not in by_algorithm:
        raise UsageError(f"--baseline {args.baseline!r}: no run of it among {', '.join(sorted(by_algorithm))}")
    table, _, figures = write_report(runs, args.out, args.target_accuracy, groups=repeated, target_loss=args.target_loss,
                                     budget_seconds=args.budget_seconds, baseline=args.baseline)
    print(table)
    for path in figures:
        print(f"figure: {path}")
    return 0
