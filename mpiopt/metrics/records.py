"""Training metrics as JSON lines, one record per line, written by rank 0 and read back across resumes.

Required fields per kind, and why a killed or resumed run's file still reads: docs/internals-metrics.md.
"""

from __future__ import annotations

import json
import os
import platform
import warnings
from dataclasses import dataclass, field
from typing import Any, Dict, List, Mapping, Optional, Tuple

import numpy as np

__all__ = [
    "KINDS",
    "RUN_FIELDS",
    "STEP_FIELDS",
    "EVAL_FIELDS",
    "END_FIELDS",
    "EVALUATED",
    "MetricsWriter",
    "Run",
    "read_metrics",
    "versions",
]

RUN_FIELDS: Tuple[str, ...] = ("algorithm", "task", "config", "world_size", "versions")
STEP_FIELDS: Tuple[str, ...] = (
    "step", "epoch", "loss", "lr", "bytes_sent", "bytes_recv", "compute_seconds", "algo_seconds",
    "comm_seconds", "wait_seconds", "step_seconds", "wall_seconds", "algorithm",
)
EVAL_FIELDS: Tuple[str, ...] = (
    "step", "epoch", "wall_seconds", "bytes_sent_total", "test_loss", "test_accuracy", "train_loss", "evaluated",
)
END_FIELDS: Tuple[str, ...] = ("step", "wall_seconds", "bytes_sent_total")
#: A lost rank's survivors going on (``--on-failure shrink``): the step redone, the lost ranks, the new world size.
LOST_FIELDS: Tuple[str, ...] = ("step", "lost", "world_size", "wall_seconds")
#: Required fields of each record kind.
KINDS: Dict[str, Tuple[str, ...]] = {"run": RUN_FIELDS, "step": STEP_FIELDS, "eval": EVAL_FIELDS, "end": END_FIELDS, "lost": LOST_FIELDS}
#: Values of an eval record's ``evaluated`` field.
EVALUATED: Tuple[str, ...] = ("average", "leader", "rank0")
# Kinds after which the file is synced to disk, not only flushed.
_SYNC_KINDS = frozenset({"eval", "end", "lost"})


def versions() -> Dict[str, str]:
    """Versions of what a run depends on, for the ``"run"`` header."""
    from .._version import __version__
    from ..comm.process import library_version

    found = {
        "mpiopt": __version__,
        "python": platform.python_version(),
        "numpy": np.__version__,
        "mpi4py": __import__("mpi4py").__version__,
        "mpi": library_version(),
    }
    try:
        import torch

        found["torch"] = torch.__version__
    except ImportError:
        pass
    return found


def _plain(value: Any) -> Any:
    """JSON fallback for numpy scalars and arrays."""
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, np.ndarray):
        return value.tolist()
    raise TypeError(f"metrics values must be JSON-serialisable, got {type(value).__name__}: {value!r}")


def _cut_partial_line(path: str) -> None:
    """Drop a last line without its newline (a job killed mid-write) before appending."""
    with open(path, "rb+") as f:
        end = f.seek(0, os.SEEK_END)
        if end == 0:
            return
        f.seek(end - 1)
        if f.read(1) == b"\n":
            return
        position = end
        while position > 0:
            chunk_start = max(0, position - 65536)
            f.seek(chunk_start)
            chunk = f.read(position - chunk_start)
            newline = chunk.rfind(b"\n")
            if newline >= 0:
                keep = chunk_start + newline + 1
                break
            position = chunk_start
        else:
            keep = 0
        f.truncate(keep)
    warnings.warn(f"{path}: dropped a partial last line of {end - keep} bytes (left by an interrupted run)", stacklevel=3)


class MetricsWriter:
    """Append metrics records to a JSON-lines file (``truncate=True`` starts it empty; appending continues a resumed run)."""

    def __init__(self, path: "str | os.PathLike[str]", *, truncate: bool = False) -> None:
        self.path = os.fspath(path)
        folder = os.path.dirname(self.path)
        if folder:
            os.makedirs(folder, exist_ok=True)
        if not truncate and os.path.exists(self.path):
            _cut_partial_line(self.path)
        self._file = open(self.path, "w" if truncate else "a", buffering=1, encoding="utf-8")

    def write(self, record: Mapping[str, Any]) -> None:
        """Write one record (a dict with a ``"kind"`` and that kind's required fields) as one line; ``ValueError`` otherwise."""
        kind = record.get("kind")
        if kind not in KINDS:
            raise ValueError(f"record kind must be one of {', '.join(map(repr, KINDS))}; got {kind!r}")
        missing = [name for name in KINDS[kind] if name not in record]
        if missing:
            raise ValueError(f"{kind!r} record lacks {missing}")
        if kind == "eval" and record["evaluated"] not in EVALUATED:
            raise ValueError(f"evaluated must be one of {', '.join(map(repr, EVALUATED))}; got {record['evaluated']!r}")
        if self._file.closed:
            raise ValueError(f"MetricsWriter for {self.path} is closed")
        self._file.write(json.dumps(record, default=_plain) + "\n")
        if kind in _SYNC_KINDS:
            self._file.flush()
            os.fsync(self._file.fileno())

    def close(self) -> None:
        """Flush and close the file."""
        self._file.close()

    def __enter__(self) -> "MetricsWriter":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


@dataclass
class Run:
    """The records of one metrics file: ``header``, ``steps``, ``evals`` (superseded ones left out), ``end``, ``resumes``,
    ``lost`` (the ranks lost and the world that went on, in the order they came)."""

    header: Dict[str, Any]
    steps: List[Dict[str, Any]] = field(default_factory=list)
    evals: List[Dict[str, Any]] = field(default_factory=list)
    end: Optional[Dict[str, Any]] = None
    resumes: List[Dict[str, Any]] = field(default_factory=list)
    lost: List[Dict[str, Any]] = field(default_factory=list)
    path: str = ""

    @property
    def algorithm(self) -> str:
        """The algorithm's name from the header."""
        return str(self.header.get("algorithm", "?"))


def _append_in_step_order(records: List[Dict[str, Any]], record: Dict[str, Any]) -> None:
    # A step number that goes back means a resume from an earlier checkpoint:
    # the records from that step on were computed again and replace the old ones.
    while records and records[-1]["step"] >= record["step"]:
        records.pop()
    records.append(record)


def read_metrics(path: "str | os.PathLike[str]") -> Run:
    """Read a metrics file written by :class:`MetricsWriter`; a cut last line is ignored with a warning.

    ``ValueError`` names the file and line of a record that is not JSON of a known kind, or a missing ``"run"`` header.
    """
    path = os.fspath(path)
    with open(path, encoding="utf-8") as f:
        lines = f.read().split("\n")
    # The text after the last newline is a partial line ("" when complete).
    partial = lines.pop()
    run: Optional[Run] = None
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        record = _parse(path, number, line)
        kind = record["kind"]
        if run is None:
            if kind != "run":
                raise ValueError(f"{path}, line {number}: the first record must be a 'run' header, got kind {kind!r}")
            run = Run(header=record, path=path)
        elif kind == "run":
            run.resumes.append(record)
            run.end = None
        elif kind == "end":
            run.end = record
        elif kind == "lost":
            run.lost.append(record)
        else:
            _append_in_step_order(run.steps if kind == "step" else run.evals, record)
    if partial.strip():
        warnings.warn(f"{path}, line {len(lines) + 1}: ignoring a truncated last line ({len(partial)} characters)", stacklevel=2)
    if run is None:
        raise ValueError(f"{path}: no 'run' header record (empty file?)")
    return run


def _parse(path: str, number: int, line: str) -> Dict[str, Any]:
    try:
        record = json.loads(line)
    except json.JSONDecodeError as err:
        raise ValueError(f"{path}, line {number}: not JSON ({err.msg} at column {err.colno}): {line[:80]!r}") from None
    if not isinstance(record, dict) or record.get("kind") not in KINDS:
        raise ValueError(f"{path}, line {number}: not a metrics record (needs a 'kind' in {sorted(KINDS)}): {line[:80]!r}")
    if record["kind"] in ("step", "eval") and not isinstance(record.get("step"), int):
        raise ValueError(f"{path}, line {number}: {record['kind']!r} record needs an integer 'step', got {record.get('step')!r}")
    return record
