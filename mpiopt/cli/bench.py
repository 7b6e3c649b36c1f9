"""``mpiopt bench``: the benchmarks, one subcommand each; a table on the terminal, ``--json FILE`` for plots.

Run a benchmark that needs ranks under mpiexec::

    mpiexec -n 4 python -m mpiopt bench collectives --json coll.json

or let ``--ranks N`` start the job (``mpiexec -n N`` from this Python's
environment); with ``--link RATE`` as well, the job runs inside the emulated
link of ``tools/emulated_link.sh`` (a private network namespace whose shaped
loopback carries every byte between ranks; needs root and a repository
checkout, which has ``tools/``)::

    mpiopt bench --link 1gbit --ranks 4 ddp --model mlp
    # is the same as
    RATE=1gbit tools/emulated_link.sh mpiexec -n 4 python -m mpiopt bench ddp --model mlp

Under mpiexec, ``--link RATE`` only records the link's rate (for example a
real cluster's 100gbit) to compare the measured bandwidth with; inside the
emulated link the rate defaults to its ``RATE``, and a different one is an
error.  Every benchmark also runs as ``python -m mpiopt.bench.<name>``
(``torch-overhead``: ``mpiopt.bench.torch_overhead``).
"""

from __future__ import annotations

import argparse
import importlib
import subprocess
import sys
from types import ModuleType
from typing import List

from ..bench._common import HelpFormatter, child_environment, mpiexec_path, parse_rate, positive_int, repository_tool
from ..training.config import UsageError

#: The subcommands; each is the module of mpiopt.bench of that name ("-" for "_"), whose docstring's first line is its help.
BENCHMARKS = (
    "collectives", "algorithms", "ddp", "compressed", "averaging", "kernels", "torch-overhead", "update", "regtopk",
    "tradeoff", "model", "staging", "codecs",
)


def _module(name: str) -> ModuleType:
    """The benchmark's module (its ``add_arguments`` and ``run``)."""
    return importlib.import_module(f"mpiopt.bench.{name.replace('-', '_')}")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.formatter_class = HelpFormatter
    parser.add_argument(
        "--ranks", type=positive_int, default=None, metavar="N",
        help="start the job yourself: mpiexec -n N (inside the emulated link with --link); give it outside mpiexec only",
    )
    parser.add_argument(
        "--link", default=None, metavar="RATE",
        help="link rate in tc's units (1gbit, 100mbit): with --ranks, emulate it (tools/emulated_link.sh, root); "
        "under mpiexec, the rate measured bandwidth is compared with (default: the emulated link's, if any)",
    )
    sub = parser.add_subparsers(dest="benchmark", metavar="BENCHMARK", parser_class=type(parser))
    sub.required = True
    for name in BENCHMARKS:
        module = _module(name)
        summary = (module.__doc__ or name).strip().splitlines()[0].rstrip(".")
        p = sub.add_parser(name, help=summary, description=module.__doc__, formatter_class=HelpFormatter)
        module.add_arguments(p)


def _without_ranks(argv: List[str]) -> List[str]:
    """``argv`` less ``--ranks N`` / ``--ranks=N``."""
    out, skip = [], False
    for arg in argv:
        if skip:
            skip = False
        elif arg == "--ranks":
            skip = True
        elif not arg.startswith("--ranks="):
            out.append(arg)
    return out


def _this_program() -> List[str]:
    """How this process was started: ``python -m mpiopt`` or ``python SCRIPT`` (the ``mpiopt`` script)."""
    spec = getattr(sys.modules["__main__"], "__spec__", None)
    if spec is not None and spec.name.endswith(".__main__"):
        return [sys.executable, "-m", spec.name[: -len(".__main__")]]
    return [sys.executable, sys.argv[0]]


def launch(args: argparse.Namespace) -> int:
    """Run this very command again as ``[tools/emulated_link.sh] mpiexec -n N python -m mpiopt ...`` and return its exit code."""
    from ..comm.process import world_size

    if world_size() > 1:
        raise UsageError("--ranks starts the MPI job itself: leave it out under mpiexec")
    argv = sys.argv[1:]
    if "bench" not in argv:
        raise UsageError("--ranks works from the command line (python -m mpiopt bench --ranks N ...) only")
    command = [mpiexec_path("--ranks"), "-n", str(args.ranks), *_this_program(), *_without_ranks(argv)]
    env = child_environment()  # this process is an MPI singleton: its launcher settings must not leak into the new job
    if args.link:
        command = [repository_tool("emulated_link.sh", "--link"), *command]
        env["RATE"] = args.link
    sys.stdout.flush()
    return subprocess.run(command, env=env).returncode


def run(args: argparse.Namespace) -> int:
    if args.link is not None:
        try:
            parse_rate(args.link)
        except ValueError as err:
            raise UsageError(f"--link: {err}") from None
    if args.ranks is not None:
        return launch(args)
    return _module(args.benchmark).run(args)
