"""Parameter groups: the inner optimizer's (adopted), or the built-in update's per-group settings.

With an inner optimizer its ``param_groups`` and ``state`` are the front
end's, read through, so schedulers and clipping see one set of groups.
Without one each group may set the built-in update's ``lr``, ``momentum``,
``dampening``, ``nesterov`` and ``weight_decay``, handed to the algorithm
before every step (schedulers that cycle them work).
"""

from __future__ import annotations

import math
from typing import Any, Dict, List, Optional, Tuple

import torch

from ..algorithms import Algorithm
from ..algorithms.local import LOCAL_SGD

__all__ = ["GroupsMixin", "check_inner", "check_survivable"]

#: Keys any group may carry: ours, and what schedulers add.
_GROUP_KEYS = {"params", "lr", "initial_lr"}


def check_survivable(overlap: Optional[bool]) -> None:
    """ValueError where this optimizer cannot yet go on without a lost rank (``on_failure="shrink"``): what a failed
    step leaves changed must be what the algorithm rolls back (docs/failures.md)."""
    if overlap:
        raise ValueError("on_failure='shrink' takes overlap=False: the buckets summed during backward are not rolled back")


def check_inner(inner: Optional[torch.optim.Optimizer], algorithm: str, hyperparameters: Dict[str, Any]) -> Optional[torch.optim.Optimizer]:
    """``inner`` if it can serve as ``algorithm``'s local step; the built-in update's hyperparameters are then refused."""
    if inner is None:
        return None
    if not isinstance(inner, torch.optim.Optimizer) or isinstance(inner, GroupsMixin):  # not another front end
        raise TypeError(f"inner must be a torch.optim.Optimizer over the model's parameters, got {type(inner).__name__}")
    local = sorted(set(hyperparameters) & ({"lr"} | set(LOCAL_SGD.names())))
    if local:
        raise ValueError(
            f"{algorithm} with inner={type(inner).__name__}: {', '.join(local)} belong to the inner optimizer; set them there"
        )
    return inner


class GroupsMixin:
    """The groups of a ``torch.optim.Optimizer`` that fronts ``self.algorithm``, with ``self.inner`` or the built-in update."""

    algorithm: Algorithm
    inner: Optional[torch.optim.Optimizer]
    _local_keys: Tuple[str, ...]

    @property
    def param_groups(self) -> List[Dict[str, Any]]:  # type: ignore[override]
        inner = self.__dict__.get("inner")  # read through: its load_state_dict replaces the list
        return inner.param_groups if inner is not None and self.__dict__.get("_adopted") else self.__dict__["_own_groups"]

    @param_groups.setter
    def param_groups(self, groups: List[Dict[str, Any]]) -> None:
        self.__dict__["_own_groups"] = groups

    @property
    def state(self) -> Any:  # type: ignore[override]
        inner = self.__dict__.get("inner")
        return inner.state if inner is not None and self.__dict__.get("_adopted") else self.__dict__["_own_state"]

    @state.setter
    def state(self, state: Any) -> None:
        self.__dict__["_own_state"] = state

    def _group_defaults(self) -> Dict[str, Any]:
        """torch.optim's defaults: the rate, and the built-in update's per-group keys where groups may set them."""
        if self.inner is None and self.algorithm._local_update() is not None:
            self._local_keys = tuple(k for k in self.algorithm.schema.per_group() if k != "lr")
        own = self.algorithm.hyperparameters()
        return {"lr": self.algorithm.lr, **{k: own[k] for k in self._local_keys}}

    def _adopt_groups(self, inner: torch.optim.Optimizer) -> None:
        """Share ``inner``'s parameter groups (the same list), after checking that they hold our parameters."""
        ours = [p for group in self.param_groups for p in group["params"]]
        theirs = [p for group in inner.param_groups for p in group["params"]]
        if {id(p) for p in ours} != {id(p) for p in theirs} or len(ours) != len(theirs):
            # Equal counts are the usual mistake (an optimizer over a copy of the model): "4 against 4" would read as no difference.
            differs = (f"the same number of parameters ({len(ours)}) but other tensors (was it created over a copy of the model?)"
                       if len(theirs) == len(ours) else f"{len(theirs)} parameters against {len(ours)}")
            raise ValueError(
                f"inner optimizer {type(inner).__name__} holds other parameters than DistributedOptimizer's: {differs}; "
                "create it over the same parameters, e.g. inner=torch.optim.AdamW(model.parameters())"
            )
        self.defaults = inner.defaults
        self._adopted = True

    def _check_groups(self) -> None:
        """Refuse no parameters, and group keys the algorithm cannot honour (naming the group and the key)."""
        if not any(group["params"] for group in self.param_groups):
            raise ValueError("DistributedOptimizer got no parameters")
        if self.inner is not None:  # the groups are the inner optimizer's, with its hyperparameters
            return
        name = self.algorithm.name
        for i, group in enumerate(self.param_groups):
            extra = sorted(set(group) - _GROUP_KEYS - set(self._local_keys))
            if extra:
                why = (f"{name}'s built-in update takes {', '.join(('lr',) + self._local_keys)} per group; "
                       "for another optimizer's keywords give inner=" if self._local_keys else
                       f"{name} takes one set of hyperparameters for all parameters; pass them to DistributedOptimizer")
                raise ValueError(f"parameter group {i} sets {extra}: {why}")
        self._hand_groups()

    def _group_slices(self) -> List[Tuple[int, int]]:
        """Each group's contiguous ``[start, stop)`` slice of the flat buffer, in order."""
        sizes = [sum(p.numel() for p in group["params"]) for group in self.param_groups]
        return [(sum(sizes[:i]), sum(sizes[: i + 1])) for i in range(len(sizes))]

    def _hand_groups(self) -> None:
        """The groups' learning rates (and the built-in update's per-group settings) to the algorithm, for the next step."""
        if self.inner is not None:  # the rates are the inner optimizer's, per group as it likes: the first is recorded
            self.algorithm.lr = float(self.param_groups[0]["lr"])
            return
        if not self._local_keys:
            self.algorithm.lr = self._group_lr()
            return
        values = []
        for i, group in enumerate(self.param_groups):
            lr = float(group["lr"])
            if not (lr >= 0 and math.isfinite(lr)):  # 0 is a scheduler's warm-up start or end
                raise ValueError(f"parameter group {i}: learning rate must be a finite number >= 0, got {lr!r}")
            values.append({"lr": lr, **{k: group[k] for k in self._local_keys}})
        if self.algorithm.num_params is not None:
            self.algorithm.set_group_values(values)
        self.algorithm.lr = values[0]["lr"]  # what records report

    def _group_lr(self) -> float:
        """The one learning rate of an algorithm that takes one for all groups."""
        rates = {float(group["lr"]) for group in self.param_groups}
        if len(rates) > 1:
            raise ValueError(f"parameter groups have different learning rates {sorted(rates)}: mpiopt algorithms take one")
        lr = rates.pop()
        if not (lr >= 0 and math.isfinite(lr)):  # 0 is a scheduler's warm-up start or end
            raise ValueError(f"learning rate must be a finite number >= 0, got {lr!r}")
        return lr
