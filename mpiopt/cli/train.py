"""``mpiopt train``: one algorithm on one task, with metrics, evaluation and progress.

Launch under MPI (``mpiexec -n 4 python -m mpiopt train --algorithm lsgd``).
Every setting is a flag or a key of ``--config FILE.toml`` (flags win); the
effective configuration is printed first and saved as ``OUT/config.toml``,
which ``--config`` reads back.  OUT receives ``metrics.jsonl`` (a record per
step and per evaluation; ``mpiopt plot`` draws them) and, with ``--trace``,
a Chrome/Perfetto trace of every rank's phases.

Checkpoints: ``--checkpoint-every N`` writes one after every N-th step and at
the end to ``--checkpoint-dir`` (default ``OUT/checkpoints``); ``--resume
PATH|auto`` continues from one, bitwise as if the run had never stopped
(asynchronous algorithms: between quiescent segments of N steps per worker,
starting from exactly the saved parameters; bitwise at one rank only).
SIGTERM or SIGUSR1 at any rank of a run with checkpoints: every rank writes a
checkpoint at the next step (asynchronous: segment) boundary and the job exits
with code 75 (``EX_TEMPFAIL``: requeue it with ``--resume auto``).

Evaluated model: every --eval-every steps (asynchronous algorithms: once
the run is quiescent, the workers pausing for the drain and the evaluation)
and at the end, BatchNorm statistics averaged over the ranks first.  Which
model: each algorithm's ``evaluates`` (``--help`` lists them, from the classes):
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import Optional

from ..training.config import TrainConfig
from ..training.flags import add_config_arguments, evaluated_help
from .respawn import go_on_with_replacements
from .session import Session, read_settings, start_session


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_config_arguments(parser, "train")
    # The list that ends the description's last paragraph: made from the classes, it names every algorithm, a plugin's too.
    parser.description = f"{parser.description or ''}{evaluated_help()}\n"


def run(args: argparse.Namespace) -> int:
    config, algorithms = read_settings(args, "train")
    return OneRun(config).go_on(start_session(config, "train", algorithms))


@dataclass
class OneRun:
    """``train``'s plan (:class:`~mpiopt.cli.respawn.Plan`): its one run, which a respawn resumes."""

    config: TrainConfig

    @property
    def resume(self) -> Optional[str]:
        return self.config.resume

    @resume.setter
    def resume(self, path: Optional[str]) -> None:
        self.config.resume = path

    def go_on(self, session: Session) -> int:
        """The run to its end (resumed where ``config.resume`` says), then the report; the exit code."""
        return train_to_the_end(self.config, session)


def train_to_the_end(config: TrainConfig, session: Session) -> int:
    """Train the session's run to its last step, then the report; with ``--on-failure respawn`` through every loss
    (the survivors and the processes started in the lost ranks' places resume together).  The exit code."""
    from ..training.loop import train
    from ..training.survival import Respawn, surviving_the_start

    def run() -> None:
        while True:
            try:
                path = surviving_the_start(lambda: train(config, config.algorithm, session.topology, session.dataset, session.out,
                                                         on_start=session.save_settings, counted_since=session.counted_since),
                                           session.topology, config.whole_islands, config.on_failure == "respawn")
                break
            except Respawn as respawn:
                go_on_with_replacements(session, respawn, OneRun(config))
        session.finish([path], config)

    return session.to_the_end(run, lambda stop: f"continue with --resume {stop.path} (or --resume auto)")
