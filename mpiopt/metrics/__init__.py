"""Metrics of training runs: JSON-lines records, Perfetto traces, per-run summaries, comparison plots.

This package reads what the algorithms and the communication layer record; nothing below it imports it.
Record fields and trace lanes: docs/internals-metrics.md.
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
