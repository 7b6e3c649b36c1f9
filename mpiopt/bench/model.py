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

import argparse
import json
import math
import sys
from dataclasses import replace
from typing import Any, Dict, Iterable, List, Mapping, Optional, Sequence, Tuple

import numpy as np

from ..algorithms import ASYNCHRONOUS, SYNCHRONOUS, algorithm_class, available
from ..algorithms import algorithms as registered
from ..comm.ledger import Call
from ..kernels import chunk_bounds, packed_nbytes
from ..training.config import UsageError, training_defaults
from ._common import check_choices, comma_list, count, markdown_table, module_main, parse_rate, save_figure, write_json

__all__ = [
    "MEDIA", "COLLECTIVES", "latency_terms", "wire_bytes", "collective_seconds", "fit",
    "calibrate", "plan", "projected", "step_seconds", "async_seconds", "validate", "project",
    "add_arguments", "run", "main",
]

MEDIA = ("switched", "shared")
COLLECTIVES = ("allreduce", "iallreduce", "allgather", "allgatherv", "bcast", "twophase")
#: MPICH's MPIR_CVAR_BCAST_MIN_PROCS: fewer ranks broadcast along a binomial tree, more scatter and allgather.
BCAST_MIN_PROCS = 8
RANKS = (64, 128, 256, 512, 1024)
RATES = ("10gbit", "100gbit")
#: name=parameters@compute-ms: ResNet-50 (25.6M) and a 350M-parameter model, compute per step on one accelerator.
MODELS = ("resnet50=25.6M@100", "350M=350M@500")


def _log2(P: int) -> int:
    return max(0, math.ceil(math.log2(P)))


def latency_terms(op: str, P: int) -> int:
    """Message hops on the critical path of ``op`` over ``P`` ranks (the ``alpha`` multiplier)."""
    if P < 2:
        return 0
    if op in ("allreduce", "iallreduce"):
        return 2 * _log2(P)
    if op in ("allgather", "allgatherv"):
        return P - 1
    if op == "bcast":
        return _log2(P) + P - 1 if P >= BCAST_MIN_PROCS else _log2(P)
    if op == "twophase":
        return 2 * (P - 1)
    raise ValueError(f"op must be one of {', '.join(COLLECTIVES)}, got {op!r}")


def wire_bytes(op: str, P: int, n: float, medium: str = "switched") -> float:
    """The ``beta`` multiplier: bytes one rank sends on the critical path (switched) or all ranks together (shared).

    ``n`` is the op's message: the vector's bytes (allreduce, bcast), one
    rank's contribution (allgather) or the chunk width ``w`` (twophase).
    """
    if medium not in MEDIA:
        raise ValueError(f"medium must be one of {', '.join(MEDIA)}, got {medium!r}")
    if P < 2:
        return 0.0
    shared = medium == "shared"
    if op in ("allreduce", "iallreduce"):
        return 2 * (P - 1) * n if shared else 2 * (P - 1) / P * n
    if op in ("allgather", "allgatherv"):
        return P * (P - 1) * n if shared else (P - 1) * n
    if op == "bcast" and P < BCAST_MIN_PROCS:  # binomial tree: every non-root receives n once
        return (P - 1) * n if shared else _log2(P) * n
    if op == "bcast":  # binomial scatter (n/2 per level) + ring allgather
        return (_log2(P) / 2 + P - 1) * n if shared else 2 * (P - 1) / P * n
    if op == "twophase":
        return 2 * P * (P - 1) * n if shared else 2 * (P - 1) * n
    raise ValueError(f"op must be one of {', '.join(COLLECTIVES)}, got {op!r}")


def collective_seconds(op: str, P: int, n: float, alpha: float, beta: float, medium: str = "switched") -> float:
    """``latency_terms * alpha + wire_bytes * beta``."""
    return latency_terms(op, P) * alpha + wire_bytes(op, P, n, medium) * beta


# ---------------------------------------------------------------------------------------------------------- calibrate


def fit(points: Sequence[Tuple[int, float, float]], op: str, medium: str) -> Tuple[float, float]:
    """Weighted least-squares ``(alpha, beta) >= 0`` for ``op`` from ``(P, n, seconds)`` points.

    Each residual is divided by the square root of its time: between
    absolute error (where the largest messages alone set both parameters)
    and relative error (where the small messages' scheduling noise on a
    loaded machine drags ``beta`` below the link's), as if a call's noise
    grew with the square root of its time.
    """
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
    if op in ("allreduce", "iallreduce", "bcast"):
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

    Parameters
    ----------
    runs : sequence of dict
        The documents (``world_size``, ``link_bits_per_second``,
        ``emulated_link``, ``density``, ``results``), typically one per
        world size.
    medium : {"switched", "shared"}, optional
        Default: ``shared`` if the runs were inside the emulated link, else
        ``switched``.

    Returns
    -------
    dict
        ``{"medium", "link_bits_per_second", "collectives": {op: {"alpha",
        "beta", "points": [{"P", "n", "measured", "predicted", "error"}]}}}``.
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


# --------------------------------------------------------------------------------------------------------------- plan


def projected() -> List[str]:
    """The algorithms the model projects: every synchronous one, and the asynchronous ones with a server model."""
    return [cls.name for cls in registered() if cls.protocol == SYNCHRONOUS or cls.server_messages(1) is not None]


def _hyper(name: str, hyper: Optional[Mapping[str, Any]]) -> Dict[str, Any]:
    """The algorithm's own defaults, then ``mpiopt train``'s, then ``hyper``."""
    return {**algorithm_class(name).default_hyperparameters(), **training_defaults(name), **(hyper or {})}


def plan(name: str, d: int, P: int, hyper: Optional[Mapping[str, Any]] = None, groups: Optional[Sequence[int]] = None) -> List[Call]:
    """The collective calls of one step of synchronous algorithm ``name`` (d float32 parameters, P ranks), averaged over a cycle.

    The algorithm's own plan (``Algorithm.communication``) over the steps
    after which it repeats, each call's ``count`` divided by their number.

    Raises
    ------
    ValueError
        An unknown or asynchronous algorithm, or groups that do not add up to ``P``.
    """
    cls = algorithm_class(name)
    if cls.protocol != SYNCHRONOUS:
        raise ValueError(f"plan covers the synchronous algorithms {', '.join(available(SYNCHRONOUS))}; got {name!r}")
    h = _hyper(name, hyper)
    cycle = cls.plan_cycle(h)
    calls = cls.communication(d, P, h, groups=groups, steps=range(1, cycle + 1))
    return [replace(call, count=call.count / cycle) for call in calls]


def _params(model: Mapping[str, Any], op: str) -> Tuple[float, float]:
    try:
        entry = model["collectives"][op]
    except KeyError:
        raise ValueError(f"the model has no calibration of {op!r} (has {', '.join(model['collectives'])}): "
                         "run bench collectives with that operation") from None
    return float(entry["alpha"]), float(entry["beta"])


def comm_seconds(calls: Iterable[Call], model: Mapping[str, Any], compute: float = 0.0) -> float:
    """Communication seconds per step: phases one after the other; calls of a phase in parallel (switched) or one after the other (shared).

    A call in flight across ``overlap_steps`` steps of ``compute`` seconds
    (DaSGD's averaging) exposes only what outlasts them.
    """
    medium = model["medium"]
    phases: Dict[int, List[float]] = {}
    for c in calls:
        alpha, beta = _params(model, c.op)
        whole = collective_seconds(c.op, c.ranks, c.nbytes, alpha, beta, medium)
        phases.setdefault(c.phase, []).append(c.count * max(0.0, whole - c.overlap_steps * compute))
    return sum((sum(ts) if medium == "shared" else max(ts)) for ts in phases.values())


def step_seconds(
    name: str, d: int, P: int, compute: float, model: Mapping[str, Any],
    hyper: Optional[Mapping[str, Any]] = None, groups: Optional[Sequence[int]] = None,
) -> Dict[str, float]:
    """Predicted seconds per step of synchronous ``name``: ``{"compute", "comm", "total"}``.

    ``compute`` is the step's local computation (forward, backward and the
    algorithm's own work).  ``comm`` is what the step waits for: everything
    but ``dasgd``'s averaging, of which only ``max(0, t - delay_steps
    compute)`` per averaging is exposed.
    """
    comm = comm_seconds(plan(name, d, P, hyper, groups), model, compute)
    return {"compute": compute, "comm": comm, "total": compute + comm}


def async_seconds(
    d: int, P: int, compute: float, model: Mapping[str, Any], messages: Optional[Sequence[float]] = None
) -> Dict[str, Any]:
    """A parameter server's seconds per ``P`` gradients: P-1 workers, one server whose link carries ``messages`` per update.

    ``messages`` are the bytes the server receives and sends per update
    (the algorithm's ``server_messages``; default a 4d-byte gradient in and
    4d bytes of parameters out, one after the other).

    Returns ``{"compute", "comm", "total", "server_bound"}``: ``total`` is
    ``P`` over the gradients per second, ``server_bound`` whether the
    server, not the workers, sets that rate.

    Point-to-point messages cost ``alpha + bytes beta`` with the
    allreduce's calibration; on a shared medium a worker's send and the
    server's reply also share the one link, which the same serialisation
    already counts.
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


# ----------------------------------------------------------------------------------------------------------- validate


def validate(model: Mapping[str, Any], measured: Sequence[Mapping[str, Any]]) -> List[Dict[str, Any]]:
    """Predicted against measured step time for every algorithm of every ``bench algorithms`` document.

    The prediction's computation is the measured ``compute`` + ``algorithm``
    seconds (the model's input); the communication is the model's.  The
    measured step is the sum of all four phases.
    """
    rows = []
    for doc in measured:
        if doc.get("benchmark") != "algorithms":
            raise ValueError(f"expected a bench algorithms document, got benchmark={doc.get('benchmark')!r}")
        P, d = int(doc["world_size"]), int(doc["d"])
        for r in doc["results"]:
            t = r["seconds_per_step"]
            compute = t["compute"] + t["algorithm"]
            measured_total = sum(t.values())
            predicted = step_seconds(r["algorithm"], d, P, compute, model, r["hyperparameters"], r["groups"])
            rows.append({
                "algorithm": r["algorithm"], "mode": r.get("mode"), "P": P, "d": d, "compute": compute,
                "measured_comm": t["communication"] + t["waiting"], "predicted_comm": predicted["comm"],
                "measured": measured_total, "predicted": predicted["total"], "error": predicted["total"] / measured_total - 1,
            })
    return rows


# ------------------------------------------------------------------------------------------------------------ project


def _parse_models(specs: Sequence[str]) -> List[Tuple[str, int, float]]:
    """``name=D@MS`` -> (name, parameters, compute seconds)."""
    out = []
    for spec in specs:
        try:
            name, rest = spec.split("=", 1)
            d, ms = rest.split("@", 1)
            out.append((name, count(d), float(ms) / 1e3))
        except (ValueError, argparse.ArgumentTypeError):
            raise UsageError(f"--models: expected NAME=PARAMETERS@COMPUTE_MS such as resnet50=25.6M@100, got {spec!r}") from None
    return out


def project(
    model: Mapping[str, Any],
    models: Sequence[Tuple[str, int, float]],
    ranks: Sequence[int] = RANKS,
    rates: Sequence[str] = RATES,
    algorithms: Optional[Sequence[str]] = None,
    alpha: Optional[float] = None,
) -> List[Dict[str, Any]]:
    """Projected seconds per step and speed-up over ``sgd`` for every (model, rate, ranks, algorithm) on a switched network.

    ``models`` are ``(label, parameters, compute seconds per step)``; every
    algorithm runs with ``mpiopt train``'s hyperparameters and one group of
    all ranks (``lsgd`` without node-local pulls).
    """
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
                    else:
                        times[name] = step_seconds(name, d, P, compute, moved)["total"]
                base = times.get(baseline) or step_seconds(baseline, d, P, compute, moved)["total"]
                for name, total in times.items():
                    rows.append({"model": label, "d": d, "compute": compute, "rate": rate, "P": P, "algorithm": name,
                                 "seconds": total, "speedup": base / total})
    return rows


# ---------------------------------------------------------------------------------------------------------- reporting


def calibration_table(model: Mapping[str, Any]) -> str:
    """Per collective: alpha, beta, the rate 1/beta and the fit's errors over its points."""
    rows = []
    for op, entry in model["collectives"].items():
        errors = [abs(p["error"]) for p in entry["points"]]
        rows.append([op, f"{1e6 * entry['alpha']:.1f}", f"{1e9 * entry['beta']:.3f}", f"{8 / entry['beta'] / 1e9:.3f}",
                     len(errors), f"{100 * float(np.median(errors)):.0f} %", f"{100 * max(errors):.0f} %"])
    return markdown_table(["collective", "alpha (us)", "beta (ns/B)", "1/beta (Gbit/s)", "points", "median abs. error", "max abs. error"], rows)


def _percent(predicted: float, measured: float) -> str:
    return f"{100 * (predicted / measured - 1):+.0f} %" if measured > 0 else "-"


def validation_table(rows: Sequence[Mapping[str, Any]], goal: float = 0.25) -> str:
    """:func:`validate`'s rows: communication and step time, measured and predicted, and whether within ``goal``."""
    body = [[r["algorithm"] + (f" ({r['mode']})" if r["mode"] else ""), r["P"], f"{r['d']:,}", f"{1e3 * r['compute']:.1f}",
             f"{1e3 * r['measured_comm']:.1f}", f"{1e3 * r['predicted_comm']:.1f}", _percent(r["predicted_comm"], r["measured_comm"]),
             f"{1e3 * r['measured']:.1f}",
             f"{1e3 * r['predicted']:.1f}", f"{100 * r['error']:+.0f} %", "yes" if abs(r["error"]) <= goal else "**no**"]
            for r in rows]
    header = ["algorithm", "P", "d", "compute ms", "comm ms (measured)", "comm ms (model)", "comm error", "step ms (measured)",
              "step ms (model)", "error", f"within {100 * goal:.0f} %"]
    return markdown_table(header, body)


def projection_table(rows: Sequence[Mapping[str, Any]]) -> str:
    """One row per (model, rate, algorithm), one column per rank count: ``step ms (speed-up x)``."""
    ranks = sorted({r["P"] for r in rows})
    keyed: Dict[Tuple[str, str, str], Dict[int, Mapping[str, Any]]] = {}
    for r in rows:
        keyed.setdefault((r["model"], r["rate"], r["algorithm"]), {})[r["P"]] = r
    body = [[m, rate, name, *(f"{1e3 * by_p[P]['seconds']:.0f} ({by_p[P]['speedup']:.2f}x)" for P in ranks)]
            for (m, rate, name), by_p in keyed.items()]
    return markdown_table(["model", "link", "algorithm", *(f"P={P}" for P in ranks)], body, align="lll" + "r" * len(ranks))


def plot_projection(rows: Sequence[Mapping[str, Any]], path: str) -> None:
    """Speed-up over sgd against ranks: one panel per (rate, model), rates in rows, models in columns."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    models, rates = list(dict.fromkeys(r["model"] for r in rows)), list(dict.fromkeys(r["rate"] for r in rows))
    fig, axes = plt.subplots(len(rates), len(models), figsize=(4.6 * len(models), 3.4 * len(rates) + 0.6), sharex=True, sharey=True, squeeze=False)
    for i, rate in enumerate(rates):
        for j, m in enumerate(models):
            ax, mine = axes[i][j], [r for r in rows if r["model"] == m and r["rate"] == rate]
            for name in dict.fromkeys(r["algorithm"] for r in mine):
                pts = sorted((r["P"], r["speedup"]) for r in mine if r["algorithm"] == name)
                ax.plot([p for p, _ in pts], [s for _, s in pts], marker="o", ms=3, label=name, ls="--" if name.startswith("async") else "-")
            ax.set(xscale="log", yscale="log", title=f"{m}, {rate}")
            ax.set_xscale("log", base=2)
            ax.grid(True, which="both", alpha=0.3)
        axes[i][0].set_ylabel("speed-up over sgd")
    for ax in axes[-1]:
        ax.set_xlabel("ranks")
    handles, labels = axes[0][0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=min(len(labels), 8), fontsize=8)
    fig.tight_layout(rect=(0, 0.07, 1, 1))
    save_figure(fig, path)


def plot_validation(rows: Sequence[Mapping[str, Any]], path: str, goal: float = 0.25) -> None:
    """Predicted against measured step time, one marker per point, the goal's band shaded."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5, 4.5))
    for P, marker in zip(sorted({r["P"] for r in rows}), "os^Dv"):
        mine = [r for r in rows if r["P"] == P]
        ax.scatter([1e3 * r["measured"] for r in mine], [1e3 * r["predicted"] for r in mine], marker=marker, label=f"P={P}")
        for r in mine:
            ax.annotate(r["algorithm"], (1e3 * r["measured"], 1e3 * r["predicted"]), fontsize=6)
    lo = 0.8 * 1e3 * min(min(r["measured"], r["predicted"]) for r in rows)
    hi = 1.25 * 1e3 * max(max(r["measured"], r["predicted"]) for r in rows)
    xs = np.geomspace(lo, hi, 50)
    ax.plot(xs, xs, "k-", lw=0.8)
    ax.fill_between(xs, xs * (1 - goal), xs * (1 + goal), color="gray", alpha=0.2, label=f"within {100 * goal:.0f} %")
    ax.set(xscale="log", yscale="log", xlabel="measured step (ms)", ylabel="model step (ms)", title="alpha-beta model vs measured")
    ax.legend(fontsize=7)
    fig.tight_layout()
    save_figure(fig, path)


# ---------------------------------------------------------------------------------------------------------------- CLI


def _load(paths: Sequence[str]) -> List[Dict[str, Any]]:
    docs = []
    for path in paths:
        try:
            with open(path) as handle:
                docs.append(json.load(handle))
        except (OSError, ValueError) as err:
            raise UsageError(f"cannot read {path}: {err}") from None
    return docs


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="action", metavar="ACTION", parser_class=argparse.ArgumentParser)
    sub.required = True
    p = sub.add_parser("calibrate", help="fit alpha and beta per collective to bench collectives JSON files")
    p.add_argument("collectives", nargs="+", metavar="COLL.json")
    p.add_argument("--medium", choices=MEDIA, default=None, help="default: shared inside the emulated link, else switched")
    p.add_argument("--out", required=True, metavar="MODEL.json")
    p = sub.add_parser("validate", help="the model's step times against bench algorithms JSON files, error per point")
    p.add_argument("model", metavar="MODEL.json")
    p.add_argument("measured", nargs="+", metavar="ALG.json")
    p.add_argument("--goal", type=float, default=0.25, help="relative error counted as a hit")
    p.add_argument("--json", default=None, metavar="FILE")
    p.add_argument("--plot", default=None, metavar="PNG")
    p = sub.add_parser("project", help="step time and speed-up over sgd at many ranks and faster links")
    p.add_argument("model", metavar="MODEL.json")
    p.add_argument("--models", type=comma_list(str), default=list(MODELS), metavar="NAME=D@MS,...",
                   help="models: parameters and compute milliseconds per step")
    # dest: ``mpiopt bench --ranks N`` (start the job) shares this namespace.
    p.add_argument("--ranks", dest="world_sizes", type=comma_list(int), default=list(RANKS), metavar="P,P,...", help="world sizes")
    p.add_argument("--rates", type=comma_list(str), default=list(RATES), metavar="RATE,...", help="link rates in tc's units")
    p.add_argument("--algorithms", type=comma_list(str), default=None, metavar="A,B,...",
                   help="algorithms to project (default: every synchronous one, and the asynchronous ones with a server model)")
    p.add_argument("--alpha", type=float, default=None, metavar="SECONDS", help="latency per hop (default: the calibrated)")
    p.add_argument("--json", default=None, metavar="FILE")
    p.add_argument("--plot", default=None, metavar="PNG")


def run(args: argparse.Namespace) -> int:
    """Calibrate, validate or project (no MPI); print Markdown tables."""
    try:
        if args.action == "calibrate":
            model = calibrate(_load(args.collectives), args.medium)
            write_json(args.out, model)
            print(f"## alpha-beta calibration ({model['medium']} medium, link {model['link_bits_per_second']:g} bit/s)\n")
            print(calibration_table(model))
            print(f"\nwrote {args.out}")
            return 0
        (model,) = _load([args.model])
        if args.action == "validate":
            rows = validate(model, _load(args.measured))
            print(validation_table(rows, args.goal))
            hits = sum(abs(r["error"]) <= args.goal for r in rows)
            print(f"\n{hits} of {len(rows)} points within {100 * args.goal:.0f} %")
        else:
            args.algorithms = args.algorithms or projected()
            check_choices("--algorithms", args.algorithms, projected())
            if not args.world_sizes or min(args.world_sizes) < 2:
                raise UsageError(f"--ranks must be >= 2, got {args.world_sizes}")
            rows = project(model, _parse_models(args.models), args.world_sizes, args.rates, args.algorithms, args.alpha)
            print(projection_table(rows))
        if args.json:
            write_json(args.json, {"benchmark": f"model-{args.action}", "rows": rows})
        if args.plot:
            (plot_validation if args.action == "validate" else plot_projection)(rows, args.plot)
            print(f"wrote {args.plot}")
    except ValueError as err:
        if isinstance(err, UsageError):
            raise
        raise UsageError(str(err)) from None
    return 0


def main(argv: Optional[List[str]] = None) -> int:
    return module_main("model", __doc__, add_arguments, run, argv)


if __name__ == "__main__":
    sys.exit(main())
