"""DiLoCo: many local steps, then one outer Nesterov step on the ranks' mean pseudo-gradient.

Douillard et al., "DiLoCo: Distributed Low-Communication Training of Language Models", 2023 (arXiv:2311.08105),
Algorithm 1: ``period`` inner steps, one Allreduce, ``theta = OuterSGD(theta_start, mean_i (theta_start - theta_i))``.
Notes: docs/algorithm-notes.md.
"""

from __future__ import annotations

from typing import Any, List, Mapping, Optional

from ..arrays import array_module, empty_apart
from ..comm import Topology
from ..kernels.update import mix_into, outer_sgd, sgd_update
from ..comm.ledger import Call
from .base import BASE, SynchronousAlgorithm, due_steps
from .compressed import CODEC, FEEDBACK, RESIDUAL, Compressed
from .local import LOCAL_SGD, LocalSGD, LocalStepState
from .registry import register
from .resize import COPY, FOLLOW
from .schema import Hyperparameter, Schema, boolean, in_range, positive
from .survival import PeriodicExchange

__all__ = ["DiLoCo", "outer_step", "outer_update"]


def outer_step(
    theta_start: Any, total: Any, size: int, *, lr: float, momentum: float, nesterov: bool, buffer: Optional[Any],
    out: Optional[Any] = None, alpha: float = 0.0, work: Optional[List[Any]] = None,
) -> None:
    """The outer step from ``theta_start`` (in place) given ``total = sum_i theta_i`` over ``size`` ranks (scratch).

    ``Delta = theta_start - total / size``, then torch's SGD rule, in one fused pass
    (:func:`~mpiopt.kernels.update.outer_sgd`).  ``lr = 1, momentum = 0`` is the
    mean itself, computed as such (exact).  ``out`` gets the result (``alpha = 0``)
    or ``out * alpha + result * (1 - alpha)``.  Shared by ``diloco`` and
    ``streaming_diloco`` (there on one fragment's slices, mixed by its ``alpha``).
    """
    if lr == 1.0 and momentum == 0.0:
        array_module(total).divide(total, size, out=theta_start)
        if out is not None and alpha:  # total is scratch
            mix_into(out, theta_start, alpha, total)
        elif out is not None:
            out[...] = theta_start
        return
    outer_sgd(theta_start, total, size, buffer, lr=lr, momentum=momentum, nesterov=nesterov, out=out, alpha=alpha, work=work)


def outer_update(
    theta_start: Any, delta: Any, *, lr: float, momentum: float, nesterov: bool, buffer: Optional[Any],
    out: Optional[Any] = None, work: Optional[List[Any]] = None,
) -> None:
    """``torch.optim.SGD``'s rule on the mean pseudo-gradient ``delta`` from ``theta_start`` (in place; ``out`` gets a copy).

    ``buffer`` (the momentum) starts as zeros: ``b = mu 0 + Delta`` is bitwise torch's first ``b = Delta``.
    """
    sgd_update(theta_start, delta, buffer, lr=lr, momentum=momentum, nesterov=nesterov and momentum > 0, work=work, copy_to=out)


@register
class DiLoCo(PeriodicExchange, Compressed, LocalStepState, SynchronousAlgorithm):
    """DiLoCo (Douillard et al. 2023): ``period`` local steps, then an outer Nesterov step on the mean pseudo-gradient.

    Attributes
    ----------
    theta_start : array
        The parameters at the last outer step (same on every rank).
    outer_momentum_buffer : array or None
        The outer SGD's momentum buffer (same on every rank; zeros until the first outer step).
    codec_residual : array or None
        With a lossy ``codec``: what this rank's payloads have not carried yet (error feedback).
    """

    name = "diloco"
    inner_role = "local"
    inner_rule = ("H steps theta_i <- inner(theta_i, g_i), then theta <- OuterNesterov(theta_start, mean_i (theta_start - theta_i))  "
                  "(the paper, Algorithm 1: inner = AdamW)")
    listing_order = 31
    schema = BASE.with_defaults(lr=0.1) + Schema(
        Hyperparameter("period", 500, positive(integer=True), "inner steps between outer steps (H)"),
        Hyperparameter("outer_lr", 0.7, positive(), "outer SGD learning rate"),
        Hyperparameter("outer_momentum", 0.9, in_range(0.0, 1.0, high_open=True), "outer SGD momentum, in [0, 1)"),
        Hyperparameter("outer_nesterov", True, boolean(), "Nesterov outer momentum (ignored at outer_momentum 0)"),
    ) + CODEC + FEEDBACK + LOCAL_SGD
    evaluates = "average"
    fused_gradient_check = True
    islands_refusal = None
    state_arrays = ("theta_start", "outer_momentum_buffer", "momentum_buffer", "codec_residual")
    state_scalars = ("outer_steps",)
    # theta_start and the outer momentum are the same on every rank; an inner momentum belongs to its rank's parameters;
    # the residuals are owed to the mean: each new rank takes their mean, which keeps it (docs/codecs.md).
    resize_rules = {
        "theta_start": COPY, "outer_momentum_buffer": COPY, "momentum_buffer": FOLLOW, "outer_steps": COPY, "codec_residual": RESIDUAL,
    }
    training_defaults = {"lr": 0.05, "momentum": 0.9, "period": 8}
    wire_summary = "4d every `period` steps (a codec: its payload, all-gathered)"
    update_goal = 1.3

    periodic_allreduce = "period"

    @classmethod
    def _plan(cls, d: int, ranks: int, hyper: Mapping[str, Any], groups: List[int], steps: range, itemsize: int) -> List[Call]:
        call = cls._codec_call(d, ranks, hyper, due_steps(hyper["period"], steps))
        return super()._plan(d, ranks, hyper, groups, steps, itemsize) if call is None else [call]

    def __init__(self, topology: Topology, **hyperparameters: Any) -> None:
        super().__init__(topology, **hyperparameters)
        self.local = LocalSGD.from_values(self._values)
        self.theta_start: Optional[Any] = None
        self.outer_momentum_buffer: Optional[Any] = None  # zeros from setup when outer_momentum > 0
        self._outer_work: List[Any] = []
        self.outer_steps = 0
        self._sum: Optional[Any] = None  # receives sum_i theta_i (with a codec: Delta_i, then the decoded sum), then holds Delta
        self._wire: Optional[Any] = None  # the codec's exchange

    def _allocate(self, params: Any) -> None:
        self.local.allocate(params)
        self._outer_work = []
        self.outer_momentum_buffer = empty_apart(params, zero=True) if self.outer_momentum else None
        world = self.workers
        self._sum = empty_apart(params)
        self._wire = self._allocate_codec(params)
        self.theta_start = empty_apart(params)
        world.Allreduce(params, out=self.theta_start)  # the common start: the ranks' mean (their model when they agree)
        self.theta_start /= world.size
        params[...] = self.theta_start

    def _step(self, params: Any, grad: Any, loss: Optional[float]) -> None:
        if self.local.apply(params, grad, self.lr, check_finite=self._checks_in_step()) is False:
            self._non_finite_gradient()  # before the outer step's collective
        if (self.steps + 1) % self.period == 0:  # the base class counts the step after _step returns
            self._outer_step(params)

    def _outer_step(self, params: Any) -> None:
        """One Allreduce of the parameters (a codec: an Allgather of the encoded ``Delta_i``), then the outer SGD step
        from ``theta_start`` into both buffers."""
        world = self.workers
        options = dict(lr=self.outer_lr, momentum=self.outer_momentum, nesterov=self.outer_nesterov,
                       buffer=self.outer_momentum_buffer, out=params, work=self._outer_work)
        if self._wire is None:
            world.Allreduce(params, out=self._sum)
            outer_step(self.theta_start, self._sum, world.size, **options)
        else:  # theta_start is the same on every rank, and so is the decoded mean: so is the new theta_start
            self._xp.subtract(self.theta_start, params, out=self._sum)  # Delta_i = theta_start - theta_i
            self._wire.start(world, self._sum)
            self._wire.mean(out=self._sum)
            outer_update(self.theta_start, self._sum, **options)
        self.outer_steps += 1
