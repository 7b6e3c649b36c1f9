"""Reproductions of each paper's claim, one module per experiment (``mpiopt experiment NAME``).

:data:`EXPERIMENTS` names each one's module, the world size it must run at
(``mpiexec -n RANKS``; or, for one that ``launches`` its own jobs, plain ``python``) and a one-line summary, without importing the module
(``mpiopt experiment --list`` and ``--help`` stay fast).  Every module has
``RANKS`` (its entry's) and ``run(out, quick) -> dict``: a collective call on every rank of the world;
  writes its figures (``results-<name>-*.png``), ``results.json`` and
  ``results.md`` into ``out`` on rank 0, and returns the numbers there
  (``{}`` on the other ranks).  ``quick`` shrinks every size so that the
  test suite can run it end to end in seconds; its numbers mean nothing.

docs/RESULTS.md states each claim, the command and what the full-size run
showed on a 2-core machine.
"""

from __future__ import annotations

import importlib
from types import ModuleType
from typing import Dict, NamedTuple

__all__ = ["Experiment", "EXPERIMENTS", "experiment_module"]


class Experiment(NamedTuple):
    """One experiment: its module of this package, the ranks it runs at, what it shows."""

    module: str
    ranks: int
    summary: str
    #: Started with plain python (as root): it starts its own ``ranks``-rank jobs on the emulated cluster.
    launches: bool = False


EXPERIMENTS: Dict[str, Experiment] = {
    "lsgd": Experiment("lsgd", 4, "LSGD vs EASGD vs data-parallel SGD on digits (accuracy vs wall time and bytes), and the curse of symmetry"),
    "dasgd": Experiment("dasgd", 2, "DaSGD vs synchronous SGD on digits: loss curves, and the fraction of the averaging hidden behind compute (trace)"),
    "signum": Experiment("signum", 4, "Signum majority vote vs SGD on digits, and logistic regression with 0-3 of 4 workers adversarial"),
    "topk": Experiment("topk", 2, "Top-k vs RegTop-k on the paper's distributed linear regression and on digits at density 0.01"),
    "async": Experiment("asynchronous", 4, "Async-MSGD delay x momentum grid on streaming PCA; sgd / async_msgd / async_lsgd on digits with one slowed rank"),
    "diloco": Experiment("diloco", 4, "DiLoCo's H sweep at 2 and 4 ranks (loss against bytes) vs sgd, dasgd, lsgd, easgd; Streaming DiLoCo's peak bytes"),
    "codecs": Experiment("codecs", 4, "diloco with each codec and sparseloco on the GPT text task: test loss against bytes sent, vs data-parallel"),
    "crossover": Experiment("crossover", 4, "DDP and 9 algorithms on the emulated 2-node cluster at 10 Gbit/s, 1 Gbit/s and 100 Mbit/s: "
                            "speed-up to a target loss per link rate, beside the alpha-beta model", launches=True),
}


def experiment_module(name: str) -> ModuleType:
    """The module of experiment ``name`` (a key of :data:`EXPERIMENTS`)."""
    if name not in EXPERIMENTS:
        raise ValueError(f"unknown experiment {name!r}; choose from {', '.join(EXPERIMENTS)}")
    return importlib.import_module(f"{__package__}.{EXPERIMENTS[name].module}")
