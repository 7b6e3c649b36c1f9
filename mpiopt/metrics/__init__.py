"""Metrics of training runs: records, traces, summaries, plots.

- :mod:`~mpiopt.metrics.records`: JSON-lines metrics written on rank 0
  (:class:`MetricsWriter`, :func:`read_metrics`; the fields of each record
  kind are tabled in that module).
- :mod:`~mpiopt.metrics.trace`: a Chrome/Perfetto timeline of every rank's
  compute phases and MPI calls (:class:`Tracer`), and how much nonblocking
  communication ran behind computation (:func:`overlap_fraction`).
- :mod:`~mpiopt.metrics.summary`: one row per run (accuracy, time and bytes to
  a target, where the time went) and a Markdown table of them.
- :mod:`~mpiopt.metrics.plots`: accuracy and loss against steps, wall time and
  bytes (needs matplotlib, imported only there).

This package reads what the algorithms and the communication layer record;
nothing below it imports it.
"""

from .plots import plot_runs
from .records import EVAL_FIELDS, STEP_FIELDS, MetricsWriter, Run, read_metrics, versions
from .summary import add_speedups, format_bytes, format_seconds, format_spread, markdown_table, repeats_table, summarize
from .trace import Tracer, overlap_fraction

__all__ = [
    "MetricsWriter",
    "Run",
    "read_metrics",
    "versions",
    "STEP_FIELDS",
    "EVAL_FIELDS",
    "Tracer",
    "overlap_fraction",
    "summarize",
    "add_speedups",
    "markdown_table",
    "repeats_table",
    "format_spread",
    "format_bytes",
    "format_seconds",
    "plot_runs",
]
