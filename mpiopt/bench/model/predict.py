"""An algorithm's step under the model: its plan of calls, their seconds, and the projection to other links and ranks.

Validation compares the predictions with ``bench algorithms`` measurements;
projection runs them at rank counts and link rates this machine cannot.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any, Dict, Iterable, List, Mapping, Optional, Sequence, Tuple

from ...algorithms import ASYNCHRONOUS, SYNCHRONOUS, algorithm_class, available
from ...algorithms import algorithms as registered
from ...comm.ledger import Call
from ...training.config import training_defaults
from .._common import parse_rate
from .costs import COLLECTIVES, latency_terms, wire_bytes

__all__ = [
    "RANKS", "RATES", "FABRIC_ALPHA", "projected", "plan", "comm_seconds", "step_seconds", "async_seconds", "at_rate", "ideal_link", "validate",
    "project",
]

RANKS = (64, 128, 256, 512, 1024)
#: A fabric's per-hop latency for projections (a calibrated alpha here is this machine's scheduling, not a network's).
FABRIC_ALPHA = 1e-5
RATES = ("10gbit", "100gbit")


def projected() -> List[str]:
    """The algorithms the model projects: every synchronous one, and the asynchronous ones with a server model."""
    return [cls.name for cls in registered() if cls.protocol == SYNCHRONOUS or cls.server_messages(1) is not None]


def _hyper(name: str, hyper: Optional[Mapping[str, Any]]) -> Dict[str, Any]:
    """The algorithm's own defaults, then ``mpiopt train``'s, then ``hyper``."""
    return {**algorithm_class(name).default_hyperparameters(), **training_defaults(name), **(hyper or {})}


def plan(name: str, d: int, P: int, hyper: Optional[Mapping[str, Any]] = None, groups: Optional[Sequence[int]] = None,
         ranks_per_island: int = 1) -> List[Call]:
    """The calls of one step of synchronous ``name`` (d float32 parameters, P ranks), averaged over its cycle.

    ``ranks_per_island`` > 1: an island run's, its calls within the islands at ``level="node"``.
    ``ValueError`` for an unknown or asynchronous algorithm, or groups that do not add up to ``P``.
    """
    cls = algorithm_class(name)
    if cls.protocol != SYNCHRONOUS:
        raise ValueError(f"plan covers the synchronous algorithms {', '.join(available(SYNCHRONOUS))}; got {name!r}")
    h = _hyper(name, hyper)
    cycle = cls.plan_cycle(h)
    calls = cls.communication(d, P, h, groups=groups, steps=range(1, cycle + 1), ranks_per_island=ranks_per_island)
    return [replace(call, count=call.count / cycle) for call in calls]


def _params(model: Mapping[str, Any], op: str) -> Tuple[float, float]:
    """``(alpha, beta)`` of ``op`` in ``model``; a missing one says which measurement to add."""
    try:
        entry = model["collectives"][op]
    except KeyError:
        raise ValueError(f"the model has no calibration of {op!r} (has {', '.join(model['collectives'])}): "
                         "run bench collectives with that operation") from None
    return float(entry["alpha"]), float(entry["beta"])


def comm_seconds(calls: Iterable[Call], model: Mapping[str, Any], compute: float = 0.0,
                 node: Optional[Mapping[str, Any]] = None) -> float:
    """Communication seconds per step: phases one after the other; calls of a phase in parallel (switched) or one after the other (shared).

    A call in flight across ``overlap_steps`` steps of ``compute`` seconds
    (DaSGD's averaging) exposes only what outlasts them; one that MPI moves a
    round at a time (``progress_rounds``) hides those rounds, each behind at
    most a step.  A call's ``copies`` (an island run's rails) share a shared
    medium and run side by side on a switched one.  Calls within islands
    (``level="node"``) are priced by ``node``, the node's model, after the
    link's (a node's copies are on other nodes: side by side).
    """
    calls = list(calls)
    inside = [c for c in calls if c.level == "node"]
    if inside:
        if node is None:
            raise ValueError("the calls within islands need the node's model (node=...): bench collectives inside one node")
        return comm_seconds([c for c in calls if c.level != "node"], model, compute) + comm_seconds(
            [replace(c, level="link", copies=1) for c in inside], node, compute)
    medium = model["medium"]
    phases: Dict[int, List[float]] = {}
    for c in calls:
        alpha, beta = _params(model, c.op)
        sharing = c.copies if medium == "shared" else 1
        whole = latency_terms(c.op, c.ranks) * alpha + sharing * wire_bytes(c.op, c.ranks, c.nbytes, medium) * beta
        if c.progress_rounds is None:
            hidden = c.overlap_steps * compute
        else:
            rounds = max(1, latency_terms(c.op, c.ranks))
            hidden = min(c.progress_rounds, rounds) * min(whole / rounds, compute)
        phases.setdefault(c.phase, []).append(c.count * max(0.0, whole - hidden))
    return sum((sum(ts) if medium == "shared" else max(ts)) for ts in phases.values())


def step_seconds(
    name: str, d: int, P: int, compute: float, model: Mapping[str, Any],
    hyper: Optional[Mapping[str, Any]] = None, groups: Optional[Sequence[int]] = None,
    ranks_per_island: int = 1, node: Optional[Mapping[str, Any]] = None,
) -> Dict[str, float]:
    """Predicted ``{"compute", "comm", "total"}`` seconds per step; ``dasgd``'s averaging exposes only what outlasts its delay.

    An island run (``ranks_per_island`` > 1) prices its calls within the islands by ``node``, the node's model.
    """
    comm = comm_seconds(plan(name, d, P, hyper, groups, ranks_per_island), model, compute, node)
    return {"compute": compute, "comm": comm, "total": compute + comm}


def async_seconds(
    d: int, P: int, compute: float, model: Mapping[str, Any], messages: Optional[Sequence[float]] = None
) -> Dict[str, Any]:
    """A parameter server's seconds per ``P`` gradients, and whether the server (``server_bound``) sets that rate.

    ``messages``: bytes the server receives and sends per update, one after the other (default 4d in, 4d out).
    """
    if P < 2:
        raise ValueError(f"a parameter server needs a server and a worker: P >= 2, got {P}")
    alpha, beta = _params(model, "allreduce")
    messages = (4 * d, 4 * d) if messages is None else messages
    server = sum(alpha + nbytes * beta for nbytes in messages)  # one update: its messages one after the other
    throughput = min((P - 1) / (compute + server), 1.0 / server)  # gradients per second
    total = P / throughput
    return {"compute": compute, "comm": total - compute, "total": total, "server_bound": 1.0 / server < (P - 1) / (compute + server)}


def at_rate(model: Mapping[str, Any], bits_per_second: float, medium: str = "switched", alpha: Optional[float] = None) -> Dict[str, Any]:
    """The model moved to a link of ``bits_per_second``: every beta scaled by the rate ratio, alpha kept (or ``alpha``)."""
    scale = float(model["link_bits_per_second"]) / bits_per_second
    collectives = {op: {"alpha": entry["alpha"] if alpha is None else alpha, "beta": entry["beta"] * scale}
                   for op, entry in model["collectives"].items()}
    return {**model, "medium": medium, "link_bits_per_second": bits_per_second, "collectives": collectives}


def ideal_link(bits_per_second: float, alpha: float) -> Dict[str, Any]:
    """A switched link that moves every collective's wire bytes at ``bits_per_second`` after ``alpha`` a hop: a model of
    links this machine does not have (a GPU node's NVLink or PCIe), where no calibration can be measured."""
    if bits_per_second <= 0 or alpha < 0:
        raise ValueError(f"an ideal link needs a rate > 0 and an alpha >= 0, got {bits_per_second:g} bit/s and {alpha:g} s")
    return {"model": "ideal", "medium": "switched", "link_bits_per_second": float(bits_per_second),
            "collectives": {op: {"alpha": float(alpha), "beta": 8.0 / bits_per_second} for op in COLLECTIVES}}


def validate(model: Mapping[str, Any], measured: Sequence[Mapping[str, Any]],
             node: Optional[Mapping[str, Any]] = None) -> List[Dict[str, Any]]:
    """Predicted (model communication on measured computation) against measured step time, per algorithm and document
    (an island run's calls within the islands priced by ``node``, the node's model)."""
    rows = []
    for doc in measured:
        if doc.get("benchmark") != "algorithms":
            raise ValueError(f"expected a bench algorithms document, got benchmark={doc.get('benchmark')!r}")
        P, d = int(doc["world_size"]), int(doc["d"])
        for r in doc["results"]:
            t = r["seconds_per_step"]
            compute = t["compute"] + t["algorithm"]
            measured_total = sum(t.values())
            G = int(doc.get("ranks_per_island", 1))
            predicted = step_seconds(r["algorithm"], d, P, compute, model, r["hyperparameters"], r["groups"], G, node)
            rows.append({
                "algorithm": r["algorithm"] + (f" (islands of {G})" if G > 1 else ""), "mode": r.get("mode"), "P": P, "d": d,
                "compute": compute,
                "measured_comm": t["communication"] + t["waiting"], "predicted_comm": predicted["comm"],
                "measured": measured_total, "predicted": predicted["total"], "error": predicted["total"] / measured_total - 1,
            })
    return rows


def project(
    model: Mapping[str, Any],
    models: Sequence[Tuple[str, int, float]],
    ranks: Sequence[int] = RANKS,
    rates: Sequence[str] = RATES,
    algorithms: Optional[Sequence[str]] = None,
    alpha: Optional[float] = None,
    ranks_per_island: int = 1,
    node: Optional[Mapping[str, Any]] = None,
) -> List[Dict[str, Any]]:
    """Projected seconds per step and speed-up over per-rank ``sgd`` per (model, rate, ranks, algorithm) on a switched
    network; ``ranks_per_island`` > 1 adds each synchronous algorithm's island run ("diloco@islands"), ``node`` its
    calls within the islands."""
    baseline = next(cls.name for cls in registered() if cls.baseline)
    rows = []
    for rate in rates:
        moved = at_rate(model, parse_rate(rate), "switched", alpha)
        for label, d, compute in models:
            for P in ranks:
                times = {}
                for name in algorithms or projected():
                    cls = algorithm_class(name)
                    if cls.protocol == ASYNCHRONOUS:
                        times[name] = async_seconds(d, P, compute, moved, cls.server_messages(d))["total"]
                        continue
                    times[name] = step_seconds(name, d, P, compute, moved)["total"]
                    if ranks_per_island > 1 and cls.islands_refusal is None and P % ranks_per_island == 0:
                        times[f"{name}@islands"] = step_seconds(name, d, P, compute, moved, None, None, ranks_per_island, node)["total"]
                base = times.get(baseline) or step_seconds(baseline, d, P, compute, moved)["total"]
                for name, total in times.items():
                    rows.append({"model": label, "d": d, "compute": compute, "rate": rate, "P": P, "algorithm": name,
                                 "seconds": total, "speedup": base / total})
    return rows
