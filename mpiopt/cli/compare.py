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
"""

from __future__ import annotations

import argparse
import os

from ..training.flags import add_config_arguments
from .session import read_settings, start_session


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_config_arguments(parser, "compare")


def run(args: argparse.Namespace) -> int:
    config, algorithms = read_settings(args, "compare")
    session = start_session(config, "compare", algorithms)
    from ..training.loop import train

    paths = []
    for number, name in enumerate(algorithms, 1):
        session.say(f"== {number}/{len(algorithms)}: {name}")
        paths.append(train(config, name, session.topology, session.dataset, os.path.join(session.out, name)))
    session.finish(paths, config)
    return 0
