"""A toy algorithm defined outside mpiopt: local SGD whose ranks average their parameters every ``period`` steps.

Everything a new algorithm needs, in one module and one class (docs/new-algorithm.md walks through it): the tests
register it through ``$MPIOPT_ALGORITHMS=toy_averaging`` and run it through ``setup``/``step``, a checkpoint,
``mpiopt train``, ``compare`` and ``bench algorithms`` with no other file changed.
"""

from __future__ import annotations

from typing import Any, Optional

from mpiopt.algorithms import SynchronousAlgorithm, register
from mpiopt.algorithms.base import BASE
from mpiopt.algorithms.resize import COPY
from mpiopt.algorithms.schema import Hyperparameter, Schema, positive
from mpiopt.arrays import empty_apart


@register
class ToyAveraging(SynchronousAlgorithm):
    """``x -= lr g``; after every ``period``-th step every rank takes the ranks' mean of ``x``."""

    name = "toy_averaging"
    schema = BASE + Schema(Hyperparameter("period", 4, positive(integer=True), "steps between averagings", training=2))
    periodic_allreduce = "period"  # the plan: one Allreduce of the parameters every `period` steps
    evaluates = "average"
    state_scalars = ("averages",)
    resize_rules = {"averages": COPY}
    wire_summary = "4d every `period` steps"
    islands_refusal = None  # it exchanges through self.workers only: with islands=True each node is one worker
    averages = 0  # averagings so far (state)

    def _allocate(self, params: Any) -> None:
        self._sum = empty_apart(params)

    def _step(self, params: Any, grad: Any, loss: Optional[float]) -> None:
        params -= self.lr * grad
        if (self.steps + 1) % self.period == 0:  # the base class counts the step after _step returns
            self.workers.Allreduce(params, out=self._sum)
            params[...] = self._sum / self.workers.size
            self.averages += 1
