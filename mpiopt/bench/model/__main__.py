"""``python -m mpiopt.bench.model``: the same command as ``mpiopt bench model``."""

import sys

from . import main

sys.exit(main())
