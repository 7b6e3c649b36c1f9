"""Entry point of ``python -m mpiopt`` and the ``mpiopt`` script.

Every command runs under :func:`mpiopt.comm.abort_on_exception`: an error on
any rank prints its traceback and ends the whole MPI job with a non-zero exit
code instead of leaving the other ranks waiting.
"""

from __future__ import annotations

import argparse
import sys
from typing import List, Optional

from ..comm import abort_on_exception
from . import info

COMMANDS = {
    "info": (info, "show the topology, GPU-awareness and bytes per collective"),
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m mpiopt",
        description="Communication-efficient distributed training on MPI. Launch with mpiexec/srun.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    for name, (module, help_text) in COMMANDS.items():
        p = sub.add_parser(name, help=help_text, description=module.__doc__)
        module.add_arguments(p)
    return parser


def main(argv: Optional[List[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    abort_on_exception()
    return COMMANDS[args.command][0].run(args)


if __name__ == "__main__":
    sys.exit(main())
