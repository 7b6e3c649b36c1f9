"""LSGD: leader stochastic gradient descent, synchronous, with local and global leaders.

Teng, Gao, Chalus, Choromanska, Goldfarb and Weller, "Leader Stochastic
Gradient Descent for Distributed Training of Deep Learning Models",
NeurIPS 2019 (arXiv:1905.10395); ALGORITHMS.md "LSGD".

Each worker ``x_ji`` (worker ``i`` of group ``j``) minimises
``f(x_ji) + lambda/2 ||x_ji - xl_j||^2 + lambda_G/2 ||x_ji - xg||^2``: it is
pulled towards its local leader ``xl_j``, the worker of its group
(``topology.group``) with the lowest loss, and towards the global leader
``xg``, the lowest-loss worker of ``topology.world``.  The leaders are real
workers, not averages, so the stationary points are those of ``f``; EASGD's
average of workers sitting in symmetric minima can be a saddle or a maximum
(the paper's "curse of symmetry").  One group is single-leader LSGD.

Communication-efficient form: local steps, a local pull after every
``period``-th step (``tau``), a global pull after every ``global_period``-th
step (``tau_G``).  A pull is an election (:meth:`Comm.elect_min`: Allreduce
MINLOC of one (float64 loss, int32 rank) pair, 16 bytes with padding) and a
Bcast of the leader's parameters (4 bytes per float32 parameter) in the group
(local) or the world (global) communicator.  The leader is not moved by its
own pull (``x - x_leader = 0``) but still sends its parameters.

Election
--------
Each worker's loss is the running mean of the last ``loss_window`` losses
passed to ``step`` (the authors' code: the last 10 training losses; steps
skipped by ``nan_policy="skip"`` record none); ties go to the lowest rank,
and a worker whose mean is NaN is never elected.

Pull forms
----------
``pull_form="paper"`` (default), the paper's update::

    x_{t+1} = x_t - eta d_t - lambda (x_t - xl_t) - lambda_G (x_t - xg_t)

where ``eta d_t`` is the local optimizer's step from ``x_t`` and the leaders'
parameters ``xl_t, xg_t`` are also those of step ``t`` (broadcast before this
step's local step, so the leader is elected by losses measured at the very
point it sends): the gradient step and the pulls are simultaneous, and a step
due for both pulls takes both differences from the same ``x_t``.

``pull_form="convex"``, the authors' code: the local step first, then
``x <- (1 - c) x + c xl`` with ``c = pull_local``, then (when due)
``x <- (1 - c_G) x + c_G xg`` with ``c_G = pull_global``, each mix from the
parameters as they are at that moment (the leader's too).

With ``c = lambda``, ``(1 - c) x + c xl = x - lambda (x - xl)``: a single
pull is the same algebraic update in both forms.  What differs is where it
is applied: the paper pulls ``x_t`` (the point where the gradient was taken)
towards the leader's ``x_t``; the code pulls the point after the local step
towards the leader's point after its local step.  Two pulls on one step add
in the paper (``lambda + lambda_G`` when the leaders coincide) and compose in
the code (``1 - (1 - c)(1 - c_G)``).  The rounding differs too.

Proximal pull
-------------
With ``proximal = p > 0``, every local step is followed by a pull
``x <- x - p (x - x_copy)`` (``(1 - p) x + p x_copy`` in the convex form)
towards ``x_copy``, the leader's parameters received at the latest pull (the
global leader's when both pulls fell on that step); none before the first
pull.  The authors' code pulls by ``p1 / tau`` towards the last local leader
and by ``p2 / tau_G`` towards the last global leader after each local step;
``proximal`` is that per-step strength, towards one copy.

Order within a step
-------------------
Record the loss; ("paper") elect, receive the leaders and take the pull
differences at ``x_t``; the local SGD step; the proximal pull; then the pulls
due (local before global).

With one group (``topology.num_groups == 1``) the local and global leaders
are the same worker (same ranks, losses and tie order), so a step due for
both pulls elects and broadcasts once.  ``pull_local=0`` (or
``pull_global=0``) turns that pull off, traffic included; with one group,
``pull_local=0`` is the authors' single-leader set-up.

Example
-------
>>> topology = mpiopt.Topology(group_size=4)      # local leaders in groups of 4
>>> alg = mpiopt.create("lsgd", topology, lr=0.1, global_period=16)
>>> alg.setup(params)
>>> for batch in data:
...     loss, grad = compute(params, batch)
...     alg.step(params, grad, loss=loss)        # loss is required (Algorithm: "Errors on one rank")
>>> alg.last_global_leader                       # world rank of the latest global leader
"""

from __future__ import annotations

import math
from functools import partial
from typing import Any, Dict, List, Mapping, Optional, Tuple

from ..arrays import empty_apart
from ..comm import Comm, Topology
from ..comm.ledger import Call
from .base import BASE, SynchronousAlgorithm
from ..comm.communicator import ELECTION_BYTES
from .lsgd_rule import LSGD_RULE, PULL_FORMS, LSGDRule, LSGDState, default_period
from .registry import register
from .resize import FOLLOW, NO_LEADER

def periods(hyper: Mapping[str, Any]) -> Tuple[int, int]:
    """``(period, global_period)`` of LSGD's hyperparameters, the local one defaulted."""
    global_period = int(hyper["global_period"])
    return (default_period(global_period) if hyper["period"] is None else int(hyper["period"])), global_period


def pulls_due(
    step: int, pull_local: float, pull_global: float, period: int, global_period: int, groups: int
) -> List[Tuple[str, float, bool]]:
    """``(scope, coefficient, fetch)`` of the pulls after ``step``, local first, for ``groups`` groups.

    ``fetch`` is False for a global pull that follows a local one in a
    single group: the leader and its parameters are already at hand.
    """
    due = []
    if pull_local and step % period == 0:
        due.append(("local", pull_local, True))
    if pull_global and step % global_period == 0:
        due.append(("global", pull_global, not due or groups > 1))
    return due

__all__ = ["LSGD", "PULL_FORMS"]


@register
class LSGD(LSGDState, SynchronousAlgorithm):
    """Synchronous leader SGD (Teng et al. 2019) with local (group) and global (world) leaders.

    Parameters
    ----------
    topology : Topology
        Communicators: local leaders within ``topology.group``, the global
        leader over ``topology.world``.
    lr : float
        Learning rate of the local steps (authors' script: 0.1).
    pull_local, pull_global : float
        ``lambda`` and ``lambda_G`` in [0, 1] (authors: 0.1 and 0.1); 0 turns
        that pull off.
    period : int, optional
        ``tau``, steps between local pulls; default ``global_period // 4``
        (at least 1), as in the authors' scripts.
    global_period : int
        ``tau_G``, steps between global pulls, >= ``period`` (paper: 4, 16
        or 64; default 16).
    pull_form : {"paper", "convex"}
        The paper's simultaneous update or the authors' code's convex mix
        after the local step (module docstring).
    proximal : float
        Per-step pull in [0, 1) towards the latest leader copy; 0 (default)
        turns it off.
    loss_window : int
        Number of recent losses whose mean elects the leaders (>= 1).
    momentum, dampening, nesterov, weight_decay
        The local optimizer, as in ``torch.optim.SGD``; defaults from the
        authors' scripts (Nesterov momentum 0.9, weight decay 1e-4).
    nan_policy : {"raise", "skip"}
        See :class:`~mpiopt.algorithms.base.Algorithm`.

    Attributes
    ----------
    rule : LSGDRule
        The hyperparameters, the running-mean loss and the local step with
        its pulls (shared with :class:`~mpiopt.algorithms.async_lsgd.AsyncLSGD`).
    last_local_leader, last_global_leader : int
        World rank of the latest local (this rank's group) and global
        leader; -1 before the first such pull.
    """

    name = "lsgd"
    inner_role = "local"
    inner_rule = ("x <- inner(x, g) - lambda (x - xl) - lambda_G (x - xg) when due  "
                  "(the paper: x - eta g - lambda (x - xl) - lambda_G (x - xg), inner = SGD)")
    listing_order = 20
    schema = BASE.with_defaults(lr=0.1) + LSGD_RULE
    evaluates = "average"
    state_arrays = ("momentum_buffer", "leader_copy", "recent_losses")
    state_scalars = ("losses_seen", "last_local_leader", "last_global_leader")
    # The loss history describes the parameters the new rank takes over; leaders named ranks of the old world (with
    # proximal > 0 the proximal pull then waits for the next election, at most ``period`` steps).
    resize_rules = {
        "momentum_buffer": FOLLOW, "leader_copy": FOLLOW, "recent_losses": FOLLOW, "losses_seen": FOLLOW,
        "last_local_leader": NO_LEADER, "last_global_leader": NO_LEADER,
    }
    wire_summary = "16-byte election + 4d Bcast per pull"
    update_goal = 1.5

    @classmethod
    def _plan(cls, d: int, ranks: int, hyper: Mapping[str, Any], groups: List[int], steps: range, itemsize: int) -> List[Call]:
        local = global_ = 0
        period, global_period = periods(hyper)
        for step in steps:
            for scope, _, fetch in pulls_due(step, hyper["pull_local"], hyper["pull_global"], period, global_period, len(groups)):
                local += scope == "local"
                global_ += scope == "global" and fetch
        n = itemsize * d
        calls = []
        for g in groups:  # an election and a Bcast in every group of more than one rank, the groups side by side
            if g > 1 and local:
                calls += [Call("allreduce", ELECTION_BYTES, g, local, 0), Call("bcast", n, g, local, 1)]
        if global_:
            calls += [Call("allreduce", ELECTION_BYTES, ranks, global_, 2), Call("bcast", n, ranks, global_, 3)]
        return calls

    def _use_inner(self, inner: Any) -> None:
        self.rule.local = inner

    @classmethod
    def plan_cycle(cls, hyper: Mapping[str, Any]) -> int:
        period, global_period = periods(hyper)
        return period * global_period // math.gcd(period, global_period)

    def __init__(self, topology: Topology, **hyperparameters: Any) -> None:
        super().__init__(topology, **hyperparameters)
        self.rule = LSGDRule(**LSGD_RULE.pick(self._values))
        self.last_local_leader = -1
        self.last_global_leader = -1
        self._leader: Optional[Any] = None  # the latest leader's parameters (Bcast buffer)

    def hyperparameters(self) -> Dict[str, Any]:
        return self.rule.hyperparameters()

    def running_loss(self) -> float:
        """Mean of the last ``loss_window`` losses (fewer before the window fills; NaN before any): the election's value."""
        return self.rule.running_loss()

    # -- the algorithm --------------------------------------------------------------------
    def _allocate(self, params: Any) -> None:
        self.rule.allocate(params)
        self._leader = empty_apart(params)

    def _step(self, params: Any, grad: Any, loss: Optional[float]) -> None:
        """One step in the order of the module docstring ("Order within a step")."""
        if loss is None:
            # Found on this rank alone, while the others may be electing a leader.
            self.topology.raise_or_abort(ValueError(
                f"{self.name}: step() needs this rank's training loss ({self.loss_call}): "
                "the lowest running-mean loss elects the leaders"
            ))
        self.rule.record_loss(loss)
        due = self._pulls_due(self.steps + 1)  # the base class counts the step after _step returns
        self._pull_and_step(params, grad, [(coeff, partial(self._fetch_leader, params, scope, fetch)) for scope, coeff, fetch in due])

    def _pulls_due(self, step: int) -> List[Tuple[str, float, bool]]:
        """``(scope, coefficient, fetch)`` of the pulls after ``step`` (:func:`pulls_due`)."""
        rule = self.rule
        return pulls_due(step, rule.pull_local, rule.pull_global, rule.period, rule.global_period, self.topology.num_groups)

    def _fetch_leader(self, params: Any, scope: str, fetch: bool) -> Optional[Any]:
        """Elect the leader of ``scope`` and receive its parameters; None where this rank leads."""
        me = self.topology.rank
        if not fetch:
            self.last_global_leader = self.last_local_leader
            return self._leader if self.last_global_leader != me else None
        comm: Comm = self.topology.group if scope == "local" else self.topology.world
        _, root = comm.elect_min(self.running_loss())
        if comm.rank == root and not self.proximal:
            comm.Bcast(params, root=root)  # the leader reads its own copy only for the proximal pull: send x itself
        else:
            if comm.rank == root:
                self._leader[...] = params
            comm.Bcast(self._leader, root=root)
        if scope == "local":
            self.last_local_leader = self.topology.group_ranks[root]
            leader = self.last_local_leader
        else:
            self.last_global_leader = leader = root
        return self._leader if leader != me else None
