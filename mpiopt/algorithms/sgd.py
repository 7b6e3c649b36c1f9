"""Data-parallel SGD: the baseline every other algorithm is measured against.

``g = (1/N) sum_i g_i`` by one Allreduce over the flat gradient buffer per
step (4d bytes sent and received per rank, ALGORITHMS.md "Baseline"), then
the local step of ``torch.optim.SGD`` (momentum, dampening, Nesterov, weight
decay).  With one rank it is ``torch.optim.SGD`` itself.
"""

from __future__ import annotations

from typing import Any, Dict, Optional

from ..arrays import array_module
from ..comm import Topology
from .base import Algorithm
from .local import LocalSGD, LocalStepState
from .registry import register

__all__ = ["SGD"]


@register
class SGD(LocalStepState, Algorithm):
    """Synchronous data-parallel SGD with Allreduce.

    Parameters
    ----------
    topology : Topology
        Communicators; the gradient is averaged over ``topology.world``.
    lr : float
        Learning rate.
    momentum, dampening, nesterov, weight_decay
        As in ``torch.optim.SGD`` (see :class:`~mpiopt.algorithms.local.LocalSGD`).
    nan_policy : {"raise", "skip"}
        See :class:`~mpiopt.algorithms.base.Algorithm`.
    """

    name = "sgd"
    state_arrays = ("momentum_buffer",)

    def __init__(
        self,
        topology: Topology,
        *,
        lr: float = 0.1,
        momentum: float = 0.0,
        dampening: float = 0.0,
        nesterov: bool = False,
        weight_decay: float = 0.0,
        nan_policy: str = "raise",
    ) -> None:
        super().__init__(topology, lr=lr, nan_policy=nan_policy)
        self.local = LocalSGD(momentum, dampening, nesterov, weight_decay)
        self._average: Optional[Any] = None

    def hyperparameters(self) -> Dict[str, Any]:
        return self.local.hyperparameters()

    def _allocate(self, params: Any) -> None:
        self.local.allocate(params)
        self._average = array_module(params).empty_like(params)

    def _step(self, params: Any, grad: Any, loss: Optional[float]) -> None:
        world = self.topology.world
        world.Allreduce(grad, out=self._average)
        self._average /= world.size
        self.local.apply(params, self._average, self.lr)
