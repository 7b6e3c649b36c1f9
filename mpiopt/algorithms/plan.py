"""The communication plan: the collectives of given steps, the one source of byte formulas and the cost model."""

from __future__ import annotations

from typing import Any, ClassVar, Dict, List, Mapping, Optional, Sequence

from ..comm.islands import island_plan
from ..comm.ledger import Call
from .schema import Schema

__all__ = ["Planned", "due_steps"]


def due_steps(period: int, steps: range, offset: int = 0) -> int:
    """How many of ``steps`` are ``offset`` modulo ``period`` (the steps at which a periodic exchange happens)."""
    if not steps:
        return 0
    return (steps[-1] - offset) // int(period) - (steps[0] - 1 - offset) // int(period)


class Planned:
    """Mixin of :class:`~mpiopt.algorithms.base.Algorithm`: :meth:`communication` from the class's :meth:`_plan`."""

    name: ClassVar[str]
    protocol: ClassVar[str]
    schema: ClassVar[Schema]
    periodic_allreduce: ClassVar[Optional[str]]

    @classmethod
    def default_hyperparameters(cls) -> Dict[str, Any]:
        """The schema's defaults (the papers' values), ``nan_policy`` aside."""
        defaults = cls.schema.defaults()
        defaults.pop("nan_policy", None)
        return defaults

    @classmethod
    def communication(
        cls, d: int, ranks: int, hyper: Optional[Mapping[str, Any]] = None, *, groups: Optional[Sequence[int]] = None,
        steps: Optional[range] = None, itemsize: int = 4, ranks_per_island: int = 1,
    ) -> List[Call]:
        """The collectives of ``steps`` (default: step 1) for ``d`` parameters of ``itemsize`` bytes over ``ranks`` ranks.

        ``hyper`` is completed by the class's defaults; ``groups`` are the
        topology's group sizes (default: one group).  Each call's ``count`` is
        how often it happens over ``steps``; empty at one rank.  With
        ``ranks_per_island`` > 1, an island run: the plan of ``ranks /
        ranks_per_island`` workers made by the islands (:func:`~mpiopt.comm.islands.island_plan`).
        ValueError for groups that do not add up to ``ranks``, or an algorithm without a plan.
        """
        groups = [ranks] if groups is None else [int(g) for g in groups]
        if sum(groups) != ranks or min(groups) < 1:
            raise ValueError(f"groups must be positive sizes adding up to ranks ({ranks}), got {groups!r}")
        steps = range(1, 2) if steps is None else steps
        h = {**cls.default_hyperparameters(), **(hyper or {})}
        if ranks_per_island > 1:
            if ranks % ranks_per_island:
                raise ValueError(f"{ranks} ranks make no islands of {ranks_per_island}")
            workers = ranks // ranks_per_island
            calls = [] if workers == 1 else cls._plan(int(d), workers, h, [workers], steps, itemsize)
            return island_plan(calls, int(d), ranks_per_island, workers, len(steps), itemsize)
        if ranks == 1:
            return []
        return cls._plan(int(d), int(ranks), h, groups, steps, itemsize)

    @classmethod
    def _plan(cls, d: int, ranks: int, hyper: Mapping[str, Any], groups: List[int], steps: range, itemsize: int) -> List[Call]:
        """The calls of :meth:`communication` (at ``ranks`` >= 2, ``hyper`` complete)."""
        if cls.periodic_allreduce is None:
            raise ValueError(f"{cls.name} declares no communication plan (its traffic depends on timing: {cls.protocol})")
        return [Call("allreduce", itemsize * d, ranks, due_steps(hyper[cls.periodic_allreduce], steps))]

    @classmethod
    def plan_cycle(cls, hyper: Mapping[str, Any]) -> int:
        """Steps after which the plan repeats (an average over them is the mean step)."""
        return 1 if cls.periodic_allreduce is None else int(hyper[cls.periodic_allreduce])
