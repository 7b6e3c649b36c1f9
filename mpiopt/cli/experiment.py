"""``mpiopt experiment NAME``: reproduce one paper's claim here, with its figures and numbers.

Each experiment runs at a fixed number of ranks (see ``--list``); launch it
with that many, e.g.::

    mpiexec -n 4 python -m mpiopt experiment lsgd --out runs/lsgd

It writes its figures (``results-NAME-*.png``), ``results.json`` (settings
and numbers) and ``results.md`` into ``--out``.  ``--quick`` shrinks every
size to a few seconds' run (for the test suite: its numbers mean nothing).
docs/RESULTS.md states each claim and what the full-size run showed.
"""

from __future__ import annotations

import argparse
import os
import time
from typing import TYPE_CHECKING

from ..training.config import UsageError

if TYPE_CHECKING:
    from ..experiments import Experiment


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from ..experiments import EXPERIMENTS

    names = ", ".join(f"{name} ({'python, as root' if e.launches else f'{e.ranks} ranks'})" for name, e in EXPERIMENTS.items())
    parser.add_argument("name", nargs="?", metavar="NAME", help=f"the experiment, launched with this many ranks: {names}")
    parser.add_argument("--list", action="store_true", help="list the experiments, each with the ranks it needs, and exit")
    parser.add_argument("--out", metavar="DIR", default=None, help="folder for its figures and results (default: runs/experiment-NAME-<date>-<time>)")
    parser.add_argument("--quick", action="store_true", help="tiny sizes (seconds; for tests): the numbers mean nothing")


def listing() -> str:
    """One line per experiment: name, the launch command and what it shows."""
    from ..experiments import EXPERIMENTS

    return "\n".join(f"{name:<9} {_launch(name, e)}\n          {e.summary}" for name, e in EXPERIMENTS.items())


def _launch(name: str, experiment: "Experiment") -> str:
    """The command that starts ``experiment``."""
    if experiment.launches:
        return f"python -m mpiopt experiment {name}   (as root: it starts {experiment.ranks}-rank jobs on the emulated cluster)"
    return f"mpiexec -n {experiment.ranks} python -m mpiopt experiment {name}"


def run(args: argparse.Namespace) -> int:
    from ..comm import Comm
    from ..comm.process import world_rank, world_size
    from ..experiments import EXPERIMENTS, experiment_module

    rank, size = world_rank(), world_size()
    if args.list:
        if rank == 0:
            print(listing())
        return 0
    if args.name is None:
        raise UsageError(f"name an experiment ({', '.join(EXPERIMENTS)}) or give --list")
    if args.name not in EXPERIMENTS:
        raise UsageError(f"unknown experiment {args.name!r}; choose from {', '.join(EXPERIMENTS)}")
    ranks = 1 if EXPERIMENTS[args.name].launches else EXPERIMENTS[args.name].ranks
    if size != ranks and ranks == 1:
        raise UsageError(f"experiment {args.name} starts its own MPI jobs: run it with plain python -m mpiopt experiment {args.name}, not under mpiexec")
    if size != ranks:
        raise UsageError(f"experiment {args.name} needs {ranks} ranks, got {size}: mpiexec -n {ranks} python -m mpiopt experiment {args.name}")
    world = Comm(name="experiment")
    out = args.out or world.bcast_obj(time.strftime(f"runs/experiment-{args.name}-%Y%m%d-%H%M%S") if rank == 0 else None)
    if rank == 0:
        os.makedirs(out, exist_ok=True)
    world.Barrier()
    world.Free()
    started = time.perf_counter()
    experiment_module(args.name).run(out, args.quick)
    if rank == 0:
        print(f"experiment {args.name} done in {time.perf_counter() - started:.1f} s", flush=True)
    return 0
