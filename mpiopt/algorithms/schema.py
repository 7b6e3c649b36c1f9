"""Hyperparameter schemas: what an algorithm takes, its defaults, ranges, and which values are per parameter group.

One :class:`Schema` per algorithm validates its constructor, ``--hp``, TOML tables and checkpoints, and writes the
help.  Execution knobs (``execution=True``) change how, never what: neither agreed nor a reason to refuse a resume.
Notes: docs/algorithm-notes.md.
"""

from __future__ import annotations

import difflib
import numbers
from dataclasses import dataclass, replace
from typing import Any, Callable, Dict, Iterable, Iterator, List, Mapping, Optional, Sequence, Tuple

import numpy as np

__all__ = [
    "Hyperparameter", "Schema", "check_positive", "check_range", "check_choice", "check_bool",
    "positive", "in_range", "choice", "boolean", "optional", "count_or_auto",
]

Check = Callable[[str, Any], Any]


def check_positive(name: str, value: Any, *, allow_zero: bool = False, integer: bool = False) -> Any:
    """Validate a number (> 0, or >= 0 with ``allow_zero``); the error names ``name`` and ``value``."""
    kind = numbers.Integral if integer else numbers.Real
    if isinstance(value, bool) or not isinstance(value, kind) or (not integer and not np.isfinite(value)):
        want = "an integer" if integer else "a finite number"
        raise TypeError(f"{name} must be {want}, got {value!r}")
    if value < 0 or (value == 0 and not allow_zero):
        raise ValueError(f"{name} must be {'>= 0' if allow_zero else '> 0'}, got {value!r}")
    return int(value) if integer else value


def check_range(name: str, value: Any, low: float, high: float, *, high_open: bool = False) -> float:
    """Validate ``low <= value <= high`` (``< high`` with ``high_open``)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not np.isfinite(value):
        raise TypeError(f"{name} must be a finite number, got {value!r}")
    if not (low <= value <= high) or (high_open and value == high):
        raise ValueError(f"{name} must be in [{low}, {high}{')' if high_open else ']'}, got {value!r}")
    return float(value)


def check_choice(name: str, value: Any, choices: Tuple[str, ...]) -> str:
    """Validate that ``value`` is one of ``choices``."""
    if value not in choices:
        raise ValueError(f"{name} must be one of {', '.join(map(repr, choices))}; got {value!r}")
    return value


def check_bool(name: str, value: Any) -> bool:
    """Validate a bool (not a number that would pass as one)."""
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be a bool, got {value!r}")
    return value


# -- validators for schema entries: each a function (name, value) -> checked value ----------------------------------
def positive(*, allow_zero: bool = False, integer: bool = False) -> Check:
    """A number > 0 (>= 0 with ``allow_zero``): an int with ``integer``, else a float."""
    convert = int if integer else float
    return lambda name, value: convert(check_positive(name, value, allow_zero=allow_zero, integer=integer))


def in_range(low: float, high: float, *, high_open: bool = False) -> Check:
    """A finite number in ``[low, high]`` (``[low, high)`` with ``high_open``)."""
    return lambda name, value: check_range(name, value, low, high, high_open=high_open)


def choice(*choices: str) -> Check:
    """One of ``choices``."""
    return lambda name, value: check_choice(name, value, tuple(choices))


def boolean() -> Check:
    """A bool."""
    return check_bool


def optional(check: Check) -> Check:
    """None, or what ``check`` accepts."""
    return lambda name, value: None if value is None else check(name, value)


def count_or_auto() -> Check:
    """``"auto"`` or an integer > 0."""
    return lambda name, value: value if value == "auto" else check_positive(name, value, integer=True)


@dataclass(frozen=True)
class Hyperparameter:
    """One keyword of an algorithm: its default, its check, its meaning.

    Attributes
    ----------
    name : str
        The keyword.
    default : Any
        The papers' value (the constructor's default).
    check : callable
        ``check(name, value)`` returns the value to use or raises
        ``TypeError``/``ValueError`` naming ``name`` and ``value``.
    help : str
        One line for the command line's help.
    per_group : bool
        A parameter group may set it for its own slice of the parameters.
    execution : bool
        An execution knob, not mathematics (see the module docstring).
    training : Any
        Where ``mpiopt train`` starts instead of ``default`` (the papers' value for other models); None: it does not.
    """

    name: str
    default: Any
    check: Check
    help: str
    per_group: bool = False
    execution: bool = False
    training: Any = None

    def validate(self, value: Any) -> Any:
        """The checked value (its error names this entry and the value)."""
        return self.check(self.name, value)


class Schema:
    """The ordered entries of one algorithm; schemas add up (``BASE + LOCAL_SGD + own``) and re-default."""

    def __init__(self, *entries: Hyperparameter) -> None:
        self._entries: Dict[str, Hyperparameter] = {}
        for entry in entries:
            if entry.name in self._entries:
                raise ValueError(f"hyperparameter {entry.name!r} is declared twice")
            self._entries[entry.name] = entry

    def __add__(self, other: "Schema") -> "Schema":
        return Schema(*self, *other)

    def __iter__(self) -> Iterator[Hyperparameter]:
        return iter(self._entries.values())

    def __contains__(self, name: object) -> bool:
        return name in self._entries

    def __getitem__(self, name: str) -> Hyperparameter:
        return self._entries[name]

    def names(self) -> List[str]:
        return list(self._entries)

    def with_defaults(self, **defaults: Any) -> "Schema":
        """The same entries, some with another default (an algorithm's own value of a shared entry)."""
        unknown = sorted(set(defaults) - set(self._entries))
        if unknown:
            raise ValueError(f"no hyperparameter {', '.join(unknown)} to re-default")
        return Schema(*(replace(e, default=defaults[e.name]) if e.name in defaults else e for e in self))

    def defaults(self) -> Dict[str, Any]:
        """Every entry's default."""
        return {e.name: e.default for e in self}

    def knobs(self) -> Tuple[str, ...]:
        """The execution knobs' names."""
        return tuple(e.name for e in self if e.execution)

    def per_group(self) -> Tuple[str, ...]:
        """The names a parameter group may set."""
        return tuple(e.name for e in self if e.per_group)

    def validate(self, values: Mapping[str, Any], *, what: str = "algorithm") -> Dict[str, Any]:
        """``values`` checked entry by entry (none missing is required).

        Raises
        ------
        TypeError
            For a name the schema lacks (the message lists those it has),
            or a value of the wrong type.
        ValueError
            For a value out of range.
        """
        self.check_names(values, what=what)
        return {name: self._entries[name].validate(value) for name, value in values.items()}

    def complete(self, values: Mapping[str, Any], *, what: str = "algorithm") -> Dict[str, Any]:
        """Every entry's checked value: ``values``' where given, else the default (unknown names refused as below)."""
        self.check_names(values, what=what)
        return {e.name: e.validate(values.get(e.name, e.default)) for e in self}

    def pick(self, values: Mapping[str, Any]) -> Dict[str, Any]:
        """The entries of ``values`` this schema declares."""
        return {name: values[name] for name in self._entries if name in values}

    def check_names(self, names: Iterable[str], *, what: str = "algorithm") -> None:
        """Refuse the ``names`` the schema lacks, each with the declared name closest to it, if one is close.

        Raises
        ------
        TypeError
            Naming ``what``, each unknown name (``'perido' (did you mean
            'period'?)``) and the names the schema has.
        """
        unknown = sorted(set(names) - set(self._entries))
        if not unknown:
            return
        named = []
        for name in unknown:
            # Above difflib's 0.6: a typo ('perido', 'momentm') scores 0.8 or more, while a stem shared by several
            # names ('pull' of pull_local, pull_global, pull_form) scores 0.57 to 0.62 and would guess one of them.
            close = difflib.get_close_matches(name, self.names(), n=1, cutoff=0.7)
            named.append(f"{name!r} (did you mean {close[0]!r}?)" if close else repr(name))
        raise TypeError(f"{what} has no hyperparameter {', '.join(named)}; it takes {', '.join(self.names())}")

    def help(self, skip: Sequence[str] = ()) -> List[str]:
        """One line per entry: ``name=default  help`` with ``[per group]`` or ``[execution]`` where they apply."""
        lines = []
        for e in self:
            if e.name in skip:
                continue
            marks = "".join(f" [{m}]" for m, on in (("per group", e.per_group), ("execution", e.execution)) if on)
            lines.append(f"{e.name}={e.default!r}: {e.help}{marks}")
        return lines


def split_knobs(schema: Optional[Schema], values: Mapping[str, Any]) -> Tuple[Dict[str, Any], Dict[str, Any]]:
    """``values`` as (hyperparameters, execution knobs) by ``schema``."""
    knobs = set(schema.knobs()) if schema is not None else set()
    return {k: v for k, v in values.items() if k not in knobs}, {k: v for k, v in values.items() if k in knobs}
