"""The crossover map from the runs of :mod:`.crossover`: speed-ups over DDP per rate, the model beside them, the verdicts.

Every number is read back from the runs' metrics and ``complete.json`` files, so the report can be written again
from a finished experiment's folder.  The model (docs/scaling.md) predicts a step as the variant's computation
measured at the fastest rate plus the alpha-beta cost of its plan's collectives, fitted to ``bench collectives``
at each rate; the projection moves the 1 Gbit/s fit to other rates and rank counts.
"""

from __future__ import annotations

import json
import os
import statistics
from dataclasses import replace
from typing import Any, Dict, List, Optional, Sequence, Tuple

from ..bench._common import markdown_table, parse_rate
from ..bench.collectives import GLOO_ALLREDUCE
from ..bench.model.calibration import calibrate
from ..bench.model.predict import FABRIC_ALPHA as MODEL_ALPHA
from ..bench.model.predict import RANKS as PROJECTED_RANKS
from ..bench.model.predict import at_rate, comm_seconds, ideal_link, plan
from ..metrics import summarize
from ..metrics.summary import format_bytes, format_loss, format_seconds, format_speedup, format_spread
from ..training.config import DDP
from ..training.ddp import MODELLED_AS
from ._common import new_figure, write_results
from .crossover_job import COMPLETE, GROUPS_CALIBRATION, timed_folder, timed_metrics

__all__ = ["report", "GOAL_SLOW", "GOAL_MODEL", "PROJECTED_RATES", "MODEL_ALPHA"]

#: At the slowest rate the best variant reaches the target at least this many times sooner than DDP (median).
GOAL_SLOW = 5.0
#: The model's step time within this fraction of the measured one, every variant at every rate.
GOAL_MODEL = 0.25
PROJECTED_RATES = ("10gbit", "100gbit")
#: Ranks per island in the projection: a node of 8 GPUs.
PROJECTED_ISLAND = 8
#: The island's own links in the projection beside this machine's shared memory: a node of 8 GPUs on PCIe 4.0 x16, and
#: on NVLink 4 (a GPU's rate each way), as ideal links (:func:`~mpiopt.bench.model.predict.ideal_link`).
PROJECTED_NODE_RATES = ("25gbps", "450gbps")
#: The projection's node priced by this machine's calibration inside one node.
HERE = "here"
#: Island variants reach the target in at most this fraction of their per-rank twins' steps (median of the seeds' ratios).
GOAL_ISLAND_STEPS = 0.9
#: ... and island diloco at the slowest rate at least this many times sooner than per-rank diloco.
GOAL_ISLAND_SPEEDUP = 1.2


def _median(values: Sequence[Optional[float]]) -> Optional[float]:
    present = [v for v in values if v is not None]
    return statistics.median(present) if present else None


def _loss(value: Optional[float]) -> str:
    return format_loss(value, digits=3)


def _step(summary: Dict[str, Any]) -> float:
    """Seconds per training step: everything a step took, data loading included."""
    return sum(summary[f"{key}_seconds"] for key in ("compute", "algorithm", "communication", "waiting", "other")) / summary["steps"]


def _local_step(summary: Dict[str, Any]) -> float:
    """Seconds per step outside MPI (the model's computation): a step less its communication and waiting."""
    return _step(summary) - (summary["communication_seconds"] + summary["waiting_seconds"]) / summary["steps"]


def _comm_plan(variant: Any, d: int, ranks: int, point: Dict[str, Any], groups: Optional[List[int]], island: int) -> List[Any]:
    """The variant's collectives per step (an island variant's with islands of ``island`` ranks); DDP's are those of
    the algorithm it is modelled as."""
    name = MODELLED_AS if variant.algorithm == DDP else variant.algorithm
    hyper = {**variant.hyperparameters, **{k: v for k, v in point.items() if k != "lr"}}
    return plan(name, d, ranks, hyper, groups if name == "lsgd" else None, island if variant.islands else 1)


def _priced(variant: Any, model: Dict[str, Any]) -> Dict[str, Any]:
    """The fit ``variant``'s calls are priced with: DDP's Allreduce at gloo's (``allreduce-gloo``), where it was timed."""
    if variant.algorithm != DDP or GLOO_ALLREDUCE not in model["collectives"]:
        return model
    return dict(model, collectives=dict(model["collectives"], allreduce=model["collectives"][GLOO_ALLREDUCE]))


def _comm(calls: List[Any], P: int, per_node: int, models: Dict[str, Dict[str, Any]], compute: float) -> float:
    """Seconds per step of ``calls``: a call among a node's ranks (a group's, an island's) at shared-memory cost, the
    others on the link."""
    placed = [replace(c, level="node") if c.ranks <= per_node < P else c for c in calls]
    return comm_seconds(placed, models["link"], compute, node=models["node"])


def _load(out: str, s: Dict[str, Any]) -> Dict[str, Dict[str, List[Dict[str, Any]]]]:
    """``runs[rate][label]``: each seed's run, its summary and metrics, in seed order."""
    runs: Dict[str, Dict[str, List[Dict[str, Any]]]] = {}
    for rate in s["rates"]:
        runs[rate] = {}
        for v in s["variants"]:
            runs[rate][v.label] = []
            for seed in s["seeds"]:
                folder = os.path.join(out, timed_folder(rate, v.label, seed))
                with open(os.path.join(folder, COMPLETE)) as handle:
                    done = json.load(handle)
                runs[rate][v.label].append({"seed": seed, "metrics": timed_metrics(folder, done), "summary": done["summary"]})
    return runs


def _rows(runs: Dict[str, Dict[str, List[Dict[str, Any]]]], s: Dict[str, Any], chosen: Dict[str, Dict[str, Any]],
          models: Dict[str, Dict[str, Any]], baseline: str, d: int) -> List[Dict[str, Any]]:
    """One row per (rate, variant): times, speed-ups paired by seed, loss within the budget, step times and the model's."""
    target = s["task"]["target_loss"]
    fastest = max(s["rates"], key=parse_rate)
    compute = {v.label: _median([_local_step(r["summary"]) for r in runs[fastest][v.label]]) for v in s["variants"]}
    if baseline == DDP and MODELLED_AS in compute:  # its time outside MPI is not measured apart (training/ddp.py)
        compute[DDP] = compute[MODELLED_AS]
    rows = []
    for rate in s["rates"]:
        base = {r["seed"]: r["summary"]["time_to_target"] for r in runs[rate][baseline]}
        base_times = [t for t in base.values() if t is not None]
        budget = 0.5 * (statistics.median(base_times) if base_times else _median([r["summary"]["wall_seconds"] for r in runs[rate][baseline]]))
        for v in s["variants"]:
            group = runs[rate][v.label]
            times = [r["summary"]["time_to_target"] for r in group]
            speedups = [base[r["seed"]] / t if t and base.get(r["seed"]) else None for r, t in zip(group, times)]
            at_budget = [summarize(r["metrics"], target_loss=target, budget_seconds=budget)["loss_at_budget"] for r in group]
            measured = _median([_step(r["summary"]) for r in group])
            calls = _comm_plan(v, d, s["ranks"], chosen[v.label], [s["ranks_per_node"]] * s["nodes"], s["ranks_per_node"])
            # A call within a node meets the other node's ranks on this machine's 2 cores: the calibration of every node at once.
            node = models.get("groups", models["node"])
            comm = _comm(calls, s["ranks"], s["ranks_per_node"], {"link": _priced(v, models[rate]), "node": node},
                         compute[v.label])
            predicted = compute[v.label] + comm
            rows.append({
                "rate": rate, "label": v.label, "point": chosen[v.label], "times_to_target": times, "speedups": speedups,
                "speedup": _median(speedups), "reached": sum(t is not None for t in times), "repeats": len(group),
                "budget_seconds": budget, "loss_at_budget": at_budget, "final_loss": [r["summary"]["final_loss"] for r in group],
                "steps_to_target": _median([r["summary"]["steps_to_target"] for r in group]),
                "steps_to_target_seeds": [r["summary"]["steps_to_target"] for r in group],
                "bytes_per_rank": _median([r["summary"]["bytes_sent_per_rank"] for r in group]),
                # what crossed between workers (the link): all of it, but what stayed in an island
                "link_bytes_per_rank": _median([r["summary"]["bytes_sent_per_rank"] - (r["summary"].get("island_bytes_sent_per_rank") or 0)
                                                for r in group]),
                "measured_step": measured, "compute_step": compute[v.label], "predicted_comm": comm, "predicted_step": predicted,
                "model_error": predicted / measured - 1,
            })
    by_key = {(r["rate"], r["label"]): r for r in rows}
    for r in rows:  # the step-time ratio over the baseline, measured and modelled
        b = by_key[(r["rate"], baseline)]
        r["step_speedup_measured"] = b["measured_step"] / r["measured_step"]
        r["step_speedup_predicted"] = b["predicted_step"] / r["predicted_step"]
    return rows


def _projection(s: Dict[str, Any], chosen: Dict[str, Dict[str, Any]], rows: List[Dict[str, Any]], model: Dict[str, Any],
                baseline: str, d: int, node: Dict[str, Any]) -> List[Dict[str, Any]]:
    """Predicted speed-up to the target at 64-1024 ranks: step time (switched network, alpha 10 us) x measured steps to it.

    Island variants in islands of :data:`PROJECTED_ISLAND` ranks at their per-rank twins' computation, their calls
    within an island at ``node``'s cost (``"node": HERE``), and again at each of :data:`PROJECTED_NODE_RATES`."""
    fastest = max(s["rates"], key=parse_rate)
    steps = {r["label"]: r["steps_to_target"] for r in rows if r["rate"] == fastest}
    measured = {r["label"]: r["compute_step"] for r in rows if r["rate"] == fastest}
    # An island's rank computes what its per-rank twin's does: what differs is communication, which the model prices,
    # and this machine's shared cores (docs/crossover.md, "Islands in the projection").
    compute = {v.label: measured.get(v.algorithm if v.islands else v.label, measured[v.label]) for v in s["variants"]}
    nodes = {HERE: node, **{rate: ideal_link(parse_rate(rate), MODEL_ALPHA) for rate in PROJECTED_NODE_RATES}}
    out = []
    for rate in PROJECTED_RATES:
        moved = at_rate(model, parse_rate(rate), "switched", MODEL_ALPHA)
        for P in PROJECTED_RANKS:
            for where, inside in nodes.items():
                seconds = {v.label: compute[v.label] + comm_seconds(_comm_plan(v, d, P, chosen[v.label], None, PROJECTED_ISLAND),
                                                                    moved, compute[v.label], inside) for v in s["variants"]}
                for v in s["variants"]:
                    if steps.get(v.label) and steps.get(baseline) and (where == HERE or v.islands):
                        out.append({"rate": rate, "P": P, "label": v.label, "node": where, "step_seconds": seconds[v.label],
                                    "speedup": seconds[baseline] * steps[baseline] / (seconds[v.label] * steps[v.label])})
    return out


def _node_name(where: str, node: Dict[str, Any]) -> str:
    """``where`` in words: this machine's node at its Allreduce's rate, or a projected node's rate."""
    if where == HERE:
        return f"this machine's ({1e-9 / node['collectives']['allreduce']['beta']:.1f} GB/s)"
    return f"{parse_rate(where) / 8e9:g} GB/s"


def _island_gains(s: Dict[str, Any], projection: List[Dict[str, Any]]) -> Dict[Tuple[str, str, str], List[float]]:
    """``{(island variant, fabric rate, node): [its speed-up over its per-rank twin at each projected rank count]}``."""
    by = {(p["label"], p["rate"], p["P"], p["node"]): p["speedup"] for p in projection}
    gains: Dict[Tuple[str, str, str], List[float]] = {}
    for (label, rate, P, where), speedup in by.items():
        v = next(v for v in s["variants"] if v.label == label)
        twin = by.get((v.algorithm, rate, P, HERE))
        if v.islands and twin:
            gains.setdefault((label, rate, where), []).append(speedup / twin)
    return gains


def _islands_projected(s: Dict[str, Any], projection: List[Dict[str, Any]], node: Dict[str, Any]) -> str:
    """The island variants' projected speed-up over their per-rank twins, by fabric and by the node's links."""
    gains = _island_gains(s, projection)
    wheres = [HERE, *PROJECTED_NODE_RATES]
    labels = list(dict.fromkeys(label for label, _, _ in gains))
    spread = lambda g: f"{min(g):.2f}x" if f"{min(g):.2f}" == f"{max(g):.2f}" else f"{min(g):.2f}-{max(g):.2f}x"  # noqa: E731
    table = [[label, rate, *(spread(gains[(label, rate, w)]) for w in wheres)] for label in labels for rate in PROJECTED_RATES]
    return (f"Islands in the projection (islands of {PROJECTED_ISLAND}, {PROJECTED_RANKS[0]}-{PROJECTED_RANKS[-1]} ranks, the "
            "steps to the loss as measured): each island variant's speed-up to the loss over its per-rank twin, by the "
            "links the island's mean gradient crosses:\n\n"
            + markdown_table(["variant", "fabric", *(f"node: {_node_name(w, node)}" for w in wheres)], table,
                             "ll" + "r" * len(wheres)))


def _figure(s: Dict[str, Any], rows: List[Dict[str, Any]], projection: List[Dict[str, Any]], baseline: str, path: str) -> str:
    """Measured speed-up to the target against the link rate; step-time speed-up, measured and modelled; the projection."""
    fig, (left, middle, right) = new_figure(3, width=5.2, height=4.6)
    rates = sorted(s["rates"], key=parse_rate)
    x = [parse_rate(r) / 1e9 for r in rates]
    colors = {}
    for v in sorted(s["variants"], key=lambda v: v.islands):  # an island variant takes its per-rank twin's colour
        mine = {r["rate"]: r for r in rows if r["label"] == v.label}
        ups = [[u for u in mine[rate]["speedups"] if u is not None] for rate in rates]
        med = [statistics.median(u) if u else float("nan") for u in ups]
        low = [m - min(u) if u else 0 for m, u in zip(med, ups)]
        high = [max(u) - m if u else 0 for m, u in zip(med, ups)]
        marker, width = ("s", 2.5) if v.islands else ("o", 1.5)
        line = left.errorbar(x, med, yerr=[low, high], marker=marker, capsize=3, label=v.label, color=colors.get(v.algorithm) if v.islands else None,
                             linewidth=width)
        colors.setdefault(v.label, line[0].get_color())
        middle.plot(x, [mine[rate]["step_speedup_measured"] for rate in rates], marker + "-", color=colors[v.label], label=v.label,
                    linewidth=width)
        middle.plot(x, [mine[rate]["step_speedup_predicted"] for rate in rates], "x--", color=colors[v.label], linewidth=width)
        for rate, style in zip(PROJECTED_RATES, ("-", ":")):
            pts = [p for p in projection if p["label"] == v.label and p["rate"] == rate and p["node"] == HERE]
            if pts:
                right.plot([p["P"] for p in pts], [p["speedup"] for p in pts], style, color=colors[v.label], linewidth=width,
                           label=f"{v.label}, {rate}" if v.label == baseline or style == "-" else None)
    from matplotlib.ticker import FuncFormatter

    left.set_title(f"(a) measured: to test loss {s['task']['target_loss']:g}, 4 ranks (islands: thick, squares)", fontsize=10)
    middle.set_title("(b) step time: measured (o), model (x, dashed)", fontsize=10)
    right.set_title(f"(c) model to the loss: 10 Gbit/s solid, 100 dotted; islands of {PROJECTED_ISLAND}", fontsize=10)
    for ax in (left, middle):
        ax.set_xscale("log")
        ax.set_xticks(x, [f"{v:g}" for v in x])
        ax.set_xlabel("link rate between the 2 nodes (Gbit/s)")
    right.set_xscale("log", base=2)
    right.set_xticks(list(PROJECTED_RANKS), [str(P) for P in PROJECTED_RANKS])
    right.set_xlabel("ranks (steps to the loss as measured at 4)")
    for ax in (left, middle, right):
        ax.set_yscale("log")
        ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}x"))
        ax.yaxis.set_minor_formatter(FuncFormatter(lambda v, _: f"{v:g}x" if f"{v:.0e}"[0] in "25" else ""))
        ax.set_ylabel(f"speed-up over {baseline}")
        ax.axhline(1.0, color="grey", linewidth=0.8)
        ax.grid(alpha=0.3, which="both")
    left.legend(fontsize=7)
    fig.savefig(path, dpi=100)
    return path


def _verdicts(s: Dict[str, Any], rows: List[Dict[str, Any]], baseline: str, projection: List[Dict[str, Any]],
              node: Dict[str, Any]) -> Dict[str, Dict[str, Any]]:
    """The issue's goals, each with what was measured."""
    slowest, fastest = min(s["rates"], key=parse_rate), max(s["rates"], key=parse_rate)
    best = max((r for r in rows if r["rate"] == slowest and r["label"] != baseline and r["speedup"] is not None),
               key=lambda r: r["speedup"], default=None)
    sgd = next((r for r in rows if r["rate"] == fastest and r["label"] == "sgd"), None)
    worst = max(rows, key=lambda r: abs(r["model_error"]))
    verdicts = {
        f"best at {slowest}: >= {GOAL_SLOW:g}x sooner than {baseline}": {
            "measured": "none reached the target" if best is None else f"{best['label']} {best['speedup']:.2f}x",
            "met": best is not None and best["speedup"] >= GOAL_SLOW},
        f"model step time within {GOAL_MODEL:.0%} of measured, every variant and rate": {
            "measured": f"worst {worst['label']} at {worst['rate']}: {worst['model_error']:+.0%}",
            "met": all(abs(r["model_error"]) <= GOAL_MODEL for r in rows)},
    }
    verdicts.update(_island_verdicts(s, rows))
    verdicts.update(_projected_verdicts(s, projection, node))
    if sgd is not None and baseline != "sgd":
        verdicts[f"sgd at {fastest}: at most 1.0x {baseline}'s time"] = {
            "measured": "not reached" if sgd["speedup"] is None else f"{1 / sgd['speedup']:.2f}x",
            "met": sgd["speedup"] is not None and sgd["speedup"] >= 1.0}
    return verdicts


def _paired(mine: Sequence[Optional[float]], theirs: Sequence[Optional[float]]) -> Optional[float]:
    """The median over seeds of ``mine / theirs`` where both are known."""
    return _median([a / b for a, b in zip(mine, theirs) if a and b])


def _per_exchange(row: Dict[str, Any], steps: int) -> float:
    """Bytes a rank sent across the link per exchange: per step, times the steps between exchanges (1 without a period)."""
    period = next((v for k, v in row["point"].items() if k != "lr"), 1)
    return row["link_bytes_per_rank"] * period / steps


def _island_verdicts(s: Dict[str, Any], rows: List[Dict[str, Any]]) -> Dict[str, Dict[str, Any]]:
    """The islands' goals: 1/G of the bytes across the link per exchange, their step times modelled, fewer steps, and
    island diloco sooner."""
    by = {(r["rate"], r["label"]): r for r in rows}
    islands = [v for v in s["variants"] if v.islands and (s["rates"][0], v.algorithm) in by]
    if not islands:
        return {}
    G, slowest = s["ranks_per_node"], min(s["rates"], key=parse_rate)
    shares = {v.label: max(_per_exchange(by[(rate, v.label)], s["steps"]) / _per_exchange(by[(rate, v.algorithm)], s["steps"])
                           for rate in s["rates"]) for v in islands}
    worst = max(shares, key=shares.get)
    modelled = max((r for r in rows if r["label"] in shares), key=lambda r: abs(r["model_error"]))
    out = {f"across the link an island variant sends at most 1/{G} of its per-rank twin's bytes per exchange": {
        "measured": f"worst {worst}: {shares[worst]:.3f} of its twin's", "met": shares[worst] <= 1 / G + 1e-3},
        f"model step time within {GOAL_MODEL:.0%} of measured, every island variant and rate": {
        "measured": f"worst {modelled['label']} at {modelled['rate']}: {modelled['model_error']:+.0%}",
        "met": abs(modelled["model_error"]) <= GOAL_MODEL}}
    for v in islands:
        if v.algorithm not in ("diloco", "sparseloco"):
            continue
        ratios = {rate: _paired(by[(rate, v.label)]["steps_to_target_seeds"], by[(rate, v.algorithm)]["steps_to_target_seeds"])
                  for rate in s["rates"]}
        known = [x for x in ratios.values() if x is not None]
        out[f"{v.label} reaches the target in <= {GOAL_ISLAND_STEPS:g}x {v.algorithm}'s steps"] = {
            "measured": ", ".join(f"{rate} {x:.2f}x" if x is not None else f"{rate} not reached" for rate, x in ratios.items()),
            "met": bool(known) and len(known) == len(ratios) and max(known) <= GOAL_ISLAND_STEPS}
        if v.algorithm == "diloco":
            faster = _paired(by[(slowest, v.algorithm)]["times_to_target"], by[(slowest, v.label)]["times_to_target"])
            out[f"{v.label} at {slowest}: >= {GOAL_ISLAND_SPEEDUP:g}x sooner than {v.algorithm}"] = {
                "measured": "not reached" if faster is None else f"{faster:.2f}x",
                "met": faster is not None and faster >= GOAL_ISLAND_SPEEDUP}
    return out


def _projected_verdicts(s: Dict[str, Any], projection: List[Dict[str, Any]], node: Dict[str, Any]) -> Dict[str, Dict[str, Any]]:
    """Where the model places island diloco's gain: at islands of 8 and 64-1024 ranks, on both fabrics, on a GPU node's
    links (every rate of :data:`PROJECTED_NODE_RATES`); this machine's node is shown beside them."""
    gains = _island_gains(s, projection)
    out = {}
    for label in dict.fromkeys(label for label, _, _ in gains):
        twin = next(v.algorithm for v in s["variants"] if v.label == label)
        if twin != "diloco":
            continue
        low = {w: min(min(gains[(label, rate, w)]) for rate in PROJECTED_RATES) for w in (HERE, *PROJECTED_NODE_RATES)}
        out[f"{label} in the projection (islands of {PROJECTED_ISLAND}, {PROJECTED_RANKS[0]}-{PROJECTED_RANKS[-1]} ranks, "
            f"{' and '.join(PROJECTED_RATES)}) on a node of {' or '.join(_node_name(w, node) for w in PROJECTED_NODE_RATES)}: "
            f">= {GOAL_ISLAND_SPEEDUP:g}x sooner than {twin}"] = {
            "measured": ", ".join(f"{_node_name(w, node)} at least {x:.2f}x" for w, x in low.items()),
            "met": min(low[w] for w in PROJECTED_NODE_RATES) >= GOAL_ISLAND_SPEEDUP}
    return out


def _tables(s: Dict[str, Any], rows: List[Dict[str, Any]], baseline: str) -> str:
    """The pick per rate, then one table per rate."""
    parts = []
    picks = []
    for rate in sorted(s["rates"], key=parse_rate):
        ranked = sorted((r for r in rows if r["rate"] == rate and r["label"] != baseline and r["speedup"] is not None),
                        key=lambda r: -r["speedup"])
        text = lambda r: f"`{r['label']}` {r['speedup']:.2f}x ({r['reached']} of {r['repeats']})"  # noqa: E731
        picks.append([rate, text(ranked[0]) if ranked else "—", ", ".join(text(r) for r in ranked[1:3]) or "—"])
    parts.append(markdown_table(["link", f"pick (median speed-up over {baseline} to the target)", "next"], picks, "lll"))
    for rate in s["rates"]:
        mine = [r for r in rows if r["rate"] == rate]
        parts.append(f"### {rate}: budget {mine[0]['budget_seconds']:.1f} s (half {baseline}'s median time to the target)")
        parts.append(markdown_table(
            ["variant", "tuned", "time to target", "speed-up", "steps to target", "loss at budget", "final loss", "sent per rank",
             "of it across the link", "step (measured)", "step (model)", "model error"],
            [[r["label"], ", ".join(f"{k} {v:g}" for k, v in r["point"].items()),
              format_spread(r["times_to_target"], format_seconds), format_spread(r["speedups"], format_speedup),
              format_spread(r["steps_to_target_seeds"], lambda v: "—" if v is None else f"{v:g}"),
              format_spread(r["loss_at_budget"], _loss), format_spread(r["final_loss"], _loss), format_bytes(r["bytes_per_rank"]),
              format_bytes(r["link_bytes_per_rank"]),
              f"{1000 * r['measured_step']:.1f} ms", f"{1000 * r['predicted_step']:.1f} ms", f"{r['model_error']:+.0%}"] for r in mine],
            "llrrrrrrrrrr"))
    return "\n\n".join(parts)


def _bracketed(tried: Sequence[float], value: float) -> str:
    """Whether ``value`` lies strictly inside the values ``tried``, and why not."""
    if len(tried) < 2:
        return "one value"
    return "yes" if tried[0] < value < tried[-1] else "no (the grid stopped growing)"


def _tuning(out: str, chosen: Dict[str, Dict[str, Any]]) -> str:
    """The tuning's candidates per variant, the choice, and whether the grid brackets its learning rate."""
    with open(os.path.join(out, "tuning.json")) as handle:
        tuning = json.load(handle)
    rows = []
    for label, candidates in tuning["candidates"].items():
        rates = sorted({c["point"]["lr"] for c in candidates})
        periods = sorted({value for c in candidates for key, value in c["point"].items() if key != "lr"})
        period = next((v for k, v in chosen[label].items() if k != "lr"), None)
        rows.append([label, ", ".join(f"{r:g}" for r in rates), ", ".join(map(str, periods)) or "—",
                     ", ".join(f"{k} {v:g}" for k, v in chosen[label].items()),
                     _bracketed(rates, chosen[label]["lr"]), "—" if period is None else _bracketed(periods, period)])
    return (f"Tuning ({tuning['steps']} steps per candidate at {tuning['rate']}, seed 0; the lowest last test loss wins, "
            f"or the longest period at its rate within {tuning['tie']:.0%} of it; a winning edge grows the grid (rates by 3x, periods by 2x), "
            "twice at most):\n\n"
            + markdown_table(["variant", "learning rates tried", "periods tried", "chosen", "rate bracketed", "period bracketed"],
                             rows, "llllll"))


def _load_samples(out: str) -> Dict[str, Any]:
    path = os.path.join(out, "load.jsonl")
    loads = [json.loads(line)["load"] for line in open(path)] if os.path.exists(path) else []
    rounded = lambda v: None if v is None else round(v, 1)  # noqa: E731
    return {"samples": len(loads), "median": rounded(_median(loads)), "min": rounded(min(loads, default=None)),
            "max": rounded(max(loads, default=None))}


def report(out: str, s: Dict[str, Any], chosen: Dict[str, Dict[str, Any]], quick: bool) -> Dict[str, Any]:
    """Read every run, fit the model at each rate, write the figure and results; return the results document."""
    s = dict(s, ranks=4, nodes=2, ranks_per_node=2)
    labels = [v.label for v in s["variants"]]
    baseline = DDP if DDP in labels else labels[0]
    runs = _load(out, s)
    d = int(runs[s["rates"][0]][baseline][0]["metrics"].header["parameters"])
    models, buckets = {}, {}
    files = [(rate, os.path.join(rate, "collectives.json")) for rate in s["rates"]] + [("node", "node-collectives.json")]
    files += [("groups", GROUPS_CALIBRATION)] if os.path.exists(os.path.join(out, GROUPS_CALIBRATION)) else []
    for rate, path in files:
        with open(os.path.join(out, path)) as handle:
            document = json.load(handle)
        models[rate] = calibrate([document], medium="switched")
        if rate in s["rates"]:
            buckets[rate] = document.get("shaping", {}).get("burst_bytes")
    rows = _rows(runs, s, chosen, models, baseline, d)
    reference = "1gbit" if "1gbit" in models else s["rates"][0]
    projection = _projection(s, chosen, rows, models[reference], baseline, d, models["node"])
    figure = _figure(s, rows, projection, baseline, os.path.join(out, "results-crossover-map.png"))
    verdicts = _verdicts(s, rows, baseline, projection, models["node"])
    load = _load_samples(out)
    goals = markdown_table(["goal", "measured", "met"], [[k, v["measured"], "yes" if v["met"] else "no"] for k, v in verdicts.items()], "lll")
    task = s["task"]
    markdown = (
        f"GPT text task (n_layer {task['n_layer']}, n_embd {task['n_embd']}, block {task['block_size']}; {d:,} parameters), "
        f"batch {task['batch_size']} per rank, {s['steps']} steps, inner AdamW; 2 emulated nodes of 2 ranks; "
        f"{len(s['seeds'])} seed(s); target test loss {task['target_loss']:g}. The link's token bucket: "
        + ", ".join(f"{rate} {format_bytes(b) if b else 'the default'}" for rate, b in buckets.items()) + ". Load average during the runs: median "
        f"{load['median']} ({load['min']}-{load['max']}, {load['samples']} samples of the 1-minute load, every 20 s).\n\n"
        f"{_tables(s, rows, baseline)}\n\n{_tuning(out, chosen)}\n\n{_islands_projected(s, projection, models['node'])}"
        f"\n\nGoals:\n\n{goals}"
    )
    settings = {"rates": list(s["rates"]), "seeds": list(s["seeds"]), "steps": s["steps"], "tuning_steps": s["tuning_steps"],
                "task": task, "variants": [v._asdict() for v in s["variants"]], "chosen": chosen, "parameters": d,
                "baseline": baseline, "burst_bytes": buckets, "model_alpha_projection": MODEL_ALPHA, "projection_calibration": reference, "load": load}
    numbers = {"rows": rows, "projection": projection, "goals": verdicts,
               "calibration": {rate: {op: {k: c[k] for k in ("alpha", "beta")} for op, c in m["collectives"].items()} for rate, m in models.items()}}
    return write_results(out, "crossover", quick, settings, numbers, markdown, [figure])
