"""Entry point of ``python -m mpiopt`` and the ``mpiopt`` script.

Every command runs under :func:`mpiopt.comm.abort_on_exception`: an error on
any rank prints its traceback and ends the whole MPI job with a non-zero exit
code instead of leaving the other ranks waiting.  Bad input (an unknown
algorithm, a bad value, a missing dataset) is not an error of that kind: it
is found on every rank alike (or agreed on collectively), printed once by
rank 0 as ``mpiopt <command>: error: ...``, and every rank exits with code 2.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from typing import IO, List, NoReturn, Optional

from ..comm import abort_on_exception
from ..comm.launcher import launcher_rank
from ..training.config import UsageError

# name -> (module of mpiopt.cli, one-line help).  Building the parser imports every command module, so
# they import torch and h5py inside run(), not at the top: `mpiopt info` or `plot` starts in a fraction of a second.
COMMANDS = {
    "train": ("train", "train one algorithm on one task (metrics, evaluation, checkpoints)"),
    "compare": ("compare", "train several algorithms on the same task and tabulate and plot the results"),
    "plot": ("plot", "redraw the figures and the results table from metrics files"),
    "experiment": ("experiment", "reproduce one paper's claim (figures and numbers); mpiopt experiment --list"),
    "bench": ("bench", "run a benchmark: collectives, algorithms, ddp, compressed, averaging, kernels, ..."),
    "inspect": ("inspect", "show a checkpoint's layout, attributes and each array's shape, dtype and norm"),
    "info": ("info", "show the topology, GPU-awareness and bytes per collective"),
}
USAGE_EXIT = 2


def _rank() -> int:
    """The rank that prints help and usage errors: the launcher's where it set one, else MPI's.

    Were the launcher and MPI not to agree, every process would be rank 0 of
    its own world of one, and print.  A malformed launcher variable is no
    reason to fail printing help: MPI's rank is used then.
    """
    try:
        rank = launcher_rank()
    except ValueError:
        rank = None
    if rank is not None:
        return rank
    from ..comm.process import world_rank

    return world_rank()


class Parser(argparse.ArgumentParser):
    """argparse that prints its help and reports a usage error once (rank 0), not once per rank."""

    def print_help(self, file: Optional[IO[str]] = None) -> None:
        if _rank() == 0:
            super().print_help(file)

    def error(self, message: str) -> NoReturn:
        if _rank() == 0:
            self.print_usage(sys.stderr)
            sys.stderr.write(f"{self.prog}: error: {message}\n")
        sys.exit(USAGE_EXIT)


def _module(name: str):
    return importlib.import_module(f"{__package__}.{COMMANDS[name][0]}")


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(
        prog="python -m mpiopt",
        description="Communication-efficient distributed training on MPI. Launch with mpiexec/srun.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=Parser)
    sub.required = True
    for name, (_, help_text) in COMMANDS.items():
        module = _module(name)
        p = sub.add_parser(name, help=help_text, description=module.__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
        module.add_arguments(p)
    return parser


def main(argv: Optional[List[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    abort_on_exception()
    try:
        return _module(args.command).run(args)
    except UsageError as err:
        if _rank() == 0:
            sys.stderr.write(f"mpiopt {args.command}: error: {err}\n")
        return USAGE_EXIT


if __name__ == "__main__":
    status = main()
    sys.exit(status)  # looked up after main(), as in mpiopt/__main__.py
