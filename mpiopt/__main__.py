"""``python -m mpiopt``: the command-line interface (see ``mpiopt.cli``)."""

import sys

from .cli.main import main

status = main()
sys.exit(status)  # looked up after main(): a lost rank wraps sys.exit to learn the status (comm.finalizing)
