"""LSGD's arithmetic on its own, without MPI: what synchronous and asynchronous LSGD share.

The hyperparameters, the running-mean loss that elects leaders (:func:`elect`), the local step with its pulls
(:meth:`LSGDRule.step`) and a worker's state over that rule (:class:`LSGDState`).  Notes: docs/algorithm-notes.md.
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

#: The rule's own keywords (the rest are the local update's).
RULE_NAMES = tuple(name for name in LSGD_RULE.names() if name not in LOCAL_SGD)

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

    Attributes
    ----------
    local : LocalSGD
        The local optimizer (its momentum buffer is state).
    recent_losses : numpy.ndarray
        Ring buffer of the last ``loss_window`` losses (state).
    losses_seen : int
        Losses recorded so far (state).
    """

    def __init__(self, **values: Any) -> None:
        values = LSGD_RULE.complete(values, what="lsgd")
        for name in RULE_NAMES:
            setattr(self, name, values[name])
        if self.period is None:
            self.period = default_period(self.global_period)
        if self.period > self.global_period:
            raise ValueError(f"period must be <= global_period ({self.global_period}), got {self.period}")
        self.local = LocalSGD.from_values(values)
        self.recent_losses = np.zeros(self.loss_window)  # host floats
        self.losses_seen = 0
        self._pull: Optional[Any] = None  # "paper": the pull differences taken at x_t
        self._work: Optional[Any] = None

    def hyperparameters(self) -> Dict[str, Any]:
        return {**{name: getattr(self, name) for name in RULE_NAMES}, **self.local.hyperparameters()}

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


for _name in RULE_NAMES:  # the rule's values read as the algorithm's attributes (``alg.period``), read only
    setattr(LSGDState, _name, _from_rule(_name))
