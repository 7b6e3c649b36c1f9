"""``mpiopt inspect PATH``: what a checkpoint holds.

Prints whether the file is a whole mpiopt checkpoint (and what is wrong if
not), its root attributes, and its layout with every array's shape, dtype and
L2 norm; ``--json`` prints the same as JSON.  Works as a plain process; under
mpiexec only rank 0 prints.  Exit code 0 for a valid checkpoint, 1 otherwise.
"""

from __future__ import annotations

import argparse
import json
import sys

from ..comm.process import world_rank



def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("path", help="checkpoint file (.h5)")
    parser.add_argument("--json", action="store_true", help="print the description as JSON")


def run(args: argparse.Namespace) -> int:
    from ..checkpoint import CheckpointError, describe, format_description  # h5py: only when inspecting

    if world_rank() != 0:
        return 0
    try:
        desc = describe(args.path)
    except CheckpointError as err:
        print(f"mpiopt inspect: {err}", file=sys.stderr)
        return 1
    print(json.dumps(desc, indent=2) if args.json else format_description(desc))
    return 0 if desc["problem"] is None else 1
