"""A training run at one point of a tuning grid: the point's values where they belong, and a tuning run's settings.

``mpiopt compare --sweep`` and ``mpiopt experiment crossover`` both tune through these.
"""

from __future__ import annotations

import copy
import dataclasses
from typing import Any, Dict, Optional, Sequence

from .config import TrainConfig

__all__ = ["with_point", "evaluations_shape", "tuning_config", "lowest"]


def with_point(config: TrainConfig, algorithm: str, point: Dict[str, Any]) -> TrainConfig:
    """``config`` as ``algorithm`` trains at ``point``: its keys in the algorithm's own hyperparameter table.

    Where ``--optimizer`` steps the algorithm, ``lr`` is the optimizer's rate (the ``lr`` setting) instead.
    """
    mine = config.for_algorithm(algorithm)
    point = dict(point)
    rate = {"lr": point.pop("lr")} if mine.optimizer and "lr" in point else {}
    hyper = copy.deepcopy(mine.hyperparameters)
    if point:
        hyper.setdefault(algorithm, {}).update(point)
    return dataclasses.replace(mine, hyperparameters=hyper, **rate)


def evaluations_shape(algorithm: str) -> bool:
    """Whether evaluating a run of ``algorithm`` changes its course: an asynchronous run's evaluations are its
    quiescent points; a synchronous run (DDP's too) steps bit for bit the same however often it is evaluated."""
    from ..algorithms import ASYNCHRONOUS, algorithm_class
    from .config import DDP

    return algorithm != DDP and algorithm_class(algorithm).protocol == ASYNCHRONOUS


def tuning_config(config: TrainConfig, algorithm: str, point: Dict[str, Any], steps: int) -> TrainConfig:
    """The short run of ``algorithm`` at ``point``: ``steps`` steps, and a non-finite gradient skipped, not fatal.

    A candidate that diverges (a rate too high) then scores its last test loss,
    or none, and loses; the sweep goes on.  A ``nan_policy`` the user set stays.
    The asynchronous algorithms cannot skip (it is decided collectively): a
    diverging candidate of theirs still ends the job, naming the step.

    Only that last test loss counts, and evaluating changes no bit of a
    synchronous run, so a synchronous candidate is evaluated once, at its end
    (its progress lines keep their cadence).  An asynchronous run's evaluations
    are its quiescent points, which shape it: they keep ``eval_every``.
    """
    from .config import DDP

    asynchronous = evaluations_shape(algorithm)
    once = {} if asynchronous else {"eval_every": steps, "log_every": config.log_every or config.evaluation_interval(steps)}
    short = dataclasses.replace(with_point(config, algorithm, point), steps=steps, epochs=None, **once)
    if algorithm == DDP or asynchronous or "nan_policy" in short.algorithm_hyperparameters(algorithm):
        return short
    return with_point(short, algorithm, {"nan_policy": "skip"})


def lowest(scores: Sequence[Optional[float]]) -> int:
    """The index of the lowest score (a candidate's last test loss): None and NaN last, the first of equals."""
    return min(range(len(scores)), key=lambda i: (1, 0.0) if scores[i] is None or scores[i] != scores[i] else (0, scores[i]))
