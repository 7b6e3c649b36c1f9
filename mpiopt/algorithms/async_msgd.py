"""Async-MSGD: momentum SGD with stale gradients (Liu, Li, Shi, Zhou, Zhao, NeurIPS 2018).

The update (ALGORITHMS.md "Async-MSGD")

    x_{k+1} = x_k - eta g(x_{k - tau_k}; xi_k) + mu (x_k - x_{k-1})          (1)

is heavy-ball momentum where the gradient was computed at an iterate
``tau_k`` updates old.  It runs where ``x`` lives, once per arriving
gradient: on the parameter server of :func:`mpiopt.asyncrt.run_async`
(:meth:`AsyncMSGD.run`, real asynchrony, ``tau_k`` measured) or in its
one-process twin :func:`mpiopt.asyncrt.simulated.simulate`
(:meth:`AsyncMSGD.simulate`, ``tau_k`` fixed or random).  Both call the
same function, :meth:`AsyncMSGDRule.__call__`, which is the step of
:class:`~mpiopt.algorithms.local.LocalSGD` (torch.optim.SGD's momentum
rule, dampening 0).

Why torch's rule is (1)
-----------------------
``torch.optim.SGD`` keeps a buffer ``b``: ``b_0 = g_0``, ``b_k = mu b_{k-1} +
g_k`` and ``x_{k+1} = x_k - eta b_k``.  Then ``eta b_{k-1} = x_{k-1} - x_k``, so

    x_{k+1} = x_k - eta g_k - mu eta b_{k-1} = x_k - eta g_k + mu (x_k - x_{k-1}),

and the first step ``x_1 = x_0 - eta g_0`` is (1) with ``x_{-1} = x_0`` (no
momentum before the first update).  The two agree while ``eta`` is constant;
if a scheduler changes ``eta``, torch's form (ours) scales the whole buffer
by the new rate, (1) only the new gradient.

API (the protocol's ``step`` does not fit a server loop)
--------------------------------------------------------
>>> alg = mpiopt.create("async_msgd", topology, lr=0.01, momentum=0.5)
>>> alg.setup(params)
>>> result = alg.run(params, worker_fn, steps)       # collective; rank 0 serves
>>> result.histogram()                                # {staleness: count}
>>> alg.simulate(params, worker_fn, steps, delay=4)   # deterministic, no MPI

``worker_fn(params, step, out) -> loss`` writes a stochastic gradient for the
given (possibly stale, read-only) parameters into ``out``.  ``step(params,
grad)`` applies one gradient on this rank without communicating: the
server's update, with the base class's checks and accounting.  The momentum
buffer lives where the updates are applied, on rank 0; on the workers it
stays None.

Continuing and resuming
-----------------------
The server's version counter, the staleness histogram and the per-rank
counts are the algorithm's state (:attr:`AsyncMSGD.version`,
:attr:`~AsyncMSGD.staleness`, :attr:`~AsyncMSGD.applied`, the same on every
rank after a run): each ``run`` or ``simulate`` continues them, and each
rank's ``step`` numbers continue from its count.  ``run`` returns
quiescent, so between two runs ``state_dict()`` on every rank is the whole
state (the parameters are the caller's: on return they are the same on every
rank); a fresh instance that loaded it, given the saved parameters, runs on
as the first would have: from exactly those parameters, momentum and version
(in ``simulate``, bitwise, with the iterates its delays still read).
"""

from __future__ import annotations

from typing import Any, Callable, Dict, Mapping, Optional, Tuple, Union

import numpy as np

from ..asyncrt import (
    DEFAULT_MAX_SLEEP,
    SERVER,
    Arrival,
    AsyncResult,
    UntilFn,
    WorkerFn,
    agree_on_arguments,
    check_run_arguments,
    run_async,
)
from ..comm import Topology
from ..asyncrt.result import add_counts
from ..asyncrt.state import ServerStateMixin, state_array, state_count
from ..asyncrt.simulated import FixedDelay, RandomDelay, RecentIterates, simulate
from .base import BASE, AsynchronousAlgorithm, StepRecord
from .local import LOCAL_SGD, LocalSGD, LocalStepState
from .schema import Schema
from .registry import register

__all__ = ["AsyncMSGD", "AsyncMSGDRule"]


class AsyncMSGDRule:
    """The update (1) on its own, without MPI: an ``apply`` for :func:`~mpiopt.asyncrt.run_async` and its twin.

    Parameters
    ----------
    lr : float
        Step size ``eta`` (> 0).
    momentum : float
        ``mu`` in [0, 1).
    """

    def __init__(self, lr: float, momentum: float) -> None:
        self.lr = float(BASE["lr"].validate(lr))
        self.local = LocalSGD(momentum=momentum)

    @property
    def momentum(self) -> float:
        return self.local.momentum

    def allocate(self, params: np.ndarray) -> None:
        """Scratch space for ``params`` (call once before the first update)."""
        self.local.allocate(params)

    def __call__(self, params: np.ndarray, grad: np.ndarray, arrival: Optional[Arrival] = None) -> None:
        """(1): ``params`` is ``x_k``, ``grad`` is ``g(x_{k - tau_k})``; ``params`` becomes ``x_{k+1}``."""
        self.local.apply(params, grad, self.lr)


@register
class AsyncMSGD(ServerStateMixin, LocalStepState, AsynchronousAlgorithm):
    """Asynchronous momentum SGD on a parameter server.

    Parameters
    ----------
    topology : Topology
        World rank 0 serves; the other ranks compute gradients.
    lr : float
        Step size ``eta``.  Default 0.01.
    momentum : float
        ``mu`` in [0, 1).  Default 0.9, the synchronous MSGD value the paper
        starts from; its point is that ``mu`` must come down as the staleness
        grows (docs/async.md has the measured trade-off).
    nan_policy : {"raise"}
        A non-finite gradient raises ``FloatingPointError`` on the server
        (with :func:`mpiopt.abort_on_exception`, as in every mpiopt job, that
        ends all ranks).  ``"skip"`` is refused: the base class decides it
        with a collective, which a server applying one worker's gradient
        cannot call.

    Attributes
    ----------
    version : int
        The server's version: updates applied by every ``run`` and
        ``simulate`` so far (state; each continues it).
    staleness : numpy.ndarray
        Their staleness histogram, ``staleness[t]`` updates of staleness ``t`` (state).
    applied : numpy.ndarray
        Per world rank, its updates applied (state; ``simulate``'s one
        stream counts as rank 0's, as at world size 1).
    recent : RecentIterates
        The iterates ``simulate``'s delays may still read (state).
    """

    name = "async_msgd"
    listing_order = 70
    schema = BASE.with_defaults(lr=0.01) + Schema(LOCAL_SGD.with_defaults(momentum=0.9)["momentum"])
    state_arrays = ("momentum_buffer",)
    training_defaults = {"lr": 0.05, "momentum": 0.5}

    @classmethod
    def server_messages(cls, d: int, itemsize: int = 4) -> Optional[Tuple[float, ...]]:
        return (itemsize * d, itemsize * d)  # a gradient in, the parameters out

    def __init__(self, topology: Topology, **hyperparameters: Any) -> None:
        super().__init__(topology, **hyperparameters)  # lr is the rule's (the property below): set here
        if self.nan_policy != "raise":
            raise ValueError(
                f"nan_policy must be 'raise' for async_msgd (skipping is decided collectively, not asynchronously), got {self.nan_policy!r}"
            )
        self.rule = AsyncMSGDRule(self._values["lr"], self.momentum)
        self.version = 0
        self.staleness = np.zeros(0, dtype=np.int64)
        self.applied = np.zeros(topology.size, dtype=np.int64)
        self.recent = RecentIterates()

    # One learning rate for the rule and for schedulers that set ``alg.lr``.
    @property
    def lr(self) -> float:
        return self.rule.lr

    @lr.setter
    def lr(self, value: float) -> None:
        self.rule.lr = float(value)

    @property
    def local(self) -> LocalSGD:
        """The rule's local optimizer, whose momentum buffer is state."""
        return self.rule.local

    def _allocate(self, params: Any) -> None:
        self.rule.allocate(params)

    def _step(self, params: Any, grad: Any, loss: Optional[float]) -> None:
        self.rule(params, grad)

    def apply(self, params: np.ndarray, grad: np.ndarray, loss: Optional[float] = None) -> StepRecord:
        """The server's update with one gradient, on this rank alone (what :meth:`run`'s server does with each arrival)."""
        return self._apply_step(params, grad, loss)

    def _apply(self, params: np.ndarray, grad: np.ndarray, arrival: Arrival) -> None:
        # Through the base class's step for the NaN check and the per-update record (``alg.last``).
        self._apply_step(params, grad, loss=arrival.loss)

    def _count(self, result: AsyncResult) -> None:
        """Add a run's counts to the state (the result is the same on every rank)."""
        self.version = result.version
        self.staleness = add_counts(self.staleness, result.staleness)
        self.applied[: result.applied.size] += result.applied

    # -- the server's state, beside the base class's -----------------------------------------
    def _server_state(self) -> Dict[str, Any]:
        recent = self.recent.array
        return {
            "version": self.version,
            "staleness": self.staleness.copy(),
            "applied": self.applied.copy(),
            "recent_iterates": None if recent is None else recent.copy(),
        }

    def _server_loader(self, saved: Any) -> Callable[[], None]:
        if not isinstance(saved, Mapping):
            raise ValueError(f"server state must be a mapping, got {saved!r}")
        version = state_count(saved, "version")
        staleness = state_array(saved, "staleness", (None,), "iu").astype(np.int64)
        applied = state_array(saved, "applied", (self.topology.size,), "iu").astype(np.int64)
        recent = None
        if saved.get("recent_iterates") is not None:
            recent = state_array(saved, "recent_iterates", (None, self.num_params), "f").astype(self.dtype)
            if recent.shape[0] > version:
                raise ValueError(f"server state 'recent_iterates': {recent.shape[0]} iterates kept before version {version}")

        def restore() -> None:
            self.version, self.staleness, self.applied, self.recent.array = version, staleness, applied, recent

        return restore

    def _check_ready(self, params: np.ndarray) -> None:
        if self.num_params is None:
            raise RuntimeError(f"{type(self).__name__}.setup(params) must be called before running")
        self._check_flat("params", params)

    def run(
        self,
        params: np.ndarray,
        worker_fn: WorkerFn,
        steps: int,
        *,
        until: Optional[UntilFn] = None,
        max_sleep: float = DEFAULT_MAX_SLEEP,
    ) -> AsyncResult:
        """Train asynchronously on every rank of the world (a collective call).

        Parameters
        ----------
        params : numpy.ndarray
            Rank 0's are ``x_0``; on return every rank holds the final ones.
        worker_fn : callable
            ``worker_fn(params, step, out) -> loss``: this rank's gradient.
        steps : int
            Gradients this rank computes (ranks may differ; rank 0's is used
            only at world size 1, where it also computes).
        until, max_sleep
            See :func:`mpiopt.asyncrt.run_async`.

        The run continues the state (:attr:`version`, and each rank's
        ``step`` from its :attr:`applied` count), and adds its counts to it.

        Returns
        -------
        AsyncResult
            This run's staleness histogram and per-rank counts, and the
            server's version at its start and end, the same on every rank.

        Raises
        ------
        RuntimeError, TypeError, ValueError
            On every rank, when any rank is not set up or passes bad
            ``params`` or ``steps`` (the message names the ranks and values).
        """
        world = self.topology.world
        agree_on_arguments(world, "async_msgd.run", lambda: (self._check_ready(params), check_run_arguments(params, steps)))
        result = run_async(
            world, params, self._apply, worker_fn, steps, until=until, max_sleep=max_sleep,
            version=self.version, applied_before=self.applied.tolist(),
        )
        if world.size > 1 and world.rank != SERVER:
            self.steps += result.version - result.start_version  # the server counted them in ``step``
        self._count(result)
        return result

    def simulate(
        self,
        params: np.ndarray,
        worker_fn: WorkerFn,
        steps: int,
        *,
        delay: Union[int, FixedDelay, RandomDelay] = 0,
        until: Optional[UntilFn] = None,
    ) -> AsyncResult:
        """Deterministic mode on this rank alone: see :func:`mpiopt.asyncrt.simulated.simulate`.

        It continues this rank's copy of the state (:attr:`version`,
        :attr:`recent`) and adds its counts to it: ``k`` steps, then ``k``
        more (on this instance, or on one that loaded its ``state_dict``),
        are bitwise ``2k`` steps in one call.
        """
        self._check_ready(params)
        result = simulate(params, self._apply, worker_fn, steps, delay=delay, until=until, version=self.version, recent=self.recent)
        self._count(result)
        return result
