"""A timeline of every rank's compute phases and MPI calls, for chrome://tracing and ui.perfetto.dev.

Lanes, clock alignment across ranks and the event cap: docs/internals-metrics.md, "Traces".
"""

from __future__ import annotations

import json
import os
import threading
import time
import warnings
from contextlib import contextmanager
from typing import Any, Dict, Iterable, Iterator, List, Mapping, Optional, Sequence, Tuple, Union

import numpy as np

from ..algorithms.schema import check_positive
from ..comm import Comm, Topology
from ..comm.ledger import SPAN_KINDS

__all__ = ["Tracer", "overlap_fraction", "CATEGORIES", "LANE_NAMES"]

#: Event categories: a compute phase and the ledger's span kinds.
CATEGORIES: Tuple[str, ...] = ("phase",) + SPAN_KINDS
_PHASE, _BLOCKING, _INFLIGHT, _WAIT = range(len(CATEGORIES))
_LANE_COMPUTE, _LANE_BLOCKED, _LANE_INFLIGHT = 0, 1, 2
#: Thread names of the fixed lanes; in-flight lanes from 2 on are all "MPI in flight".
LANE_NAMES: Dict[int, str] = {_LANE_COMPUTE: "compute", _LANE_BLOCKED: "MPI blocked", _LANE_INFLIGHT: "MPI in flight"}

# One event as it travels to rank 0: name index, category, lane, start and
# duration in microseconds since the reference time.
_WIRE = np.dtype([("name", np.int32), ("cat", np.int8), ("tid", np.int16), ("ts", np.float64), ("dur", np.float64)])
# Tag of the event arrays sent to rank 0 (the Comm is a Dup of its own, so
# only other mpiopt traffic could match, and none runs during a collective).
_TAG = 0x7ACE


class Tracer:
    """Record a timeline of this rank's compute phases and MPI calls from the ledger's spans.

    Collective: every rank creates one at the same point (it starts with a ``Barrier``) and calls :meth:`write`
    together.  ``max_events``: events kept per rank; later ones are counted, not kept.
    """

    def __init__(self, topology_or_comm: Union[Topology, Comm], *, max_events: int = 200_000) -> None:
        if isinstance(topology_or_comm, Topology):
            comm = topology_or_comm.world
        elif isinstance(topology_or_comm, Comm):
            comm = topology_or_comm
        else:
            raise TypeError(f"topology_or_comm must be an mpiopt Topology or Comm, got {type(topology_or_comm).__name__}")
        self.max_events = check_positive("max_events", max_events, integer=True)
        self.comm = comm
        self.ledger = comm.ledger
        if self.ledger.listener is not None:
            raise RuntimeError(f"the ledger of {comm!r} already has a span listener ({self.ledger.listener!r}); close that Tracer first")
        self.dropped = 0
        self._names: Dict[str, int] = {}
        self._events: List[Tuple[int, int, float, float]] = []
        # The DaSGD progress thread completes requests too.
        self._lock = threading.Lock()
        comm.Barrier()
        self.reference = time.perf_counter()
        self.ledger.listener = self._on_span

    # -- recording -------------------------------------------------------------
    @property
    def recording(self) -> bool:
        """Whether this tracer is the ledger's listener (not closed)."""
        return self.ledger.listener == self._on_span

    def _add(self, name: str, category: int, start: float, end: float) -> None:
        with self._lock:
            if len(self._events) >= self.max_events:
                if not self.dropped:
                    warnings.warn(
                        f"Tracer on rank {self.comm.rank}: {self.max_events} events recorded (max_events); "
                        "later events are dropped and counted",
                        stacklevel=3,
                    )
                self.dropped += 1
                return
            index = self._names.setdefault(name, len(self._names))
            self._events.append((index, category, start, end))

    def _on_span(self, op: str, start: float, end: float, kind: str) -> None:
        self._add(op, CATEGORIES.index(kind), start, end)

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        """Mark the enclosed code as the compute phase ``name`` (lane 0)."""
        start = time.perf_counter()
        try:
            yield
        finally:
            if self.recording:
                self._add(name, _PHASE, start, time.perf_counter())

    def survivors(self, comm: Comm, note: str) -> None:
        """After a lost rank: mark ``note`` in the phases' lane now, and gather over ``comm`` (the survivors') later."""
        now = time.perf_counter()
        self._add(note, _PHASE, now, now)
        self.comm = comm

    def close(self) -> None:
        """Stop listening (the events recorded so far stay, for :meth:`write`)."""
        if self.recording:
            self.ledger.listener = None

    def __enter__(self) -> "Tracer":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # -- writing ---------------------------------------------------------------
    def _table(self, scale: float) -> np.ndarray:
        """This rank's events as a wire array, times in microseconds since the reference, lanes assigned."""
        with self._lock:
            raw = np.array(self._events, dtype=[("name", np.int32), ("cat", np.int8), ("start", np.float64), ("end", np.float64)])
        table = np.empty(len(raw), dtype=_WIRE)
        table["name"] = raw["name"]
        table["cat"] = raw["cat"]
        # Rounded to nanoseconds: the clock's resolution, and a third of the JSON's digits.
        table["ts"] = np.round((raw["start"] - self.reference) * scale * 1e6, 3)
        table["dur"] = np.round(np.maximum(raw["end"] - raw["start"], 0.0) * scale * 1e6, 3)
        table["tid"] = np.where(raw["cat"] == _PHASE, _LANE_COMPUTE, _LANE_BLOCKED)
        inflight = np.flatnonzero(raw["cat"] == _INFLIGHT)
        table["tid"][inflight] = _LANE_INFLIGHT + _stack_lanes(table["ts"][inflight], table["dur"][inflight])
        return table[np.argsort(table["ts"], kind="stable")]

    def write(self, path: "str | os.PathLike[str]") -> Optional[Dict[str, Any]]:
        """Gather every rank's events to rank 0 and write the trace there (collective); the trace on rank 0, None elsewhere."""
        resume = self.recording
        self.close()
        try:
            self.comm.Barrier()
            elapsed = time.perf_counter() - self.reference
            elapsed_rank0 = self.comm.bcast_obj(elapsed)
            table = self._table(elapsed_rank0 / elapsed)
            names = sorted(self._names, key=self._names.get)
            everyone = self.comm.allgather_obj((len(table), names, self.dropped))
            if self.comm.rank != 0:
                if len(table):
                    self.comm.Send(table.view(np.uint8), 0, _TAG)
                return None
            tables = [table]
            for rank in range(1, self.comm.size):
                theirs = np.empty(everyone[rank][0], dtype=_WIRE)
                if len(theirs):
                    self.comm.Recv(theirs.view(np.uint8), source=rank, tag=_TAG)
                tables.append(theirs)
            trace = _trace_document(tables, [names for _, names, _ in everyone], [dropped for _, _, dropped in everyone])
            _write_json(os.fspath(path), trace)
            return trace
        finally:
            if resume:
                self.ledger.listener = self._on_span


def _stack_lanes(starts: np.ndarray, durations: np.ndarray) -> np.ndarray:
    """Lane index per interval so that intervals in one lane never overlap (greedy, by start)."""
    lanes = np.zeros(len(starts), dtype=np.int16)
    lane_ends: List[float] = []
    for i in np.argsort(starts, kind="stable"):
        free = next((k for k, end in enumerate(lane_ends) if end <= starts[i]), len(lane_ends))
        if free == len(lane_ends):
            lane_ends.append(0.0)
        lane_ends[free] = starts[i] + durations[i]
        lanes[i] = free
    return lanes


def _trace_document(tables: Sequence[np.ndarray], names: Sequence[Sequence[str]], dropped: Sequence[int]) -> Dict[str, Any]:
    """The Trace Event Format object: metadata, then "X" (complete) events per rank."""
    events: List[Dict[str, Any]] = []
    for rank, (table, rank_names) in enumerate(zip(tables, names)):
        events.append({"name": "process_name", "ph": "M", "pid": rank, "tid": 0, "args": {"name": f"rank {rank}"}})
        events.append({"name": "process_sort_index", "ph": "M", "pid": rank, "tid": 0, "args": {"sort_index": rank}})
        for tid in sorted(set(LANE_NAMES) | {int(t) for t in np.unique(table["tid"])}):
            lane = LANE_NAMES.get(tid, LANE_NAMES[_LANE_INFLIGHT])
            events.append({"name": "thread_name", "ph": "M", "pid": rank, "tid": tid, "args": {"name": lane}})
        for name, cat, tid, ts, dur in table.tolist():
            events.append({"name": rank_names[name], "cat": CATEGORIES[cat], "ph": "X", "ts": ts, "dur": dur, "pid": rank, "tid": tid})
    return {
        "traceEvents": events,
        "displayTimeUnit": "ms",
        "otherData": {"dropped_events": list(dropped), "clock": "microseconds since a Barrier at the Tracer's start"},
    }


def _write_json(path: str, document: Mapping[str, Any]) -> None:
    """Write ``document`` to ``path`` through a temporary name, so a reader never sees half a file."""
    folder = os.path.dirname(path)
    if folder:
        os.makedirs(folder, exist_ok=True)
    temporary = f"{path}.tmp{os.getpid()}"
    with open(temporary, "w", encoding="utf-8") as f:
        json.dump(document, f)
    os.replace(temporary, path)


def _union(intervals: Iterable[Tuple[float, float]]) -> List[Tuple[float, float]]:
    merged: List[Tuple[float, float]] = []
    for start, end in sorted(intervals):
        if merged and start <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], end))
        else:
            merged.append((start, end))
    return merged


def _overlap(a: List[Tuple[float, float]], b: List[Tuple[float, float]]) -> float:
    """Total length of the intersection of two sorted disjoint interval lists."""
    total, i, j = 0.0, 0, 0
    while i < len(a) and j < len(b):
        total += max(0.0, min(a[i][1], b[j][1]) - max(a[i][0], b[j][0]))
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return total


def overlap_fraction(events: Iterable[Mapping[str, Any]], rank: int, phases: Optional[Iterable[str]] = None) -> float:
    """Fraction of ``rank``'s in-flight nonblocking communication time that ran during ``phases`` (default: all); NaN if none."""
    wanted = None if phases is None else set(phases)
    inflight, compute = [], []
    for event in events:
        if event.get("ph") != "X" or event.get("pid") != rank:
            continue
        span = (event["ts"], event["ts"] + event["dur"])
        if event.get("cat") == "inflight":
            inflight.append(span)
        elif event.get("cat") == "phase" and (wanted is None or event["name"] in wanted):
            compute.append(span)
    flying = _union(inflight)
    total = sum(end - start for start, end in flying)
    if total <= 0:
        return float("nan")
    return _overlap(flying, _union(compute)) / total
