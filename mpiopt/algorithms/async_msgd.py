"""Async-MSGD: momentum SGD with stale gradients (Liu, Li, Shi, Zhou, Zhao, NeurIPS 2018).

``x_{k+1} = x_k - eta g(x_{k - tau_k}) + mu (x_k - x_{k-1})`` (1) on a parameter server (world rank 0), with a
single-process twin (``simulate``) that gives the same bits for the same arrival order.  Notes: docs/algorithm-notes.md.
"""

from __future__ import annotations

from typing import Any, Callable, Dict, Mapping, Optional, Sequence, Tuple, Union

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
from .survival import ServerSurvival

__all__ = ["AsyncMSGD", "AsyncMSGDRule"]


class AsyncMSGDRule:
    """The update (1) on its own, without MPI: an ``apply`` for :func:`~mpiopt.asyncrt.run_async` and its twin."""

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
class AsyncMSGD(ServerSurvival, ServerStateMixin, LocalStepState, AsynchronousAlgorithm):
    """Asynchronous momentum SGD on a parameter server.

    With ``Topology(on_failure="shrink")`` the server drops a lost worker and the others go on (a lost server ends
    the run: :class:`~mpiopt.asyncrt.ServerLost`); :attr:`applied` then counts for the survivors only.

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
        self.dropped = []  # the losses its runs survived (ServerSurvival)

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

    def _count(self, result: AsyncResult, kept: Optional[Sequence[int]] = None) -> None:
        """Add a run's counts to the state (the result is the same on every rank); ``kept``: the survivors' ranks in
        the run's world, where ranks were lost during it."""
        self.version = result.version
        self.staleness = add_counts(self.staleness, result.staleness)
        applied = result.applied if kept is None else result.applied[list(kept)]
        self.applied[: applied.size] += applied

    def _keep_ranks(self, kept: Sequence[int]) -> None:
        self.applied = self.applied[kept]

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
        """Train asynchronously on every rank of the world (a collective call): ``steps`` gradients of this rank.

        ``worker_fn(params, step, out) -> loss`` is this rank's gradient; rank 0's
        ``params`` are ``x_0`` and every rank ends with the final ones.  The run
        continues the state (:attr:`version`, :attr:`applied`) and returns its
        staleness histogram and counts, the same on every rank; bad arguments on
        any rank raise on every rank (``until``, ``max_sleep``: :func:`mpiopt.asyncrt.run_async`).
        With ``on_failure="shrink"`` a lost worker is dropped and the run goes on
        without it (the world shrinks: :attr:`dropped`); a lost server raises
        :class:`~mpiopt.asyncrt.ServerLost` on every survivor.
        """

        def launch(survivors: Any) -> AsyncResult:
            world = self.topology.world
            agree_on_arguments(world, "async_msgd.run", lambda: (self._check_ready(params), check_run_arguments(params, steps)))
            return run_async(world, params, self._apply, worker_fn, steps, until=until, max_sleep=max_sleep,
                             version=self.version, applied_before=self.applied.tolist(), survivors=survivors)

        result = self._run_surviving(launch)
        world = self.topology.world
        if world.size > 1 and world.rank != SERVER:
            self.steps += result.version - result.start_version  # the server counted them in ``step``
        self._count(result, self._kept_since_run)
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
