"""DaSGD: local SGD whose model averaging runs behind the next steps' computation.

Zhou et al., "DaSGD: Squeezing SGD Parallelization Performance in Distributed Training Using Delayed Averaging",
2020 (arXiv:2006.00441): an Iallreduce of ``w_k`` starts after every ``period``-th step and is merged ``delay_steps`` later.
Notes: docs/algorithm-notes.md.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any, Dict, List, Mapping, Optional

from ..arrays import empty_apart
from ..comm import Topology
from ..comm.ledger import Call
from ..kernels.update import MERGE_RULES, Merge, merge_average
from .base import BASE, SynchronousAlgorithm
from .compressed import CODEC, FEEDBACK, RESIDUAL, SHARED, Compressed
from .inflight import PROGRESS, InFlight, PendingBuffer, check_progress, progress_rounds
from .local import LOCAL_SGD, LocalSGD, LocalStepState
from .schema import Hyperparameter, Schema, choice, in_range, positive
from .registry import register
from .resize import COPY, FOLLOW, RESCALE

__all__ = ["DaSGD"]


@register
class DaSGD(Compressed, LocalStepState, SynchronousAlgorithm):
    """Delayed-averaging SGD (Zhou et al. 2020) over its workers (the world's ranks, or islands).

    Notes
    -----
    :meth:`state_dict` completes an average in flight (``Wait``) but keeps it
    unmerged in the state, so a run resumed from it merges at the same step
    and continues bit for bit.  :meth:`finish` merges it at once.  With a
    ``codec`` the ranks send ``w_k - last_average`` (the last merged average,
    the same on every rank) and the new average is ``last_average`` plus the
    decoded mean difference.
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
    ) + CODEC + FEEDBACK + PROGRESS + LOCAL_SGD.with_defaults(momentum=0.9, weight_decay=0.01)
    evaluates = "average"
    fused_gradient_check = True
    islands_refusal = None
    state_arrays = ("momentum_buffer", "pending_snapshot", "pending_sum", "last_average", "codec_residual")
    state_scalars = ("merge_step",)
    # A survivor of a lost rank drops the averaging in flight (it died with the rank); each keeps its own progress.
    survival_resets = {"merge_step": 0, "pending_snapshot": None, "pending_sum": None}
    # The merge divides pending_sum by M and must find the old ranks' average; an averaging in flight is merged at
    # its step, each new rank adding its own progress since its snapshot.  A codec's pending_sum is the sum of the
    # decoded differences (rescaled alike), last_average the same on every rank, the residuals owed to the mean.
    resize_rules = {
        "momentum_buffer": FOLLOW, "pending_snapshot": FOLLOW, "pending_sum": RESCALE, "merge_step": COPY,
        "last_average": SHARED, "codec_residual": RESIDUAL,
    }
    wire_summary = "4d every `period` steps, hidden (a codec: its payload of w_k - last average, all-gathered)"
    update_goal = 1.5

    periodic_allreduce = "period"

    @classmethod
    def _plan(cls, d: int, ranks: int, hyper: Mapping[str, Any], groups: List[int], steps: range, itemsize: int) -> List[Call]:
        # The periodic Allreduce, nonblocking: in flight across delay_steps steps, as far as MPI is made to progress it.
        delay = int(hyper["delay_steps"])
        flight = dict(overlap_steps=delay, progress_rounds=progress_rounds(hyper["progress"], delay))
        calls = super()._plan(d, ranks, hyper, groups, steps, itemsize)
        calls = [replace(call, op="iallreduce", **flight) for call in calls]
        coded = cls._codec_call(d, ranks, hyper, calls[0].count, **flight)
        return calls if coded is None else [coded]

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
        self.last_average: Optional[Any] = None  # with a codec: the last merged average (the same on every rank)
        self._wire: Optional[Any] = None  # the codec's exchange
        self._undecoded = False  # a codec's payloads arrived (or are arriving) and are not yet summed into _sum

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
        self._wire = self._allocate_codec(params)
        if self._wire is not None:  # the first differences are to the ranks' mean: never raw parameters on the wire
            self.last_average = empty_apart(params)
            self.workers.Allreduce(params, out=self.last_average)
            self.last_average /= self.workers.size

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
        if self._wire is None:
            request = self.workers.Iallreduce(self._sum)
        else:
            self._sum -= self.last_average  # w_k - last average
            request, self._undecoded = self._wire.start(self.workers, self._sum, nonblocking=True), True
        self._inflight.start(
            request, thread_interval=self.progress_interval if threaded else None,
            tests=self.tests_per_poke, name="dasgd-progress",
        )
        self.merge_step = step + self.delay_steps

    def _complete(self) -> None:
        """Wait for the average in flight, if any (the sum stays unmerged; a codec's payloads decoded and summed)."""
        self._inflight.complete()
        if self._undecoded:
            self._wire.total(out=self._sum)
            self._undecoded = False

    def _merge(self, params: Any) -> None:
        """Merge the received average into ``params`` (docs/algorithms.md "DaSGD", merge rule).

        ``delayed``: ``w <- avg(w_k) + (w_{k+d} - w_k)``, exactly ``avg(w_k)`` when ``d = 0``;
        ``proportion``: ``w <- p w_{k+d} + (1 - p) avg(w_k)``.  One fused pass
        (:func:`~mpiopt.kernels.update.merge_average`; with ``d > 0`` the step's
        update makes it instead); the sum is scratch afterwards.
        """
        merge_average(params, *self._pending_merge())
        self.merge_step = 0

    def _pending_merge(self) -> Merge:
        """The merge of the received sum (``merge_average``'s arguments after the parameters).

        A codec's sum of differences becomes the new average here, kept as ``last_average``: call once per merge.
        """
        if self._wire is None:
            return Merge(self._snapshot, self._sum, self.workers.size, self.merge, self.update_proportion)
        self._sum /= self.workers.size
        self._sum += self.last_average
        self.last_average[...] = self._sum
        return Merge(self._snapshot, self._sum, 1, self.merge, self.update_proportion)

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
