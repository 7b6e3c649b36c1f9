"""``mpiopt compare``: several algorithms on the same task, seed and ranks, one after another in one job.

Each algorithm trains a fresh model from the same seed (``OUT/<algorithm>/
metrics.jsonl``); then rank 0 writes ``OUT/results.md``, a Markdown table
(final and best test accuracy, wall time, time and bytes to reach
``--target-accuracy``, bytes sent per rank, and where the time went:
compute, the algorithm's own work, blocking communication, waiting), and
``OUT/accuracy.png`` and ``OUT/loss.png`` (test accuracy and training loss
against steps, wall time and bytes sent), and prints the table.

``ddp`` in ``--algorithms`` adds the baseline, torch DistributedDataParallel
on gloo with ``sgd``'s hyperparameters (:mod:`mpiopt.training.ddp`: its bytes
are estimated, its Allreduce time is inside its compute time).

Per-algorithm settings: ``--hp lsgd.pull_local=0.2`` or a
``[hyperparameters.lsgd]`` table in ``--config``; shared ones without the
prefix.  Evaluated model: see ``mpiopt train --help``.

``--repeats N`` trains each algorithm N times, with seeds seed, seed+1, ...,
into ``OUT/<algorithm>/run<k>/`` (k = 1..N); the table then shows, per
algorithm, each column's median over the repeats with its range,
"12.3 s (11.8-13.1)", and the number of repeats.  N = 1 (the default) writes
``OUT/<algorithm>/`` as before.
"""

from __future__ import annotations

import argparse
import dataclasses
import os

from ..training.flags import add_config_arguments
from ..training.config import UsageError
from .session import read_settings, start_session


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_config_arguments(parser, "compare")
    parser.add_argument(
        "--repeats", type=int, default=1, metavar="N",
        help="train each algorithm N times, with seeds seed, seed+1, ..., seed+N-1, into OUT/<algorithm>/run<k>/ (k = 1..N); "
        "the results table shows each column's median over the repeats with its range (min-max) (default: 1: OUT/<algorithm>/)",
    )


def run(args: argparse.Namespace) -> int:
    repeats = getattr(args, "repeats", 1)
    if repeats < 1:
        raise UsageError(f"--repeats must be an integer >= 1, got {repeats}")
    config, algorithms = read_settings(args, "compare")
    session = start_session(config, "compare", algorithms)
    from ..training.loop import train

    if repeats == 1:
        paths = []
        for number, name in enumerate(algorithms, 1):
            session.say(f"== {number}/{len(algorithms)}: {name}")
            paths.append(train(config, name, session.topology, session.dataset, os.path.join(session.out, name)))
        session.finish(paths, config)
        return 0
    groups = []
    for number, name in enumerate(algorithms, 1):
        group = []
        for k in range(1, repeats + 1):
            seed = config.seed + k - 1
            session.say(f"== {number}/{len(algorithms)}: {name}, repeat {k}/{repeats} (seed {seed})")
            run_config = dataclasses.replace(config, seed=seed)
            group.append(train(run_config, name, session.topology, session.dataset, os.path.join(session.out, name, f"run{k}")))
        groups.append(group)
    session.finish([p for g in groups for p in g], config, groups=groups)
    return 0
