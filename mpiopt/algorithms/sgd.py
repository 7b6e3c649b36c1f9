"""Data-parallel SGD: the baseline every other algorithm is measured against.

One Allreduce of the gradient per step, then ``torch.optim.SGD``'s local step (one rank: ``torch.optim.SGD`` itself);
:meth:`SGD.step_reduced` takes a sum the caller exchanged in buckets during backward.  Notes: docs/algorithm-notes.md.
"""

from __future__ import annotations

from typing import Any, List, Mapping, NoReturn, Optional

from ..arrays import empty_apart
from ..comm import Topology
from ..comm.ledger import Call
from ..kernels.update import all_finite
from .base import BASE, StepRecord, SynchronousAlgorithm
from .compressed import CODEC, FEEDBACK, RESIDUAL, Compressed
from .local import LOCAL_SGD, LocalSGD, LocalStepState
from .registry import register
from .resize import COPY

__all__ = ["SGD"]


@register
class SGD(Compressed, LocalStepState, SynchronousAlgorithm):
    """Synchronous data-parallel SGD with Allreduce (a ``codec``: the gradients' payloads all-gathered instead)."""

    name = "sgd"
    inner_role = "gradient"
    inner_rule = "g = (1/N) sum_i g_i into .grad; x <- inner(x, g)  (the paper: x <- x - eta g, inner = SGD)"
    listing_order = 0
    schema = BASE.with_defaults(lr=0.1) + LOCAL_SGD + CODEC + FEEDBACK
    baseline = True
    overlaps_backward = True
    fused_gradient_check = True
    islands_refusal = None  # islands: the island's mean, then the mean of the islands' (plain data parallelism)
    state_arrays = ("momentum_buffer", "codec_residual")
    # The momentum is the same on every rank (averaged gradients); the residuals are owed to the mean (docs/codecs.md).
    resize_rules = {"momentum_buffer": COPY, "codec_residual": RESIDUAL}
    training_defaults = {"lr": 0.05, "momentum": 0.9}
    wire_summary = "4d bytes each way (a codec: its payload, all-gathered)"
    update_goal = 1.2

    @classmethod
    def _plan(cls, d: int, ranks: int, hyper: Mapping[str, Any], groups: List[int], steps: range, itemsize: int) -> List[Call]:
        return [cls._codec_call(d, ranks, hyper, len(steps)) or Call("allreduce", itemsize * d, ranks, len(steps))]

    def __init__(self, topology: Topology, **hyperparameters: Any) -> None:
        super().__init__(topology, **hyperparameters)
        self.local = LocalSGD.from_values(self._values)
        self._average: Optional[Any] = None
        self._reduced: Optional[Any] = None  # the caller's summed gradient, during step_reduced only
        self._wire: Optional[Any] = None  # the codec's exchange
        # A codec's payloads cannot be summed in buckets during backward, and its residual is in the gradient's units.
        self.overlaps_backward = self.islands or self._codec is None
        self.exchange_keeps_gradient = self._feeds_back()

    def _allocate(self, params: Any) -> None:
        self.local.allocate(params)
        self._average = empty_apart(params) if self.worker_count > 1 or self._codec is not None else None
        self._wire = self._allocate_codec(params)

    def step_reduced(self, params: Any, grad: Any, total: Any, loss: Optional[float] = None) -> StepRecord:
        """:meth:`step` without its Allreduce: ``total`` already holds the sum of ``grad`` over the world.

        ``total`` (a buffer like ``params``, left unchanged) is divided by the
        world size inside the local step, the same floating-point operations
        as :meth:`step` does after its Allreduce: the parameters are bitwise
        those of :meth:`step` whenever ``total`` holds the same sums.
        The sum is checked for non-finite values as in :meth:`step`
        (``grad``, this rank's gradient, is read only then, to name the rank
        at fault).  The record counts no bytes for the exchange the caller
        made.
        """
        if self.islands:  # the island's sum: the base class takes it
            return super().step_reduced(params, grad, total, loss)
        if self._codec is not None:
            raise TypeError(f"sgd with codec={self.codec!r} exchanges encoded gradients: there is no summed gradient to take; call step()")
        self._check_flat("total", total)
        self._reduced = total
        try:
            return self.step(params, grad, loss)
        finally:
            self._reduced = None

    def _non_finite_sum(self, grad: Any, named: bool = True) -> NoReturn:
        """End the job for a non-finite sum of the gradients, naming the ranks whose own gradient was not finite.

        Every rank holds the same sum, so every rank comes here (a rank that
        does not, after a summation that overflowed in another order, is
        waited for at most ``VOTE_SECONDS``).  The step was applied: the
        parameters are not to be used further on any rank.  Not ``named``:
        ``grad`` no longer holds this rank's own gradient (an inner
        optimizer's ``.grad`` received the mean in the checking pass), so
        every rank says the same without naming one.
        """
        step = self.steps + 1
        if not named:
            self.topology.raise_or_abort(FloatingPointError(
                f"{self.name}: the mean of the ranks' gradients is not finite at step {step} (it replaced each rank's own "
                "gradient in .grad, so the rank at fault is not named; nan_policy='skip' skips such steps on every rank)"
            ))

        self.name_non_finite_ranks(all_finite(grad))
        self.topology.raise_or_abort(FloatingPointError(
            f"{self.name}: the sum of the ranks' gradients overflowed at step {step} (every rank's own was finite)"
        ))

    def _exchange(self, params: Any, grad: Any) -> Any:
        world = self.workers
        if self._wire is not None:
            self._wire.start(world, grad)
            self._wire.total(out=self._average)
        elif world.size == 1:
            return grad
        else:
            world.Allreduce(grad, out=self._average)
        self._average /= world.size
        return self._average

    def _step(self, params: Any, grad: Any, loss: Optional[float]) -> None:
        world = self.workers
        total = self._reduced
        if self._wire is not None:  # the decoded sum, the same bits on every rank
            self._wire.start(world, grad)
            total = self._wire.total(out=self._average)
        elif total is None and world.size == 1:
            total = grad  # one rank's sum is its gradient: no copy
        elif total is None:
            world.Allreduce(grad, out=self._average)
            total = self._average
        # The division by the world size rides in the update's one pass over memory (same bits as total /= P first),
        # and so does the check: of the sum at more ranks, which every rank holds alike, so a non-finite one sends
        # every rank to _non_finite_sum together, where each checks its own gradient to name the culprit.
        if self.local.apply(params, total, self.lr, grad_divisor=world.size, check_finite=self._checks_in_step()) is False:
            if total is grad:
                self._non_finite_gradient()
            self._non_finite_sum(grad, named=getattr(self.local, "grad_buffer", None) is not grad)
