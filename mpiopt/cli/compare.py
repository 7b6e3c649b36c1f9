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
from dataclasses import dataclass, field
from functools import partial
import os
from typing import Any, Dict, List, Optional

from ..training.config import TrainConfig, UsageError
from ..training.flags import add_config_arguments
from . import sweep
from .respawn import go_on_with_replacements
from .session import Session, read_settings, start_session


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
        "test loss at the last evaluation (a synchronous one is evaluated only there); several --sweep flags form a grid. Runs in OUT/sweep/, scores in OUT/sweep.json and results.md",
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
    own_update = [name for name in algorithms if config.for_algorithm(name) is not config]
    if own_update:
        session.say(f"--optimizer {config.optimizer} steps every algorithm but {', '.join(own_update)}: "
                    "they keep their own update (see each one's help)")
    return Comparison(config, algorithms, repeats, axes, sweep_steps).go_on(session)


@dataclass
class Comparison:
    """``compare``'s runs in order, the tuning runs of ``--sweep`` first, and what they found so far: its plan
    (:class:`~mpiopt.cli.respawn.Plan`).  With ``--on-failure respawn`` the survivors hand it, as it stands, to the
    processes started for the lost ranks, and every rank goes on from the run the loss broke, resumed."""

    config: TrainConfig
    algorithms: List[str]
    repeats: int
    axes: List[sweep.Axis]
    sweep_steps: Optional[int]
    #: Runs finished, the tuning runs first.
    done: int = 0
    #: The survivors' checkpoint that the run after ``done`` resumes from (a respawn's), else None.
    resume: Optional[str] = None
    #: Each algorithm's tuning runs: its grid points' values and metrics files.
    tried: Dict[str, List[Dict[str, Any]]] = field(default_factory=dict)
    #: Each algorithm's grid point, once the tuning runs ended (rank 0's choice).
    chosen: Optional[Dict[str, Dict[str, Any]]] = None
    #: results.md's section on the sweep (on every rank: a survivor may take rank 0's place and write it).
    section: str = ""
    #: Per algorithm, its main runs' metrics files, one per repeat.
    groups: List[List[str]] = field(default_factory=list)

    def go_on(self, session: Session) -> int:
        """The runs not done yet, then the report; the exit code."""
        # A run resumed by a respawn has checkpoints, and so stops on a signal as train's do.
        return session.to_the_end(lambda: self._runs(session), lambda stop: "compare starts its runs afresh: run it again")

    def _runs(self, session: Session) -> None:
        # An algorithm no --sweep key applies to keeps its settings, untried.
        tuning = [(name, k, point) for name in self.algorithms for k, point in enumerate(sweep.grid(self.axes, name), 1) if point]
        for name, k, point in tuning[self.done:]:
            session.say(f"== sweep {name}: " + ", ".join(f"{key}={value}" for key, value in point.items()))
            short = sweep.tuning_config(self.config, name, point, self.sweep_steps)
            path = self._train(session, short, name, os.path.join(session.out, "sweep", name, str(k)))
            self.tried.setdefault(name, []).append({"values": point, "metrics": path})
        if self.axes and self.chosen is None:
            self._choose(session)
        configs = {name: sweep.with_point(self.config, name, self.chosen[name]) if self.chosen else self.config for name in self.algorithms}
        if not self.groups:
            self.groups = [[] for _ in self.algorithms]
        # Round by round (every algorithm once per repeat), so that a change in the machine's load hits them all alike.
        main = [(k, number, name) for k in range(1, self.repeats + 1) for number, name in enumerate(self.algorithms, 1)]
        for k, number, name in main[self.done - len(tuning):]:
            seed = self.config.seed + k - 1
            session.say(f"== {f'repeat {k}/{self.repeats} (seed {seed}), ' if self.repeats > 1 else ''}{number}/{len(self.algorithms)}: {name}")
            folder = os.path.join(session.out, name, f"run{k}") if self.repeats > 1 else os.path.join(session.out, name)
            self.groups[number - 1].append(self._train(session, dataclasses.replace(configs[name], seed=seed), name, folder))
        session.finish([p for g in self.groups for p in g], self.config, groups=self.groups if self.repeats > 1 else None, extra=self.section)

    def _choose(self, session: Session) -> None:
        """Each algorithm's best grid point, scored by rank 0 (the survivor in its place if it was lost) and shared."""
        if session.rank == 0:
            for candidates in self.tried.values():
                for candidate in candidates:
                    candidate["score"] = sweep.score(candidate["metrics"])
            chosen = {name: sweep.choose(self.tried[name])["values"] if name in self.tried else {} for name in self.algorithms}
            section = sweep.report(session.out, chosen, self.tried, self.sweep_steps)
        # The section too: a rank that takes rank 0's place later (a lost rank 0) writes results.md.
        self.chosen, self.section = session.topology.world.bcast_obj((chosen, section) if session.rank == 0 else None)

    def _train(self, session: Session, config: TrainConfig, name: str, folder: str) -> str:
        """One run into ``folder`` (collective), started again on the survivors of a rank lost as it starts, and with
        ``--on-failure respawn`` resumed with the replacements of every rank lost in it; its metrics file."""
        from ..training.loop import train
        from ..training.survival import Respawn, surviving_the_start

        while True:
            run = dataclasses.replace(config, resume=self.resume, on_failure=self.config.on_failure)
            try:
                path = surviving_the_start(partial(train, run, name, session.topology, session.dataset, folder,
                                                   counted_since=session.counted_since),
                                           session.topology, run.whole_islands, run.on_failure == "respawn")
            except Respawn as respawn:
                go_on_with_replacements(session, respawn, self)
                continue
            self.done, self.resume, session.counted_since = self.done + 1, None, None
            return path
