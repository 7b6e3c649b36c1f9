"""``python -m mpiopt``: the command-line interface (see ``mpiopt.cli``)."""

import sys

from .cli.main import main

sys.exit(main())
