"""A toy algorithm defined outside mpiopt: local SGD whose ranks average their parameters every ``period`` steps.

It is everything a new algorithm needs (one module, one class): the tests
register it through ``$MPIOPT_ALGORITHMS=toy_averaging`` and run it through
``setup``/``step``, a checkpoint, ``mpiopt train``, ``compare`` and
``bench algorithms`` with no other file changed.
"""

from __future__ import annotations

from typing import Any, Dict, List, Mapping, Optional

from mpiopt.algorithms import SynchronousAlgorithm, register
from mpiopt.algorithms.base import BASE, due_steps
from mpiopt.algorithms.resize import COPY
from mpiopt.algorithms.schema import Hyperparameter, Schema, positive
from mpiopt.arrays import empty_apart
from mpiopt.comm.ledger import Call


@register
class ToyAveraging(SynchronousAlgorithm):
    """``x -= lr g``; after every ``period``-th step every rank takes the ranks' mean of ``x``."""

    name = "toy_averaging"
    evaluates = "average"
    state_scalars = ("averages",)
    resize_rules = {"averages": COPY}
    training_defaults = {"lr": 0.05, "period": 2}
    wire_summary = "4d every `period` steps"
    schema = BASE.with_defaults(lr=0.1) + Schema(Hyperparameter("period", 4, positive(integer=True), "steps between averagings"))

    def __init__(self, topology: Any, *, lr: float = 0.1, period: int = 4, nan_policy: str = "raise") -> None:
        super().__init__(topology, lr=lr, nan_policy=nan_policy)
        self.period = self.schema["period"].validate(period)
        self.averages = 0
        self._sum: Optional[Any] = None

    @classmethod
    def _plan(cls, d: int, ranks: int, hyper: Mapping[str, Any], groups: List[int], steps: range, itemsize: int) -> List[Call]:
        return [Call("allreduce", itemsize * d, ranks, due_steps(hyper["period"], steps))]

    @classmethod
    def plan_cycle(cls, hyper: Mapping[str, Any]) -> int:
        return int(hyper["period"])

    def hyperparameters(self) -> Dict[str, Any]:
        return {"period": self.period}

    def _allocate(self, params: Any) -> None:
        self._sum = empty_apart(params)

    def _step(self, params: Any, grad: Any, loss: Optional[float]) -> None:
        params -= self.lr * grad
        if (self.steps + 1) % self.period == 0:
            world = self.topology.world
            world.Allreduce(params, out=self._sum)
            params[...] = self._sum / world.size
            self.averages += 1
