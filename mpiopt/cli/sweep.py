"""``mpiopt compare --sweep``: short tuning runs per candidate value before the main runs.

Each algorithm trains ``--sweep-steps`` steps per grid point and keeps the
point with the lowest last test loss; every candidate is checked before any
run starts.  How and why: docs/training-internals.md.
"""

from __future__ import annotations

import itertools
import json
import os
from typing import Any, Dict, List, Optional, Sequence, Tuple

from ..training.config import TrainConfig, UsageError
from ..training.flags import _toml_value
from ..training.tuning import lowest, tuning_config, with_point

__all__ = ["Axis", "parse_sweeps", "grid", "with_point", "tuning_config", "validate", "score", "choose", "report"]

#: One axis of the grid: (algorithm or "" for all, key, values).
Axis = Tuple[str, str, List[Any]]


def parse_sweeps(items: Sequence[str]) -> List[Axis]:
    """``KEY=V1,V2`` or ``ALGORITHM.KEY=V1,V2`` strings as grid axes."""
    axes = []
    for item in items:
        key, sep, text = item.partition("=")
        values = [_toml_value(v.strip()) for v in text.split(",") if v.strip()]
        if not sep or not key.strip() or not values:
            raise UsageError(f"--sweep takes KEY=V1,V2,... (or ALGORITHM.KEY=...), got {item!r}")
        target, _, leaf = key.strip().rpartition(".")
        axes.append((target, leaf, values))
    return axes


def grid(axes: Sequence[Axis], algorithm: str) -> List[Dict[str, Any]]:
    """The grid points that apply to ``algorithm``: dicts of key -> value (one empty dict when none applies).

    An axis for ``algorithm`` alone replaces a shared axis of the same key
    (``--sweep lr=... --sweep async_msgd.lr=...``: its own grid, not both).
    """
    own = {key for target, key, _ in axes if target == algorithm}
    mine = [(key, values) for target, key, values in axes if target == algorithm or (target == "" and key not in own)]
    return [dict(zip([k for k, _ in mine], point)) for point in itertools.product(*[v for _, v in mine])]


def validate(config: TrainConfig, algorithms: Sequence[str], axes: Sequence[Axis]) -> None:
    """Raise :class:`UsageError` naming the key and value of the first bad candidate, before any run."""
    from ..training.optimizers import check_replaced_settings

    names = set(algorithms)
    for target, key, values in axes:
        if target and target not in names:
            raise UsageError(f"--sweep {target}.{key}: {target!r} is not one of --algorithms ({', '.join(algorithms)})")
        if key == "lr" and config.lr is not None:
            raise UsageError("give --lr or --sweep lr, not both")
    for algorithm in algorithms:
        for target, key, values in axes:
            if target not in ("", algorithm):
                continue
            for value in values:
                try:
                    candidate = with_point(config, algorithm, {key: value})
                    candidate.validate([algorithm])
                    check_replaced_settings(candidate, [algorithm])
                except UsageError as err:
                    raise UsageError(f"--sweep {key}={value!r}: {err}") from None


def score(path: Optional[str]) -> Optional[float]:
    """The last evaluation's test loss of a metrics file (lower is better); None without one."""
    from ..metrics import read_metrics

    if not path:
        return None
    evals = [e for e in read_metrics(path).evals if e.get("test_loss") is not None]
    return float(evals[-1]["test_loss"]) if evals else None


def choose(candidates: List[Dict[str, Any]]) -> Dict[str, Any]:
    """The candidate with the lowest score (None and NaN last; the first of equals)."""
    return candidates[lowest([c["score"] for c in candidates])]


def report(out: str, chosen: Dict[str, Dict[str, Any]], tried: Dict[str, List[Dict[str, Any]]], steps: int) -> str:
    """Write ``OUT/sweep.json``; return the Markdown section for results.md."""
    with open(os.path.join(out, "sweep.json"), "w") as handle:
        json.dump({"metric": "test_loss (last evaluation; lower is better)", "steps": steps, "chosen": chosen, "candidates": tried}, handle, indent=2)
    lines = [f"## sweep: {steps} steps per candidate, chosen by the last test loss (OUT/sweep.json)", ""]
    for algorithm in (name for name in chosen if name not in tried):
        lines.append(f"- {algorithm}: no --sweep key applies; its settings as given")
    for algorithm, candidates in tried.items():
        shown = "; ".join(
            ", ".join(f"{k}={v}" for k, v in c["values"].items()) + f": {'—' if c['score'] is None else format(c['score'], '.4g')}"
            for c in candidates
        )
        lines.append(f"- {algorithm}: chose " + ", ".join(f"{k}={v}" for k, v in chosen[algorithm].items()) + f" ({shown})")
    return "\n".join(lines) + "\n"
