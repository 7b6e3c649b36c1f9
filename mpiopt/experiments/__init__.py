"""Reproductions of each paper's claim, one module per experiment (``mpiopt experiment NAME``).

Every module has the same face:

- ``RANKS``: the world size it must run at (``mpiexec -n RANKS``);
- ``SUMMARY``: one line for ``mpiopt experiment --list``;
- ``run(out, quick) -> dict``: a collective call on every rank of the world;
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
from typing import Dict

__all__ = ["EXPERIMENTS", "experiment_module"]

#: experiment name -> module of this package.
EXPERIMENTS: Dict[str, str] = {
    "lsgd": "lsgd",
    "dasgd": "dasgd",
    "signum": "signum",
    "topk": "topk",
    "async": "asynchronous",
}


def experiment_module(name: str) -> ModuleType:
    """The module of experiment ``name`` (a key of :data:`EXPERIMENTS`)."""
    if name not in EXPERIMENTS:
        raise ValueError(f"unknown experiment {name!r}; choose from {', '.join(EXPERIMENTS)}")
    return importlib.import_module(f"{__package__}.{EXPERIMENTS[name]}")
