"""One line per run: accuracy reached (a language model's loss, bits per byte and perplexity), time and bytes it took, where the time went (the five fractions add up to 1).

Fields and the time split: docs/internals-metrics.md, "Summaries".
"""

from __future__ import annotations

import math
import statistics
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

from .records import Run

__all__ = ["summarize", "world_over_time", "add_speedups", "markdown_table", "repeats_table", "format_spread", "format_bytes", "format_seconds",
           "format_speedup", "format_loss", "SPLITS"]

#: (summary key prefix, step record field, table column) of the time split.
SPLITS = (
    ("compute", "compute_seconds", "compute"),
    ("algorithm", "algo_seconds", "algorithm"),
    ("communication", "comm_seconds", "comm"),
    ("waiting", "wait_seconds", "wait"),
)
_MISSING = "—"


def summarize(run: Run, *, target_accuracy: Optional[float] = None, target_loss: Optional[float] = None,
              budget_seconds: Optional[float] = None) -> Dict[str, Any]:
    """The figures that compare runs, as a flat dict (fields: docs/internals-metrics.md).

    ``target_accuracy`` or ``target_loss`` (not both) sets where time and bytes to target are measured;
    ``budget_seconds`` adds the test loss reached within that wall-clock budget.
    """
    if target_accuracy is not None and not (0.0 <= target_accuracy <= 1.0):
        raise ValueError(f"target_accuracy must be a fraction in [0, 1], got {target_accuracy!r}")
    if target_loss is not None and not (math.isfinite(target_loss) and target_loss > 0):
        raise ValueError(f"target_loss must be a finite loss > 0, got {target_loss!r}")
    if budget_seconds is not None and not (math.isfinite(budget_seconds) and budget_seconds > 0):
        raise ValueError(f"budget_seconds must be a finite number of seconds > 0, got {budget_seconds!r}")
    if target_accuracy is not None and target_loss is not None:
        raise ValueError(f"give target_accuracy ({target_accuracy!r}) or target_loss ({target_loss!r}), not both")
    latest = [r for r in (run.end, run.steps[-1] if run.steps else None, run.evals[-1] if run.evals else None) if r]
    accuracies = [e["test_accuracy"] for e in run.evals if e.get("test_accuracy") is not None]
    losses = [e["test_loss"] for e in run.evals if e.get("test_loss") is not None]
    bits = [e for e in run.evals if e.get("bits_per_byte") is not None]  # a language model's evaluations
    reached = None
    if target_accuracy is not None:
        reached = next((e for e in run.evals if (e.get("test_accuracy") or 0.0) >= target_accuracy), None)
    elif target_loss is not None:
        reached = next((e for e in run.evals if e.get("test_loss") is not None and e["test_loss"] <= target_loss), None)
    summary: Dict[str, Any] = {
        "algorithm": run.algorithm,
        "seed": (run.header.get("config") or {}).get("seed"),
        "steps": max((int(r["step"]) for r in latest), default=0),
        "wall_seconds": max((float(r["wall_seconds"]) for r in latest), default=0.0),
        "final_accuracy": accuracies[-1] if accuracies else None,
        "best_accuracy": max(accuracies) if accuracies else None,
        "final_loss": losses[-1] if losses else None,
        "best_loss": min(losses) if losses else None,
        "language_model": bool(bits),
        "final_bits_per_byte": bits[-1]["bits_per_byte"] if bits else None,
        "final_perplexity": math.exp(min(bits[-1]["test_loss"], 700.0)) if bits else None,
        "target_accuracy": target_accuracy,
        "target_loss": target_loss,
        "time_to_target": None if reached is None else reached["wall_seconds"],
        "bytes_to_target": None if reached is None else reached["bytes_sent_total"],
        "steps_to_target": None if reached is None else reached["step"],
        "bytes_sent_per_rank": _bytes_sent(run),
        "island_bytes_sent_per_rank": _bytes_sent(run, "island_bytes_sent"),
        "budget_seconds": budget_seconds,
        "loss_at_budget": None,
    }
    if budget_seconds is not None:
        within = [e["test_loss"] for e in run.evals if e.get("test_loss") is not None and e["wall_seconds"] <= budget_seconds]
        summary["loss_at_budget"] = within[-1] if within else None
    step_total = sum(s["step_seconds"] for s in run.steps)
    parts = {key: sum(s[field] for s in run.steps) for key, field, _ in SPLITS}
    parts["other"] = max(0.0, step_total - sum(parts.values()))
    for key, seconds in parts.items():
        summary[f"{key}_seconds"] = seconds
        summary[f"{key}_fraction"] = seconds / step_total if step_total > 0 else None
    return summary


def world_over_time(run: Run) -> str:
    """The run's world size over time, e.g. ``"4 ranks; 3 from step 7 (lost rank 2); 4 from step 11 (resumed)"``, from
    its header, its lost ranks and its resumes; "" where the size never changed."""
    events = []
    for record in run.lost:  # from the step redone, or the next where the step the rank was lost after stood
        why = named_ranks("lost rank", record["lost"])
        if record.get("left"):
            why += f"; {named_ranks('rank', record['left'])} left with {_their_islands(record)}"
        events.append((record["step"] + (0 if record.get("redone", True) else 1), record["world_size"], why))
    events += [(r.get("resumed_after_step", 0) + 1, r["world_size"], "resumed") for r in run.resumes]
    size = run.header["world_size"]
    text = f"{size} ranks"
    for step, new, why in sorted(events, key=lambda e: e[0]):
        if new != size:
            text, size = f"{text}; {new} from step {step} ({why})", new
    return text if ";" in text else ""


def named_ranks(what: str, ranks: Sequence[int]) -> str:
    """``ranks`` after ``what``, plural where there are several: ``"lost ranks 1, 3"``."""
    return f"{what}{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))}"


def _their_islands(lost: Dict[str, Any]) -> str:
    """Whose island the ranks that left with a loss (a ``"lost"`` record) left with."""
    if len(lost["left"]) == 1:
        return "its island"
    return "their island" if len(lost["lost"]) == 1 else "their islands"


def add_speedups(summaries: Sequence[Dict[str, Any]], baseline: str) -> None:
    """Set each summary's ``speedup``: ``baseline``'s time to target over its own, paired by seed (None if either missed).

    Raises ValueError if no summary is ``baseline``'s.
    """
    reference = {s["seed"]: s["time_to_target"] for s in summaries if s["algorithm"] == baseline}
    if not reference:
        raise ValueError(f"no run of the baseline {baseline!r} among {sorted({s['algorithm'] for s in summaries})}")
    for s in summaries:
        mine, theirs = s["time_to_target"], reference.get(s["seed"])
        s["speedup_over"] = baseline
        s["speedup"] = theirs / mine if mine and theirs else None


def _bytes_sent(run: Run, field: str = "bytes_sent") -> int:
    """Rank 0's bytes sent (``field``: those within its island): the end record's total, else the last evaluation's,
    else the steps' sum (0 in records from before islands)."""
    for record in (run.end, run.evals[-1] if run.evals else None):
        if record is not None:
            return int(record.get(f"{field}_total", 0))
    return sum(int(s.get(field, 0)) for s in run.steps)


def format_bytes(n: Optional[float]) -> str:
    """Bytes with a decimal unit and three significant digits ("1.50 MB"); "—" for None."""
    if n is None:
        return _MISSING
    if n < 0 or not math.isfinite(n):
        raise ValueError(f"n must be a finite number of bytes >= 0, got {n!r}")
    for unit in ("B", "kB", "MB", "GB", "TB"):
        if n < 999.5 or unit == "TB":
            break
        n /= 1000.0
    return f"{n:.0f} B" if unit == "B" else _three_digits(n, unit)


def _three_digits(value: float, unit: str) -> str:
    """``value`` (at least 1) with three significant digits, or as an integer from 100 on."""
    decimals = 0 if value >= 99.95 else 1 if value >= 9.995 else 2
    return f"{value:.{decimals}f} {unit}"


def format_seconds(seconds: Optional[float]) -> str:
    """Seconds with three significant digits ("0.123 s", "12.3 s", "1234 s"); "—" for None."""
    if seconds is None:
        return _MISSING
    return f"{seconds:.3g} s" if seconds < 0.9995 else _three_digits(seconds, "s")


def _percent(fraction: Optional[float]) -> str:
    return _MISSING if fraction is None else f"{100.0 * fraction:.1f} %"


def format_speedup(value: Optional[float]) -> str:
    """A speed-up as "1.25x"; "—" for None."""
    return _MISSING if value is None else f"{value:.2f}x"


def format_loss(value: Optional[float], digits: int = 4) -> str:
    """A loss with ``digits`` decimals; "—" for None."""
    return _MISSING if value is None else f"{value:.{digits}f}"


def _by_loss(summaries: Sequence[Dict[str, Any]]) -> bool:
    """Whether the summaries measure to a test loss (their tables then show the test loss too)."""
    return any(s.get("target_loss") is not None for s in summaries)


def _perplexity(value: Optional[float]) -> str:
    return _MISSING if value is None else f"{value:.2f}"


def _quality(summaries: Sequence[Dict[str, Any]]) -> List[Tuple[str, str, Callable[[Optional[float]], str]]]:
    """(column, summary key, format) of the columns of what a run reached.

    A language model's: its test loss, in bits per byte and as a perplexity (its next-byte accuracy says little).
    """
    loss = [("final loss", "final_loss", format_loss), ("best loss", "best_loss", format_loss)]
    if summaries and all(s.get("language_model") for s in summaries):
        return loss + [("bits per byte", "final_bits_per_byte", format_loss), ("perplexity", "final_perplexity", _perplexity)]
    return [("final accuracy", "final_accuracy", _percent), ("best accuracy", "best_accuracy", _percent)] + (loss if _by_loss(summaries) else [])


def _header(summaries: Sequence[Dict[str, Any]], *, repeats: bool) -> List[str]:
    """The columns of :func:`markdown_table` (``repeats``: of :func:`repeats_table`); the target named where all share one."""
    quality = [column for column, _, _ in _quality(summaries)]
    if _by_loss(summaries):
        targets = {s["target_loss"] for s in summaries if s.get("target_loss") is not None}
        target = f" loss {targets.pop():g}" if len(targets) == 1 else ""
    else:
        targets = {s["target_accuracy"] for s in summaries if s["target_accuracy"] is not None}
        target = f" {_percent(targets.pop())}" if len(targets) == 1 else ""
    budgets = {s["budget_seconds"] for s in summaries if s.get("budget_seconds") is not None}
    budget = [f"loss at {budgets.pop():g} s" if len(budgets) == 1 else "loss at budget"] if budgets else []
    return (["algorithm"] + (["repeats"] if repeats else []) + quality + budget
            + ["steps", "wall time", f"time to{target}"]
            + [f"speed-up over {b}" for b in {s["speedup_over"] for s in summaries if s.get("speedup_over")}]
            + [f"sent to{target}", "sent per rank"] + (["of it within islands"] if _islands(summaries) else [])
            + [column for _, _, column in SPLITS])


def _islands(summaries: Sequence[Dict[str, Any]]) -> bool:
    """Whether some run had islands (its tables then show the bytes that stayed within them)."""
    return any(s.get("island_bytes_sent_per_rank") for s in summaries)


def markdown_table(summaries: Sequence[Dict[str, Any]]) -> str:
    """A Markdown table of :func:`summarize` results, one row per run; "—" where a run never reached the target."""
    quality = _quality(summaries)
    budgeted = any(s.get("budget_seconds") is not None for s in summaries)
    faster = any(s.get("speedup_over") for s in summaries)
    header = _header(summaries, repeats=False)
    lines = ["| " + " | ".join(header) + " |", "|---|" + "---:|" * (len(header) - 1)]
    for s in summaries:
        row: List[str] = [str(s["algorithm"])] + [form(s.get(key)) for _, key, form in quality]
        if budgeted:
            row.append(format_loss(s["loss_at_budget"]))
        row += [
            str(s["steps"]),
            format_seconds(s["wall_seconds"]),
            format_seconds(s["time_to_target"]),
        ] + ([format_speedup(s.get("speedup"))] if faster else []) + [
            format_bytes(s["bytes_to_target"]),
            format_bytes(s["bytes_sent_per_rank"]),
        ] + ([format_bytes(s.get("island_bytes_sent_per_rank") or 0)] if _islands(summaries) else [])
        for key, _, _ in SPLITS:
            seconds, fraction = s[f"{key}_seconds"], s[f"{key}_fraction"]
            row.append(format_seconds(seconds) + ("" if fraction is None else f" ({100.0 * fraction:.0f} %)"))
        lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines)


def format_spread(values: Sequence[Optional[float]], formatter: Callable[[Optional[float]], str]) -> str:
    """The median of ``values`` with their range, "12.3 s (11.8-13.1)"; None values counted, "in 2 of 3"; "—" if all None."""
    present = sorted(float(v) for v in values if v is not None)
    if not present:
        return _MISSING
    text = formatter(statistics.median(present))
    low, high = formatter(present[0]), formatter(present[-1])
    unit = text.partition(" ")[2]
    if unit and low.endswith(" " + unit) and high.endswith(" " + unit):
        low, high = low[: -len(unit) - 1], high[: -len(unit) - 1]
    if len(present) > 1:
        text += f" ({low}-{high})"
    if len(present) < len(values):
        text += f" in {len(present)} of {len(values)}"
    return text


def repeats_table(groups: Sequence[Sequence[Dict[str, Any]]]) -> str:
    """A Markdown table of repeated runs, one row per algorithm: each column's median over its repeats and their range."""
    every = [s for g in groups for s in g]
    quality = _quality(every)
    budgeted = any(s.get("budget_seconds") is not None for s in every)
    faster = any(s.get("speedup_over") for s in every)
    header = _header(every, repeats=True)
    lines = ["| " + " | ".join(header) + " |", "|---|" + "---:|" * (len(header) - 1)]
    steps = lambda v: _MISSING if v is None else f"{v:g}"  # noqa: E731
    for group in groups:
        column = lambda key: [s[key] for s in group]  # noqa: E731
        row: List[str] = [str(group[0]["algorithm"]), str(len(group))]
        row += [format_spread([s.get(key) for s in group], form) for _, key, form in quality]
        if budgeted:
            row.append(format_spread(column("loss_at_budget"), format_loss))
        row += [
            format_spread(column("steps"), steps),
            format_spread(column("wall_seconds"), format_seconds),
            format_spread(column("time_to_target"), format_seconds),
        ] + ([format_spread([s.get("speedup") for s in group], format_speedup)] if faster else []) + [
            format_spread(column("bytes_to_target"), format_bytes),
            format_spread(column("bytes_sent_per_rank"), format_bytes),
        ] + ([format_spread([s.get("island_bytes_sent_per_rank") or 0 for s in group], format_bytes)] if _islands(every) else [])
        for key, _, _ in SPLITS:
            fractions = [f for f in column(f"{key}_fraction") if f is not None]
            share = f", {100.0 * statistics.median(fractions):.0f} %" if fractions else ""
            row.append(format_spread(column(f"{key}_seconds"), format_seconds) + share)
        lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines)
