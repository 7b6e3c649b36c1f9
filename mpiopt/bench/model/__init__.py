"""Scaling model: an alpha-beta cost model of every algorithm's step, calibrated, validated and projected.

``mpiopt bench model calibrate COLL.json [COLL.json ...] --out MODEL.json``
fits each collective's latency ``alpha`` (seconds per message hop) and
inverse bandwidth ``beta`` (seconds per byte) to ``mpiopt bench
collectives --json`` files (one or more world sizes, one link).
``mpiopt bench model validate MODEL.json ALG.json [ALG.json ...]`` predicts
the step times ``mpiopt bench algorithms --json`` measured and gives the
error of every point.  ``mpiopt bench model project MODEL.json`` projects
the step time and the speed-up over ``sgd`` of every algorithm to many
ranks and faster links (a Markdown table, ``--plot`` a PNG).  None of the
three needs MPI.

Cost forms (``P`` ranks, ``n`` bytes per rank, the algorithms MPICH runs
for large messages; ``L`` latency terms, ``W`` bytes on the critical path)

============  ==================  ====================  ========================
collective    L (alpha terms)     W switched            W shared
============  ==================  ====================  ========================
allreduce     2 ceil(log2 P)      2 (P-1)/P n           2 (P-1) n
allgather     P - 1               (P-1) n               P (P-1) n
bcast, P < 8  ceil(log2 P)        ceil(log2 P) n        (P-1) n
bcast, P >= 8 ceil(log2 P) + P-1  2 (P-1)/P n           (ceil(log2 P)/2 + P-1) n
twophase      2 (P-1)             2 (P-1) w             2 P (P-1) w
============  ==================  ====================  ========================

``t = L alpha + W beta``.  Allreduce is reduce-scatter + allgather by
recursive halving/doubling (Rabenseifner), allgather a ring, bcast a
binomial tree below 8 ranks (MPICH's ``BCAST_MIN_PROCS``) and a binomial
scatter + ring allgather (van de Geijn) from 8, twophase ``signum``'s ``Alltoall``
of ``w``-byte chunks then ``Allgather`` of one (``w ~ d/8/P``).  Two media:
*switched* (every rank has its own full-duplex link; a cluster) counts the
bytes one rank sends, *shared* (one device carries every byte between any
two ranks: ``tools/emulated_link.sh``) counts the bytes all ranks send,
so calibration on the emulated link fits ``beta`` per byte of the one
link.  ``iallreduce`` and ``allgatherv`` are fitted separately from
``allreduce`` and ``allgather``, as their MPI implementations differ.

An algorithm's step (:func:`plan`) is its class's communication plan
(``Algorithm.communication``), each call with how often it happens per step
averaged over the plan's cycle; a call in flight across ``overlap_steps``
steps of computation (DaSGD's averaging) exposes only ``max(0, t_comm -
overlap_steps t_compute)``; calls of one phase (LSGD's groups) run in
parallel on a switched medium, one after the other on a shared one.  An
asynchronous algorithm with a server model (``server_messages``, projection
only; ``async_msgd``): the server receives and sends its messages per
update one after the other (``async_msgd``: a ``4d``-byte gradient in,
``4d`` bytes of parameters out), so updates per second are at most ``1 /
sum(alpha + bytes beta)`` however many workers; its "step" is the time of
``P`` gradients (one synchronous step's worth).

Step time = local computation + communication (no overlap; DaSGD's hidden
averaging as above).  The calibrated ``beta`` is projected to another link
rate as ``beta * rate_calibrated / rate`` (the same efficiency), ``alpha``
kept (or ``--alpha``).
"""

from __future__ import annotations

from typing import List, Optional

from .._common import module_main

# The parts (this docstring is the command's help): costs (the forms above), calibration (the fit), predict (an
# algorithm's plan, step time, validation, projection), report (tables and plots), command (the arguments and actions).
from .calibration import calibrate, fit
from .command import MODELS, add_arguments, run
from .costs import BCAST_MIN_PROCS, COLLECTIVES, MEDIA, collective_seconds, latency_terms, wire_bytes
from .predict import RANKS, RATES, async_seconds, at_rate, comm_seconds, plan, project, projected, step_seconds, validate
from .report import calibration_table, plot_projection, plot_validation, projection_table, validation_table

__all__ = [
    "MEDIA", "COLLECTIVES", "BCAST_MIN_PROCS", "latency_terms", "wire_bytes", "collective_seconds", "fit",
    "calibrate", "RANKS", "RATES", "plan", "projected", "comm_seconds", "step_seconds", "async_seconds", "at_rate", "validate",
    "project", "calibration_table", "validation_table", "projection_table", "plot_projection", "plot_validation",
    "MODELS", "add_arguments", "run", "main",
]


def main(argv: Optional[List[str]] = None) -> int:
    """``python -m mpiopt.bench.model``: parse ``argv`` and run the action (exit 2 on a usage error)."""
    return module_main("model", __doc__, add_arguments, run, argv)
