"""EASGD and EAMSGD: elastic averaging SGD, synchronous, without a parameter server.

Zhang, Choromanska and LeCun, "Deep learning with Elastic Averaging SGD", NeurIPS 2015 (arXiv:1412.6651):
local SGD, and every ``period`` steps the workers and the centre (a copy on every rank) pull together, eqs. (5)-(6).
Notes: docs/algorithm-notes.md.
"""

from __future__ import annotations

from typing import Any, List, Mapping, Optional, Tuple

from ..arrays import empty_apart
from ..comm import Topology
from ..kernels.update import elastic_pull, fused_update_available
from ..comm.communicator import plain
from ..comm.ledger import Call
from .base import BASE, SynchronousAlgorithm, due_steps
from .compressed import CODEC, FEEDBACK, RESIDUAL, Compressed
from .local import LOCAL_SGD, LocalSGD, LocalStepState
from .schema import Hyperparameter, Schema, check_positive, optional, positive
from .registry import register
from .resize import COPY, FOLLOW
from .survival import PeriodicExchange

__all__ = ["EASGD", "DEFAULT_BETA", "moving_rates"]

#: beta = N alpha when neither alpha nor beta is given (Zhang et al. 2015,
#: experiments: beta = 0.9, so alpha = 0.9 / N); the reference LSGD code
#: runs EASGD with beta = 0.43.
DEFAULT_BETA = 0.9


def moving_rates(alpha: Optional[float], beta: Optional[float], workers: int) -> Tuple[float, float]:
    """``(alpha, beta)`` from whichever of the two is given (``beta = workers * alpha``).

    Raises
    ------
    ValueError
        When both are given, one is negative, or the pull is unstable: the
        distance between the workers' mean and the centre is multiplied by
        ``1 - alpha - beta`` at each pull, so ``alpha (N + 1) < 2`` is needed.
    TypeError
        When the one given is not a finite number.
    """
    if alpha is not None and beta is not None:
        raise ValueError(f"give alpha or beta (= N alpha), not both; got alpha={alpha!r}, beta={beta!r}")
    if alpha is None:
        name, value = "beta", DEFAULT_BETA if beta is None else beta
        beta = float(check_positive("beta", value, allow_zero=True))
        alpha = beta / workers
    else:
        name, value = "alpha", alpha
        alpha = float(check_positive("alpha", alpha, allow_zero=True))
        beta = alpha * workers
    if alpha + beta >= 2.0:
        raise ValueError(
            f"{name}={value!r} gives alpha={alpha:g}, beta={beta:g} at {workers} ranks: the elastic pull is "
            f"unstable unless alpha + beta = alpha (N + 1) < 2"
        )
    return alpha, beta


@register
class EASGD(PeriodicExchange, Compressed, LocalStepState, SynchronousAlgorithm):
    """Synchronous elastic averaging SGD (EASGD; EAMSGD with Nesterov momentum).

    Attributes
    ----------
    center : array
        The centre variable ``c`` (same on every rank), the model to evaluate.
    """

    name = "easgd"
    inner_role = "local"
    inner_rule = ("x_i <- inner(x_i, g_i); every period steps x_i <- x_i - alpha (x_i - c), c <- c + beta (mean_i x_i - c)  "
                  "(the paper, eqs. 5-6: the local step x_i - eta g_i is inner = SGD)")
    listing_order = 10
    schema = BASE.with_defaults(lr=0.1) + Schema(
        Hyperparameter("alpha", None, optional(positive(allow_zero=True)), "moving rate of a worker towards the centre (give alpha or beta)"),
        Hyperparameter("beta", None, optional(positive(allow_zero=True)), "beta = N alpha, the centre's moving rate (default 0.9)"),
        Hyperparameter("period", 4, positive(integer=True), "steps between elastic pulls (tau)"),
    ) + CODEC + FEEDBACK + LOCAL_SGD
    evaluates = "average"
    fused_gradient_check = True
    islands_refusal = None
    state_arrays = ("center", "momentum_buffer", "codec_residual")
    # Every rank holds the same centre; a momentum buffer belongs to the parameters it moved; the residuals are owed
    # to the mean, which each new rank taking their mean keeps (docs/codecs.md).
    resize_rules = {"center": COPY, "momentum_buffer": FOLLOW, "codec_residual": RESIDUAL}
    training_defaults = {"lr": 0.05, "momentum": 0.9}
    wire_summary = "4d every `period` steps (a codec: its payload of x_i - c, all-gathered)"
    update_goal = 1.5

    periodic_allreduce = "period"

    @classmethod
    def _plan(cls, d: int, ranks: int, hyper: Mapping[str, Any], groups: List[int], steps: range, itemsize: int) -> List[Call]:
        call = cls._codec_call(d, ranks, hyper, due_steps(hyper["period"], steps))
        return super()._plan(d, ranks, hyper, groups, steps, itemsize) if call is None else [call]

    @classmethod
    def resize_skip(cls, saved: Mapping[str, Any], here: Mapping[str, Any], old_size: int, new_size: int) -> Tuple[str, ...]:
        # alpha and beta = N alpha cannot both stay at another N: accept the run when either does (the one its settings fixed).
        plain_saved, plain_here = plain(dict(saved)), plain(dict(here))
        return ("alpha", "beta") if any(plain_saved.get(k) == plain_here.get(k) for k in ("alpha", "beta")) else ()

    def __init__(self, topology: Topology, **hyperparameters: Any) -> None:
        super().__init__(topology, **hyperparameters)
        self.alpha, self.beta = moving_rates(self.alpha, self.beta, self.worker_count)
        self.local = LocalSGD.from_values(self._values)
        self.center: Optional[Any] = None
        self._mean: Optional[Any] = None  # receives sum_i x_i (with a codec: x_i - c, then the decoded sum)
        self._wire: Optional[Any] = None  # the codec's exchange
        self._work: Optional[Any] = None

    def _allocate(self, params: Any) -> None:
        self.local.allocate(params)
        self._mean = empty_apart(params)
        self._work = None if fused_update_available(params) else empty_apart(params)  # the array code's scratch
        self._wire = self._allocate_codec(params)
        world = self.workers
        self.center = empty_apart(params)
        world.Allreduce(params, out=self.center)
        self.center /= world.size

    def _step(self, params: Any, grad: Any, loss: Optional[float]) -> None:
        if self.local.apply(params, grad, self.lr, check_finite=self._checks_in_step()) is False:
            self._non_finite_gradient()  # before the pull's collective
        if (self.steps + 1) % self.period == 0:  # the base class counts the step after _step returns
            self._elastic_pull(params)

    def _elastic_pull(self, params: Any) -> None:
        """Zhang et al. eqs. (5)-(6) without the gradient term: workers and centre pull together."""
        world = self.workers
        if self._wire is not None:
            self._compressed_pull(params)
            return
        world.Allreduce(params, out=self._mean)
        # x_i <- x_i - alpha (x_i - c), with the centre before it moves, and c <- c + alpha sum_i (x_i - c)
        # = c + beta (mean - c) from the same (pre-pull) x_i: one pass in the fused loop (C or CUDA).
        elastic_pull(params, self.center, self._mean, world.size, self.alpha, self.beta, work=self._work)

    def _compressed_pull(self, params: Any) -> None:
        """The same pull with the mean of ``x_i - c`` exchanged through the codec: ``mean_i x_i - c`` is its mean."""
        world, diff = self.workers, self._mean
        self._xp.subtract(params, self.center, out=diff)
        self._wire.start(world, diff)
        diff *= self.alpha  # x_i <- x_i - alpha (x_i - c), exact as before: only the centre's move is compressed
        params -= diff
        self._wire.total(out=diff)
        diff *= self.beta / world.size
        self.center += diff  # c <- c + beta mean_i decode(x_i - c): the same bits on every rank
