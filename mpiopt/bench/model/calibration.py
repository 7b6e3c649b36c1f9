"""Calibration: every collective's ``alpha`` and ``beta`` fitted to ``bench collectives`` measurements of one link."""

from __future__ import annotations

from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

import numpy as np

from ...kernels import chunk_bounds, packed_nbytes
from .costs import ALLREDUCES, collective_seconds, latency_terms, wire_bytes

__all__ = ["fit", "calibrate"]


def fit(points: Sequence[Tuple[int, float, float]], op: str, medium: str) -> Tuple[float, float]:
    """Weighted least-squares ``(alpha, beta) >= 0`` for ``op`` from ``(P, n, seconds)`` points, residuals over sqrt(time)."""
    if len(points) < 2:
        raise ValueError(f"fitting {op} needs at least 2 points, got {len(points)}")
    A = np.array([[latency_terms(op, P), wire_bytes(op, P, n, medium)] for P, n, _ in points], dtype=np.float64)
    t = np.array([s for _, _, s in points], dtype=np.float64)
    if np.any(t <= 0):
        raise ValueError(f"fitting {op}: times must be > 0, got {t.min()}")
    weight = 1 / np.sqrt(t)
    A, b = A * weight[:, None], t * weight
    best: Optional[Tuple[float, Tuple[float, float]]] = None
    # A two-variable non-negative least squares: the free fit if it is feasible, else each variable alone.
    candidates = [tuple(np.linalg.lstsq(A, b, rcond=None)[0])]
    for j in range(2):
        col = A[:, j]
        x = [0.0, 0.0]
        x[j] = float(col @ b / (col @ col)) if col @ col > 0 else 0.0
        candidates.append(tuple(x))
    for alpha, beta in candidates:
        if alpha < 0 or beta < 0:
            continue
        loss = float(np.sum((A @ np.array([alpha, beta]) - b) ** 2))
        if best is None or loss < best[0]:
            best = (loss, (float(alpha), float(beta)))
    assert best is not None  # the single-variable candidates are >= 0 whenever the times are
    return best[1]


def _message(record: Mapping[str, Any], P: int, density: float) -> Optional[Tuple[str, int]]:
    """The model's (collective, message bytes) for one ``bench collectives`` record, None if not modelled."""
    op, d = record["op"], int(record["d"])
    if op in ALLREDUCES or op == "bcast":
        return op, 4 * d
    if op == "allgather-bits":
        return "allgather", packed_nbytes(d)
    if op == "allgatherv-sparse":
        return "allgatherv", 8 * max(1, round(density * d))
    if op == "vote-twophase":
        bounds = chunk_bounds(packed_nbytes(d), P)
        return "twophase", int((bounds[:, 1] - bounds[:, 0]).max())
    return None


def calibrate(runs: Sequence[Mapping[str, Any]], medium: Optional[str] = None) -> Dict[str, Any]:
    """Fit every collective's ``alpha`` and ``beta`` to ``bench collectives`` JSON documents of one link.

    ``medium`` defaults to ``shared`` for runs inside the emulated link, else ``switched``.  Returns
    ``{"medium", "link_bits_per_second", "collectives": {op: {"alpha", "beta", "points"}}}``.
    """
    if not runs:
        raise ValueError("calibrate needs at least one bench collectives document")
    rates = {r.get("link_bits_per_second") for r in runs}
    if len(rates) != 1:
        raise ValueError(f"the documents are of different links {sorted(map(str, rates))}: calibrate one link at a time")
    if medium is None:
        medium = "shared" if all(r.get("emulated_link") for r in runs) else "switched"
    points: Dict[str, List[Tuple[int, float, float]]] = {}
    for r in runs:
        if r.get("benchmark") != "collectives":
            raise ValueError(f"expected a bench collectives document, got benchmark={r.get('benchmark')!r}")
        P = int(r["world_size"])
        for record in r["results"]:
            message = _message(record, P, float(r.get("density", 0.01)))
            if message is not None and P > 1:
                points.setdefault(message[0], []).append((P, float(message[1]), float(record["median_seconds"])))
    collectives = {}
    for op, pts in sorted(points.items()):
        alpha, beta = fit(pts, op, medium)
        rows = []
        for P, n, measured in pts:
            predicted = collective_seconds(op, P, n, alpha, beta, medium)
            rows.append({"P": P, "n": n, "measured": measured, "predicted": predicted, "error": predicted / measured - 1})
        collectives[op] = {"alpha": alpha, "beta": beta, "points": rows}
    return {"model": "alpha-beta", "medium": medium, "link_bits_per_second": rates.pop(), "collectives": collectives}
