"""DaSGD: local SGD whose model averaging runs behind the next steps' computation.

Zhou, Li, Zhou, Wang and Liu, "DaSGD: Squeezing SGD Parallelization
Performance in Distributed Training Using Delayed Averaging", 2020
(arXiv:2006.00441); ALGORITHMS.md "DaSGD".

Every worker runs local momentum SGD (:class:`~mpiopt.algorithms.local.LocalSGD`).
After step ``k``, for ``k`` a multiple of the period ``tau``, it copies its
weights ``w_k`` into a snapshot and starts a nonblocking ``Iallreduce`` of
it; steps ``k+1 .. k+d`` (``d = delay_steps``) run locally while the
average travels, and after step ``k+d`` the average is merged:

- ``merge="delayed"`` (the paper's rule, default):
  ``w <- avg(w_k) + (w_{k+d} - w_k)``, the delayed average plus this
  worker's own progress since the snapshot;
- ``merge="proportion"`` (the authors' code):
  ``w <- p w_{k+d} + (1 - p) avg(w_k)`` with ``p = update_proportion``.

``d = 0`` is local SGD with blocking averaging every ``tau`` steps, and
``tau = 1, d = 0`` is synchronous model averaging.  Traffic: 4 bytes per
parameter every ``tau`` steps (one Allreduce), hidden behind ``d`` steps of
computation when the MPI library moves the data while the worker computes.

Progress
--------
MPI implementations advance a nonblocking collective only inside MPI calls,
and one call advances it only so far: one ``Test`` per step hides part of
an averaging, several back-to-back ``Test`` calls (cheap when there is
nothing to do) hide most of it (docs/benchmarks-averaging.md).  A *poke* is
``tests_per_poke`` ``Test`` calls.  Who pokes:

- ``progress="test"`` (default): one poke per step, plus whatever the
  training loop adds with :meth:`DaSGD.progress_hook` (e.g. after each
  layer's backward pass);
- ``progress="thread"``: a helper thread pokes every ``progress_interval``
  seconds while an averaging is in flight, sleeping in between (needs
  ``MPI_THREAD_MULTIPLE``, which mpi4py requests by default; not for GPU
  buffers staged through host memory, whose copy back would run in the
  helper thread);
- ``progress="none"``: nobody until the merge's ``Wait``; for MPICH's own
  progress thread (``MPICH_ASYNC_PROGRESS=1`` at launch, needs
  ``MPI_THREAD_MULTIPLE``), which spins and so needs a spare core per rank.

docs/benchmarks-averaging.md has the measurements.

Example
-------
>>> alg = mpiopt.create("dasgd", topology, lr=0.1, period=4, delay_steps=1)
>>> alg.setup(params)
>>> for batch in data:
...     loss, grad = compute(params, batch)
...     alg.step(params, grad, loss=loss)
>>> alg.finish(params)      # merges an average still in flight
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any, Dict, List, Mapping, Optional

from ..arrays import empty_apart
from ..comm import Topology
from ..comm.ledger import Call
from ..kernels.update import MERGE_RULES, Merge, merge_average
from .base import BASE, SynchronousAlgorithm
from .inflight import PROGRESS, InFlight, PendingBuffer, check_progress
from .local import LOCAL_SGD, LocalSGD, LocalStepState
from .schema import Hyperparameter, Schema, choice, in_range, positive
from .registry import register
from .resize import COPY, FOLLOW, RESCALE

__all__ = ["DaSGD"]


@register
class DaSGD(LocalStepState, SynchronousAlgorithm):
    """Delayed-averaging SGD (Zhou et al. 2020) over ``topology.world``.

    Parameters
    ----------
    topology : Topology
        Communicators; models are averaged over ``topology.world``.
    lr : float
        Learning rate of the local steps.
    period : int
        ``tau``: an averaging starts after every ``period``-th step (>= 1).
    delay_steps : int
        ``d``: local steps run while the average is in flight, ``0 <= d <
        period``; 0 averages at once (blocking local SGD).
    merge : {"delayed", "proportion"}
        Merge rule (module docstring): the paper's ``avg(w_k) + w_{k+d} -
        w_k`` or the authors' code's ``p w_{k+d} + (1-p) avg(w_k)``.
    update_proportion : float
        ``p`` in [0, 1] of ``merge="proportion"`` (authors' code: 0.25).
    progress : {"test", "thread", "none"}
        Who pokes the averaging in flight (module docstring): ``"test"`` one
        poke per step (and :meth:`progress_hook` calls of the training loop),
        ``"thread"`` a helper thread, ``"none"`` nobody (MPICH's
        ``MPICH_ASYNC_PROGRESS=1`` thread, or the merge's ``Wait``).
    progress_interval : float
        Seconds between the helper thread's pokes (``progress="thread"``).
    tests_per_poke : int
        ``Test`` calls per poke (see the module docstring for why more than one).
    momentum, dampening, nesterov, weight_decay
        The local optimizer, as in ``torch.optim.SGD``; defaults from the
        authors' code (momentum 0.9, weight decay 0.01).
    nan_policy : {"raise", "skip"}
        See :class:`~mpiopt.algorithms.base.Algorithm`.

    Notes
    -----
    :meth:`state_dict` completes an average in flight (``Wait``) but keeps it
    unmerged in the state, so a run resumed from it merges at the same step
    and continues bit for bit.  :meth:`finish` merges it at once.
    """

    name = "dasgd"
    inner_role = "local"
    inner_rule = ("w_i <- inner(w_i, g_i); after step k+d w_i <- avg(w_k) + (w_i - w_i,k)  "
                  "(the paper: local momentum SGD steps, inner = SGD)")
    listing_order = 30
    schema = BASE.with_defaults(lr=0.1) + Schema(
        Hyperparameter("period", 4, positive(integer=True), "steps between averagings (tau)"),
        Hyperparameter("delay_steps", 1, positive(allow_zero=True, integer=True), "steps an averaging stays in flight, < period"),
        Hyperparameter("merge", "delayed", choice(*MERGE_RULES), "how the late average is merged into the parameters"),
        Hyperparameter("update_proportion", 0.25, in_range(0.0, 1.0), "merge='proportion': the weight of the local progress"),
    ) + PROGRESS + LOCAL_SGD.with_defaults(momentum=0.9, weight_decay=0.01)
    evaluates = "average"
    fused_gradient_check = True
    state_arrays = ("momentum_buffer", "pending_snapshot", "pending_sum")
    state_scalars = ("merge_step",)
    # The merge divides pending_sum by M and must find the old ranks' average; an averaging in flight is merged at
    # its step, each new rank adding its own progress since its snapshot.
    resize_rules = {"momentum_buffer": FOLLOW, "pending_snapshot": FOLLOW, "pending_sum": RESCALE, "merge_step": COPY}
    wire_summary = "4d every `period` steps, hidden"
    update_goal = 1.5

    periodic_allreduce = "period"

    @classmethod
    def _plan(cls, d: int, ranks: int, hyper: Mapping[str, Any], groups: List[int], steps: range, itemsize: int) -> List[Call]:
        # The periodic Allreduce, nonblocking: in flight across delay_steps steps.
        calls = super()._plan(d, ranks, hyper, groups, steps, itemsize)
        return [replace(call, op="iallreduce", overlap_steps=int(hyper["delay_steps"])) for call in calls]

    def __init__(self, topology: Topology, **hyperparameters: Any) -> None:
        super().__init__(topology, **hyperparameters)
        if self.delay_steps >= self.period:
            raise ValueError(f"delay_steps must be < period ({self.period}): the next averaging would start first; got {self.delay_steps}")
        self.local = LocalSGD.from_values(self._values)
        #: Step after which the average in flight is merged; 0 when none is pending.
        self.merge_step = 0
        self._snapshot: Optional[Any] = None  # w_k, kept for the delayed rule's merge (the proportion rule needs none)
        self._sum: Optional[Any] = None  # w_k, then (in-place Iallreduce) its sum over the ranks
        self._inflight = InFlight()  # the Iallreduce started and not yet completed, and its progress thread

    # -- state ---------------------------------------------------------------------------
    # momentum_buffer comes from LocalStepState; the snapshot and the received
    # sum are state only while an average is pending, scratch otherwise.
    pending_snapshot = PendingBuffer("_snapshot", lambda alg: alg.merge_step > 0)
    pending_sum = PendingBuffer("_sum", lambda alg: alg.merge_step > 0)

    @property
    def in_flight(self) -> bool:
        """Whether an Iallreduce has been started and not yet completed."""
        return self._inflight.active

    def state_dict(self) -> Dict[str, Any]:
        """As :meth:`Algorithm.state_dict`, after completing (not merging) an average in flight."""
        self._complete()
        return super().state_dict()

    def load_state_dict(self, state: Mapping[str, Any], *, override_hyperparameters: bool = False) -> None:
        """As :meth:`Algorithm.load_state_dict`; a pending average is merged at its saved ``merge_step``."""
        if self.in_flight:
            raise RuntimeError("dasgd: load_state_dict() while an averaging is in flight; call finish(params) first")
        needed = ("pending_snapshot", "pending_sum") if self.merge == "delayed" else ("pending_sum",)
        if state.get("scalars", {}).get("merge_step") and any(state["arrays"].get(k) is None for k in needed):
            raise ValueError("dasgd state has a pending merge (merge_step > 0) but lacks its snapshot or sum")
        super().load_state_dict(state, override_hyperparameters=override_hyperparameters)

    # -- the algorithm --------------------------------------------------------------------
    def _allocate(self, params: Any) -> None:
        check_progress(self.name, self.progress, self.topology, params)
        self.local.allocate(params)
        self._snapshot = empty_apart(params) if self.merge == "delayed" else None
        self._sum = empty_apart(params)

    def _step(self, params: Any, grad: Any, loss: Optional[float]) -> None:
        step = self.steps + 1  # the base class counts the step after _step returns
        starts = step % self.period == 0
        merges = step == self.merge_step  # an average started delay_steps > 0 steps ago (never at a start)
        if merges:
            self._complete()  # the update merges it, so it must be complete first
        # The update's own pass writes w_k into the snapshot (the proportion rule keeps none) and the
        # Iallreduce's buffer, or merges the average: neither makes a pass of its own over the parameters.
        starts_into = tuple(buffer for buffer in (self._snapshot, self._sum) if buffer is not None) if starts else None
        finite = self.local.apply(
            params, grad, self.lr, copy_to=starts_into,
            merge=self._pending_merge() if merges else None, check_finite=self._checks_in_step(),
        )
        if finite is False:
            self._non_finite_gradient()  # before this step's averaging starts
        if merges:
            self.merge_step = 0
        if starts:
            self._start(step)
        if step == self.merge_step:  # delay_steps = 0: the average of this very step
            self._complete()
            self._merge(params)
        elif self.progress == "test":
            self.progress_hook()

    def _start(self, step: int) -> None:
        """Start summing ``w_k`` over the ranks: an in-place ``Iallreduce`` of its copy in the sum buffer.

        In place, so that MPI makes no copy of a send buffer (a pass over the
        parameters); the snapshot keeps ``w_k`` for the delayed rule's merge.
        """
        threaded = self.progress == "thread" and self.delay_steps
        self._inflight.start(
            self.topology.world.Iallreduce(self._sum), thread_interval=self.progress_interval if threaded else None,
            tests=self.tests_per_poke, name="dasgd-progress",
        )
        self.merge_step = step + self.delay_steps

    def _complete(self) -> None:
        """Wait for the average in flight, if any (the sum stays unmerged)."""
        self._inflight.complete()

    def _merge(self, params: Any) -> None:
        """Merge the received average into ``params`` (ALGORITHMS.md "DaSGD", merge rule).

        ``delayed``: ``w <- avg(w_k) + (w_{k+d} - w_k)``, exactly ``avg(w_k)`` when ``d = 0``;
        ``proportion``: ``w <- p w_{k+d} + (1 - p) avg(w_k)``.  One fused pass
        (:func:`~mpiopt.kernels.update.merge_average`; with ``d > 0`` the step's
        update makes it instead); the sum is scratch afterwards.
        """
        merge_average(params, *self._pending_merge())
        self.merge_step = 0

    def _pending_merge(self) -> Merge:
        """The merge of the received sum (``merge_average``'s arguments after the parameters)."""
        return Merge(self._snapshot, self._sum, self.topology.world.size, self.merge, self.update_proportion)

    def progress_hook(self) -> bool:
        """Poke the average in flight (``tests_per_poke`` ``Test`` calls); True when none is left in flight.

        Cheap when nothing is in flight: a training loop may call it as often
        as it likes, e.g. after each layer's backward pass.  With
        ``progress="thread"`` it only reports: the helper thread pokes.
        """
        return self._inflight.poke(self.tests_per_poke)

    def _finish(self, params: Any) -> None:
        if self.merge_step:
            self._complete()
            self._merge(params)
