"""``mpiopt compare``: several algorithms on the same task, seed and ranks, one after another in one job.

Each algorithm trains a fresh model from the same seed (``OUT/<algorithm>/
metrics.jsonl``); then rank 0 writes ``OUT/results.md``, a Markdown table
(final and best test accuracy, wall time, time and bytes to reach
``--target-accuracy``, or with ``--target-loss`` the test loss and the time
and bytes to reach that loss, bytes sent per rank, and where the time went:
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
into ``OUT/<algorithm>/run<k>/`` (k = 1..N), round by round (every algorithm
once per round, so that drifting machine load hits them alike); the table then shows, per
algorithm, each column's median over the repeats with its range,
"12.3 s (11.8-13.1)", and the number of repeats.  N = 1 (the default) writes
``OUT/<algorithm>/`` as before.

``--optimizer`` steps every algorithm that takes an inner optimizer and the
``ddp`` baseline; signum and the asynchronous algorithms keep their own
update (``train`` refuses ``--optimizer`` for them).  Every algorithm's
settings are checked before the first run: a rate or momentum given to an
algorithm that ``--optimizer`` steps is refused, naming ``--lr`` or ``--hp
OPTIMIZER.KEY`` instead.

``--sweep KEY=V1,V2`` (see :mod:`mpiopt.cli.sweep`) tunes a hyperparameter
with short runs first; the main runs use each algorithm's best value.
"""

from __future__ import annotations

import argparse
import dataclasses
from functools import partial
import os

from ..training.flags import add_config_arguments
from ..training.config import UsageError
from . import sweep
from .session import read_settings, start_session


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_config_arguments(parser, "compare")
    parser.add_argument(
        "--repeats", type=int, default=1, metavar="N",
        help="train each algorithm N times, with seeds seed, seed+1, ..., seed+N-1, into OUT/<algorithm>/run<k>/ (k = 1..N); "
        "the results table shows each column's median over the repeats with its range (min-max) (default: 1: OUT/<algorithm>/)",
    )
    parser.add_argument(
        "--sweep", action="append", default=[], metavar="KEY=V1,V2",
        help="before the main runs, try each value of a hyperparameter (a key of the algorithms' schemas, or lr; "
        "ALGORITHM.KEY=... for one algorithm) in a short run per value, and keep, per algorithm, the one with the lowest "
        "test loss at the last evaluation; several --sweep flags form a grid. Runs in OUT/sweep/, scores in OUT/sweep.json and results.md",
    )
    parser.add_argument(
        "--sweep-steps", type=int, default=None, metavar="N",
        help="steps of each tuning run (default: a quarter of the main run's steps, at least 1; with --epochs, a quarter epoch's worth is not "
        "known before the data loads, so give it)",
    )


def run(args: argparse.Namespace) -> int:
    repeats = getattr(args, "repeats", 1)
    if repeats < 1:
        raise UsageError(f"--repeats must be an integer >= 1, got {repeats}")
    config, algorithms = read_settings(args, "compare")
    if config.on_failure == "respawn":  # agreed settings: every rank refuses alike
        raise UsageError("--on-failure respawn is mpiopt train's (its replacements resume one run); compare takes abort or shrink")
    axes = sweep.parse_sweeps(getattr(args, "sweep", []) or [])
    sweep_steps = getattr(args, "sweep_steps", None)
    if sweep_steps is not None and not axes:
        raise UsageError("--sweep-steps only applies with --sweep")
    if axes:
        sweep.validate(config, algorithms, axes)
        if sweep_steps is None and config.steps:
            sweep_steps = max(1, config.steps // 4)
        if sweep_steps is None or sweep_steps < 1:
            raise UsageError("--sweep needs --sweep-steps N >= 1 (or --steps, to take a quarter of)")
    session = start_session(config, "compare", algorithms)
    from ..asyncrt import ServerLost
    from ..comm import IslandLeft
    from ..training.loop import train
    from ..training.survival import surviving_the_start

    own_update = [name for name in algorithms if config.for_algorithm(name) is not config]
    if own_update:
        session.say(f"--optimizer {config.optimizer} steps every algorithm but {', '.join(own_update)}: "
                    "they keep their own update (see each one's help)")

    configs = {name: config for name in algorithms}  # each algorithm's, its sweep's choice in it
    section = ""
    if axes:
        chosen: dict = {}
        tried: dict = {}
        for name in algorithms:
            tried[name] = []
            for k, point in enumerate(sweep.grid(axes, name), 1):
                session.say(f"== sweep {name}: " + ", ".join(f"{key}={value}" for key, value in point.items()))
                short = sweep.tuning_config(config, name, point, sweep_steps)
                path = train(short, name, session.topology, session.dataset, os.path.join(session.out, "sweep", name, str(k)))
                tried[name].append({"values": point, "score": sweep.score(path) if session.rank == 0 else None, "metrics": path})
            chosen[name] = sweep.choose(tried[name])["values"]  # rank 0's is the one that counts: it read the scores
        chosen = session.topology.world.bcast_obj(chosen if session.rank == 0 else None)
        configs = {name: sweep.with_point(config, name, chosen[name]) for name in algorithms}
        if session.rank == 0:
            section = sweep.report(session.out, chosen, tried, sweep_steps)

    # Round by round (every algorithm once per repeat), so that a change in the machine's load hits them all alike.
    groups: list = [[] for _ in algorithms]
    for k in range(1, repeats + 1):
        seed = config.seed + k - 1
        for number, name in enumerate(algorithms, 1):
            session.say(f"== {f'repeat {k}/{repeats} (seed {seed}), ' if repeats > 1 else ''}{number}/{len(algorithms)}: {name}")
            folder = os.path.join(session.out, name, f"run{k}") if repeats > 1 else os.path.join(session.out, name)
            try:
                run = dataclasses.replace(configs[name], seed=seed)
                groups[number - 1].append(surviving_the_start(partial(train, run, name, session.topology, session.dataset, folder),
                                                              session.topology, run.islands_for(name)))
            except ServerLost:  # every survivor said so (training/survival.py): an error's exit, no traceback
                return 1
            except IslandLeft as left:  # said on this rank: its island's part ended; an error's exit if no island goes on
                return 0 if left.size else 1
    session.finish([p for g in groups for p in g], config, groups=groups if repeats > 1 else None, extra=section)
    return 0
