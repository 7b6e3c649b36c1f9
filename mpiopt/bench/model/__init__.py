"""Scaling model: an alpha-beta cost model of every algorithm's step, calibrated, validated and projected.

``mpiopt bench model calibrate COLL.json [COLL.json ...] --out MODEL.json`` fits each collective's latency
``alpha`` and inverse bandwidth ``beta`` to ``bench collectives --json`` files of one link.
``mpiopt bench model validate MODEL.json ALG.json [...]`` predicts ``bench algorithms --json`` step times.
``mpiopt bench model project MODEL.json`` projects step time and speed-up over ``sgd`` to many ranks and
faster links (``--plot`` a PNG).  None of the three needs MPI.

Cost forms and media: docs/scaling.md, "Method"; the rest of the model: docs/internals-bench.md.
"""

from __future__ import annotations

from typing import List, Optional

from .._common import module_main

# The parts (this docstring is the command's help): costs (the forms above), calibration (the fit), predict (an
# algorithm's plan, step time, validation, projection), report (tables and plots), command (the arguments and actions).
from .calibration import calibrate, fit
from .command import MODELS, add_arguments, run
from .costs import BCAST_MIN_PROCS, COLLECTIVES, MEDIA, collective_seconds, latency_terms, wire_bytes
from .predict import RANKS, RATES, async_seconds, at_rate, comm_seconds, ideal_link, plan, project, projected, step_seconds, validate
from .report import calibration_table, plot_projection, plot_validation, projection_table, validation_table

__all__ = [
    "MEDIA", "COLLECTIVES", "BCAST_MIN_PROCS", "latency_terms", "wire_bytes", "collective_seconds", "fit",
    "calibrate", "RANKS", "RATES", "plan", "projected", "comm_seconds", "step_seconds", "async_seconds", "at_rate", "ideal_link",
    "validate", "project", "calibration_table", "validation_table", "projection_table", "plot_projection", "plot_validation",
    "MODELS", "add_arguments", "run", "main",
]


def main(argv: Optional[List[str]] = None) -> int:
    """``python -m mpiopt.bench.model``: parse ``argv`` and run the action (exit 2 on a usage error)."""
    return module_main("model", __doc__, add_arguments, run, argv)
