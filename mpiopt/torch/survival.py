"""An inner torch optimizer's state rolled back with a step that a lost rank broke (``on_failure`` shrink or respawn).

The algorithm puts the parameters back to the failed step's start (docs/failures.md); the inner optimizer (AdamW's
moments and step count) must go back with them, or the redone step would apply its update twice.
"""

from __future__ import annotations

import copy
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch

from ..algorithms import Algorithm
from .scaler import ScalerVote

__all__ = ["InnerRollback", "RecoveryMixin"]


class InnerRollback:
    """An inner optimizer's per-parameter state as it was before its latest step, in buffers kept from step to step.

    Attributes
    ----------
    step : int or None
        The algorithm's step (counted from 1) whose inner step the kept state precedes; None before the first.
    """

    def __init__(self) -> None:
        self.step: Optional[int] = None
        self._kept: Dict[torch.Tensor, Dict[str, Any]] = {}

    def save(self, inner: torch.optim.Optimizer, step: int) -> None:
        """Keep ``inner``'s state before the inner step of algorithm step ``step``: tensors copied into the buffers of
        the previous save (one copy of each state tensor a step, no allocation after the first), other values deep-copied."""
        kept: Dict[torch.Tensor, Dict[str, Any]] = {}
        for param, state in inner.state.items():
            old = self._kept.get(param, {})
            entry: Dict[str, Any] = {}
            for name, value in state.items():
                if torch.is_tensor(value):
                    buffer = old.get(name)
                    if not (torch.is_tensor(buffer) and buffer.shape == value.shape and buffer.dtype == value.dtype
                            and buffer.device == value.device):
                        buffer = torch.empty_like(value)
                    buffer.copy_(value)
                    entry[name] = buffer
                else:
                    entry[name] = copy.deepcopy(value)
            kept[param] = entry
        self._kept, self.step = kept, step

    def restore(self, inner: torch.optim.Optimizer) -> None:
        """Put ``inner``'s state back as it was kept: tensors copied back in place, state the failed step created removed."""
        for param in [p for p in inner.state if p not in self._kept]:
            del inner.state[param]  # the failed step was this parameter's first
        for param, entry in self._kept.items():
            state = inner.state[param]
            for name in [n for n in state if n not in entry]:
                del state[name]
            for name, value in entry.items():
                current = state.get(name)
                if torch.is_tensor(value) and torch.is_tensor(current) and current.shape == value.shape and current.dtype == value.dtype:
                    current.copy_(value)
                else:
                    state[name] = value.clone() if torch.is_tensor(value) else copy.deepcopy(value)


class RecoveryMixin:
    """:meth:`recover` of :class:`~mpiopt.torch.DistributedOptimizer`, on ``self.algorithm``, ``self.inner`` and its
    :class:`InnerRollback`."""

    algorithm: Algorithm
    inner: Optional[torch.optim.Optimizer]
    topology: Any
    _inner_rollback: Optional[InnerRollback]
    _inner_step: Callable[[Any, Any], None]
    _local_keys: Tuple[str, ...]
    _params_array: Any
    _grads_array: Any
    _vote: ScalerVote
    _group_slices: Callable[[], List[Tuple[int, int]]]
    _hand_groups: Callable[[], None]

    def recover(self) -> None:
        """After ``topology.recover()``, on every survivor of a lost rank: the algorithm moved to the survivors from
        the failed step's start (:meth:`~mpiopt.algorithms.base.Algorithm.recovered`), the inner optimizer's state
        with it; then redo the step.  Under ``on_failure="respawn"`` the replacements' ``DistributedOptimizer``
        takes the parameters and both states of the survivor each follows meanwhile.  A rank lost during it raises
        :class:`~mpiopt.comm.RankLost` on every survivor, this optimizer unchanged: recover the topology, call again."""

        def prepare(fresh: Algorithm) -> None:
            fresh.loss_call = self.algorithm.loss_call
            if self.inner is not None:
                fresh.use_inner(self._inner_step, type(self.inner).__name__)
            if self._local_keys:
                fresh.use_groups(self._group_slices())

        rollback, failed = self._inner_rollback, self.algorithm.unfinished_step
        if rollback is not None and failed is not None and rollback.step == failed:
            rollback.restore(self.inner)  # the failed step's inner update, undone as its parameters were
        self.algorithm = self.algorithm.recovered(self._params_array, prepare)
        if self.inner is not None:
            self.algorithm.inner.grad_buffer = self._grads_array
        self._vote = ScalerVote(self.topology.control)
        self._hand_groups()
