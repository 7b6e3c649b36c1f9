"""Resuming on another number of ranks: each algorithm's rule for turning P old ranks' states into M new ones.

:func:`resize_states` turns the states of a checkpoint of ``P`` ranks into ``M``, entry by entry, by the rules each class
declares beside its state (``resize_rules``).  Notes: docs/algorithm-notes.md.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Tuple

import numpy as np

from .state import hyperparameter_lines
from .registry import algorithm_class

__all__ = [
    "resize_states", "hyperparameter_differences", "source_rank", "rules_of", "ResizeError",
    "COPY", "FOLLOW", "MEAN", "RESCALE", "ZERO", "NO_HISTORY", "NO_LEADER", "absent_before",
]


class ResizeError(ValueError):
    """A state that cannot be moved to another world size (no rule, or states that do not fit one)."""


def source_rank(new_rank: int, old_size: int) -> int:
    """The old rank whose parameters (and per-worker state) new rank ``new_rank`` takes: ``new_rank % old_size``."""
    return new_rank % old_size


@dataclass(frozen=True)
class Rule:
    """How one state entry moves: ``apply(old values, new rank, new size)`` and what the warning calls it."""

    apply: Callable[[Sequence[Any], int, int], Any]
    kind: str  # "copied", "redistributed" or "reset"
    how: str
    optional: bool = False  # states saved before the entry existed lack it: None there
    #: What a survivor of a lost rank does with its own entry: keep it (``apply`` on it alone), take the survivors'
    #: ``"mean"``, or ``"rescale"`` a sum over the old workers to the survivors (:mod:`.survival`).
    survivors: str = "own"


def absent_before(rule: Rule) -> Rule:
    """``rule`` for an entry that states saved before it existed lack (it is None in them: the codecs' residuals)."""
    return replace(rule, optional=True)


def _copied(values: Sequence[Any], rank: int, size: int) -> Any:
    return values[0]


def _follows(values: Sequence[Any], rank: int, size: int) -> Any:
    return values[source_rank(rank, len(values))]


def _mean(values: Sequence[Any], rank: int, size: int) -> Any:
    if values[0] is None:
        return None
    total = np.sum([np.asarray(v, dtype=np.float64) for v in values], axis=0)  # float64: the mean of float32 rounds once
    return (total / len(values)).astype(np.asarray(values[0]).dtype)


def _rescaled_sum(values: Sequence[Any], rank: int, size: int) -> Any:
    if values[0] is None:
        return None
    value = np.asarray(values[0])
    return (value.astype(np.float64) * (size / len(values))).astype(value.dtype)


def _reset_to(value: Any) -> Callable[[Sequence[Any], int, int], Any]:
    """A rule body that resets arrays to zeros of their shape and dtype and scalars to ``value``."""

    def reset(values: Sequence[Any], rank: int, size: int) -> Any:
        old = values[0]
        return np.zeros_like(old) if isinstance(old, np.ndarray) else value

    return reset


COPY = Rule(_copied, "copied", "copied (the same on every {unit})")
FOLLOW = Rule(_follows, "redistributed", "new {unit} r takes old {unit} r % {old}'s")
MEAN = Rule(_mean, "redistributed", "the mean over the old {unit}s on every new {unit}", survivors="mean")
RESCALE = Rule(_rescaled_sum, "redistributed", "the sum over the old {unit}s rescaled to the new number of them", survivors="rescale")
ZERO = Rule(_reset_to(None), "reset", "reset to zeros")
NO_HISTORY = Rule(_reset_to(False), "reset", "reset (the first step ranks as Top-k)")
NO_LEADER = Rule(_reset_to(-1), "reset", "reset to -1 (they named ranks of the old world)")


def rules_of(name: str) -> Dict[str, Rule]:
    """The resize rule of each state entry of algorithm ``name`` (its class's ``resize_rules``)."""
    cls = algorithm_class(name)
    if cls.resize_rules is None:
        raise ResizeError(f"{name!r} cannot resume on another number of ranks: {cls.resize_refusal}")
    return dict(cls.resize_rules)


def hyperparameter_differences(
    name: str, saved: Mapping[str, Any], here: Mapping[str, Any], old_size: int, new_size: int
) -> List[str]:
    """``"key: saved X, here Y"`` for each hyperparameter that forbids resuming ``saved`` as ``here``.

    At the same world size every hyperparameter must match.  At another,
    those the class's ``resize_skip`` names may differ.
    """
    cls = algorithm_class(name)
    skip = cls.resize_skip(saved, here, old_size, new_size) if old_size != new_size else ()
    return hyperparameter_lines(saved, here, skip=(*skip, *cls.schema.knobs()))


def resize_states(
    name: str,
    states: Sequence[Mapping[str, Any]],
    new_size: int,
    hyperparameters: Mapping[str, Any],
    *,
    ranks: Optional[Sequence[int]] = None,
    unit: str = "rank",
) -> Tuple[List[Dict[str, Any]], List[str]]:
    """Turn the ``state_dict`` of every old rank (in rank order) into one state per rank of a world of ``new_size``.

    ``hyperparameters`` (the new run's, checked beforehand with
    :func:`hyperparameter_differences`) go into each new state; ``ranks`` are
    the new ranks to build (default all).  Returns the states and one note per
    entry redistributed or reset (for the caller's warning), in which a
    state's holder is a ``unit`` ("rank"; islands: "worker", one state each).  ResizeError for
    an algorithm without rules, foreign states, or old ranks at different steps.
    """
    rules = rules_of(name)
    if isinstance(new_size, bool) or not isinstance(new_size, (int, np.integer)) or new_size < 1:
        raise ValueError(f"new_size must be an integer >= 1, got {new_size!r}")
    if ranks is not None and any(not 0 <= r < new_size for r in ranks):
        raise ValueError(f"ranks must lie in [0, {new_size}), got {list(ranks)!r}")
    if not states:
        raise ResizeError(f"{name}: no old states to resize")
    for rank, state in enumerate(states):
        if state.get("algorithm") != name:
            raise ResizeError(f"old rank {rank}'s state is for algorithm {state.get('algorithm')!r}, not {name!r}")
        entries = set(state.get("arrays", {})) | set(state.get("scalars", {}))
        required = {key for key, rule in rules.items() if not rule.optional}
        if not required <= entries <= set(rules):
            optional = sorted(set(rules) - required)
            raise ResizeError(
                f"{name}: old rank {rank}'s state has entries {sorted(entries)}; the resize rule knows {sorted(required)}"
                + (f" (and, optionally, {optional})" if optional else "")
            )
    steps = [int(state["steps"]) for state in states]
    if len(set(steps)) > 1:
        raise ResizeError(f"{name}: the old ranks are at different steps {steps}")

    def moved(section: str, rank: int) -> Dict[str, Any]:
        keys = sorted(states[0][section])
        out = {key: rules[key].apply([s[section][key] for s in states], rank, int(new_size)) for key in keys}
        if section == "arrays":  # optional arrays a state lacks are None (an optional scalar would need a value)
            out.update({key: None for key, rule in rules.items() if rule.optional and key not in out})
        return out

    resized = [
        {
            "algorithm": name,
            "world_size": int(new_size),
            "steps": steps[0],
            "lr": states[0]["lr"],
            "hyperparameters": dict(hyperparameters),
            "arrays": moved("arrays", rank),
            "scalars": moved("scalars", rank),
        }
        for rank in (range(int(new_size)) if ranks is None else ranks)
    ]
    present = {key for section in ("arrays", "scalars") for key, value in states[0][section].items() if value is not None}
    notes = [
        f"{key}: {rule.kind}, {rule.how.format(old=len(states), unit=unit)}"
        for key, rule in sorted(rules.items()) if rule.kind != "copied" and key in present
    ]
    return resized, notes
