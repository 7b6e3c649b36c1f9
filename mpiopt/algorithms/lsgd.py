"""LSGD: leader stochastic gradient descent, synchronous, with local and global leaders.

Teng et al., "Leader Stochastic Gradient Descent for Distributed Training of Deep Learning Models", NeurIPS 2019
(arXiv:1905.10395): the lowest running-mean loss elects a leader per group and one over the world; the others pull.
Notes: docs/algorithm-notes.md.
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
    islands_refusal = ("it is node-aware already: each node's ranks elect a local leader among themselves (pull_local) and "
                       "the world a global one, and an island would hide the very workers it elects among")
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
        """One step in the order of docs/algorithm-notes.md ("Order within a step")."""
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
