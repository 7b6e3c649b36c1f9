"""LSGD's arithmetic on its own, without MPI: what synchronous and asynchronous LSGD share.

Teng et al., NeurIPS 2019; ALGORITHMS.md "LSGD".  The two algorithms differ
in who decides when to pull and where a leader's parameters come from (an
election collective and a Bcast in :mod:`~mpiopt.algorithms.lsgd`; a
server's reply in :mod:`~mpiopt.algorithms.async_lsgd`).  The rest is here,
written once:

- the hyperparameters, their defaults and their checks;
- the value that elects a leader, the running mean of a worker's recent
  losses, and the election rule (:func:`elect`);
- the local step combined with the pulls, in either pull form, and the
  proximal pull (:meth:`LSGDRule.step`; the equations are in the module
  docstring of :mod:`~mpiopt.algorithms.lsgd`);
- a worker's state over that rule (:class:`LSGDState`, a mixin).
"""

from __future__ import annotations

import math
from typing import Any, Callable, Dict, Iterable, Optional, Sequence, Tuple

import numpy as np

from ..arrays import array_module, empty_apart
from .schema import Hyperparameter, Schema, choice, in_range, optional, positive
from .local import LOCAL_SGD, LocalSGD, LocalStepState

__all__ = ["LSGDRule", "LSGDState", "PULL_FORMS", "LSGD_RULE", "default_period", "elect", "Pull"]

PULL_FORMS = ("paper", "convex")


def default_period(global_period: int) -> int:
    """The local pulls' period where none is given: a quarter of the global one (at least 1)."""
    return max(1, global_period // 4)

#: The keywords of LSGD's rule (synchronous and asynchronous), with the paper's local optimizer.
LSGD_RULE = Schema(
    Hyperparameter("pull_local", 0.1, in_range(0.0, 1.0), "pull towards the group's leader at a local pull (0: none)"),
    Hyperparameter("pull_global", 0.1, in_range(0.0, 1.0), "pull towards the global leader at a global pull (0: none)"),
    Hyperparameter("period", None, optional(positive(integer=True)), "steps between local pulls (default: global_period // 4)"),
    Hyperparameter("global_period", 16, positive(integer=True), "steps between global pulls, >= period"),
    Hyperparameter("pull_form", "paper", choice(*PULL_FORMS), "the pull as the paper writes it, or a convex combination"),
    Hyperparameter("proximal", 0.0, in_range(0.0, 1.0, high_open=True), "proximal pull towards the last leader between elections"),
    Hyperparameter("loss_window", 4, positive(integer=True), "losses in the running mean that elects the leaders"),
) + LOCAL_SGD.with_defaults(momentum=0.9, nesterov=True, weight_decay=1e-4)

#: A pull: ``(coefficient, fetch)``; ``fetch()`` returns the leader's
#: parameters, or None where this worker is the leader (its own pull would not move it).
Pull = Tuple[float, Callable[[], Optional[Any]]]


def elect(candidates: Iterable[Tuple[int, float]]) -> int:
    """The election rule: the rank with the lowest running-mean loss, ties to the lowest rank.

    ``candidates`` are ``(rank, loss)`` pairs; a NaN loss (a worker with no
    loss yet) is never elected.  Returns -1 when nobody can be.
    """
    finite = [(loss, rank) for rank, loss in candidates if np.isfinite(loss)]
    return min(finite)[1] if finite else -1


class LSGDRule:
    """A worker's LSGD arithmetic: hyperparameters, running-mean loss, the local step with its pulls.

    Parameters
    ----------
    pull_local, pull_global, period, global_period, pull_form, proximal, loss_window,
    momentum, dampening, nesterov, weight_decay
        As documented in :class:`~mpiopt.algorithms.lsgd.LSGD` (these are
        its defaults).

    Attributes
    ----------
    local : LocalSGD
        The local optimizer (its momentum buffer is state).
    recent_losses : numpy.ndarray
        Ring buffer of the last ``loss_window`` losses (state).
    losses_seen : int
        Losses recorded so far (state).
    """

    def __init__(
        self,
        *,
        pull_local: float = 0.1,
        pull_global: float = 0.1,
        period: Optional[int] = None,
        global_period: int = 16,
        pull_form: str = "paper",
        proximal: float = 0.0,
        loss_window: int = 4,
        momentum: float = 0.9,
        dampening: float = 0.0,
        nesterov: bool = True,
        weight_decay: float = 1e-4,
    ) -> None:
        self.pull_local = LSGD_RULE["pull_local"].validate(pull_local)
        self.pull_global = LSGD_RULE["pull_global"].validate(pull_global)
        self.global_period = LSGD_RULE["global_period"].validate(global_period)
        if period is None:
            period = default_period(self.global_period)
        self.period = LSGD_RULE["period"].validate(period)
        if self.period > self.global_period:
            raise ValueError(f"period must be <= global_period ({global_period}), got {period}")
        self.pull_form = LSGD_RULE["pull_form"].validate(pull_form)
        self.proximal = LSGD_RULE["proximal"].validate(proximal)
        self.loss_window = LSGD_RULE["loss_window"].validate(loss_window)
        self.local = LocalSGD(momentum, dampening, nesterov, weight_decay)
        self.recent_losses = np.zeros(self.loss_window)  # host floats
        self.losses_seen = 0
        self._pull: Optional[Any] = None  # "paper": the pull differences taken at x_t
        self._work: Optional[Any] = None

    def hyperparameters(self) -> Dict[str, Any]:
        return {
            "pull_local": self.pull_local,
            "pull_global": self.pull_global,
            "period": self.period,
            "global_period": self.global_period,
            "pull_form": self.pull_form,
            "proximal": self.proximal,
            "loss_window": self.loss_window,
            **self.local.hyperparameters(),
        }

    def allocate(self, params: Any) -> None:
        """Scratch space for ``params`` (call once before the first step)."""
        self.local.allocate(params)
        self._work = empty_apart(params)
        self._pull = empty_apart(params) if self.pull_form == "paper" else None

    # -- the election value ---------------------------------------------------------------
    def record_loss(self, loss: float) -> None:
        """Add this step's loss to the window (each algorithm first makes sure there is one)."""
        self.recent_losses[self.losses_seen % self.loss_window] = float(loss)
        self.losses_seen += 1

    def running_loss(self) -> float:
        """Mean of the last ``loss_window`` losses (fewer before the window fills; NaN before any)."""
        if not self.losses_seen:
            return math.nan
        return float(self.recent_losses[: min(self.losses_seen, self.loss_window)].mean())

    # -- the update -------------------------------------------------------------------------
    def step(
        self,
        params: Any,
        grad: Optional[Any],
        lr: float,
        pulls: Sequence[Pull],
        anchor: Callable[[], Optional[Any]],
    ) -> None:
        """The local step combined with ``pulls`` (local before global) in the order of ``pull_form``.

        "paper": every fetch before the local step, the differences taken at
        ``x_t`` and subtracted after it; "convex": the local step, then fetch
        and mix, one pull after the other.  ``grad=None`` applies the pulls
        alone.  ``anchor()``, asked right after the local step, is the
        proximal pull's target (the latest leader copy), or None for no
        proximal pull.
        """
        if self.pull_form == "paper":
            pulling = False
            for coeff, fetch in pulls:
                leader = fetch()
                if leader is not None:
                    self._add_difference(params, leader, coeff, first=not pulling)
                    pulling = True
            self._local_step(params, grad, lr, anchor)
            if pulling:
                params -= self._pull
        else:
            self._local_step(params, grad, lr, anchor)
            for coeff, fetch in pulls:
                leader = fetch()
                if leader is not None:
                    self._move_towards(params, leader, coeff)

    def _add_difference(self, params: Any, leader: Any, coeff: float, first: bool) -> None:
        """Paper form: accumulate ``coeff (x_t - x_leader)`` into the pull buffer."""
        target = self._pull if first else self._work
        array_module(params).subtract(params, leader, out=target)
        target *= coeff
        if not first:
            self._pull += target

    def _local_step(self, params: Any, grad: Optional[Any], lr: float, anchor: Callable[[], Optional[Any]]) -> None:
        """The local optimizer's step, then the proximal pull towards ``anchor()`` (none without ``grad``)."""
        if grad is None:
            return
        self.local.apply(params, grad, lr)
        if self.proximal:
            target = anchor()
            if target is not None:
                self._move_towards(params, target, self.proximal)

    def _move_towards(self, params: Any, leader: Any, coeff: float) -> None:
        """Pull ``params`` towards ``leader`` by ``coeff``, in the arithmetic of ``pull_form``."""
        xp, work = array_module(params), self._work
        if self.pull_form == "paper":
            xp.subtract(params, leader, out=work)  # x <- x - c (x - x_leader)
            work *= coeff
            params -= work
        else:
            xp.multiply(leader, coeff, out=work)  # x <- (1 - c) x + c x_leader
            params *= 1.0 - coeff
            params += work


def _from_rule(name: str) -> property:
    return property(lambda self: getattr(self.rule, name), doc=f"The rule's ``{name}`` (read only).")


class LSGDState(LocalStepState):
    """Mixin for an LSGD algorithm whose rule is ``self.rule``: its state attributes and its step with pulls.

    The class sets ``rule``, ``_leader`` (the latest leader copy, the
    proximal pull's target), ``last_local_leader`` and ``last_global_leader``
    (-1 before any pull), and lists ``momentum_buffer``, ``leader_copy``,
    ``recent_losses`` in ``state_arrays`` and ``losses_seen`` in
    ``state_scalars``.  The hyperparameters read as attributes
    (``alg.period``).
    """

    rule: LSGDRule
    lr: float
    _leader: Optional[Any]
    last_local_leader: int
    last_global_leader: int

    local = _from_rule("local")  # the local optimizer, whose momentum buffer is state
    pull_local = _from_rule("pull_local")
    pull_global = _from_rule("pull_global")
    period = _from_rule("period")
    global_period = _from_rule("global_period")
    pull_form = _from_rule("pull_form")
    proximal = _from_rule("proximal")
    loss_window = _from_rule("loss_window")

    @property
    def recent_losses(self) -> np.ndarray:
        return self.rule.recent_losses

    @property
    def losses_seen(self) -> int:
        return self.rule.losses_seen

    @losses_seen.setter
    def losses_seen(self, value: int) -> None:
        self.rule.losses_seen = int(value)

    # The leader copy is state only for the proximal pull; otherwise every pull replaces it before it is read.
    @property
    def leader_copy(self) -> Optional[Any]:
        return self._leader if self.rule.proximal else None

    @leader_copy.setter
    def leader_copy(self, value: Optional[Any]) -> None:
        if value is not None:
            self._leader[...] = value

    def _pull_and_step(self, params: Any, grad: Optional[Any], pulls: Sequence[Pull]) -> None:
        """:meth:`LSGDRule.step` with this algorithm's learning rate and proximal target."""
        self.rule.step(params, grad, self.lr, pulls, self._proximal_target)

    def _proximal_target(self) -> Optional[Any]:
        """The latest leader copy once there has been a leader; None before (no proximal pull)."""
        return self._leader if max(self.last_local_leader, self.last_global_leader) >= 0 else None
