"""Streaming DiLoCo: DiLoCo's outer step fragment by fragment, each fragment's exchange overlapped with tau steps.

Douillard et al., "Streaming DiLoCo with overlapping communication: towards a distributed free lunch", 2025
(arXiv:2501.18512): fragment f's exchange starts at offset ``f H // F`` of each period and merges ``overlap_steps`` later.
Notes: docs/algorithm-notes.md.
"""

from __future__ import annotations

from typing import Any, Dict, List, Mapping, Optional, Tuple

import numpy as np

from ..arrays import empty_apart
from ..comm import Topology
from ..comm.ledger import Call
from ..kernels._backend import take_rows
from ..kernels.update import mix_into
from .base import BASE, SynchronousAlgorithm, due_steps
from .compressed import CODEC, FEEDBACK, RESIDUAL, Compressed
from .diloco import outer_step, outer_update
from .inflight import PROGRESS, InFlight, PendingBuffer, check_progress, progress_rounds
from .local import LOCAL_SGD, LocalSGD, LocalStepState
from .registry import register
from .resize import COPY, FOLLOW, RESCALE
from .schema import Hyperparameter, Schema, boolean, choice, in_range, positive

__all__ = ["StreamingDiLoCo", "LAYOUTS", "fragment_blocks", "fragment_bounds", "fragment_offsets", "fragment_sizes"]

#: How the flat buffer is assigned to fragments (docs/algorithm-notes.md).
LAYOUTS = ("contiguous", "strided")


def fragment_bounds(d: int, fragments: int) -> List[Tuple[int, int]]:
    """The F contiguous slices ``[f d // F, (f + 1) d // F)`` of a flat buffer of ``d`` values."""
    return [(f * d // fragments, (f + 1) * d // fragments) for f in range(fragments)]


def fragment_blocks(d: int, fragments: int, stride_blocks: int) -> List[List[Tuple[int, int]]]:
    """The strided layout: ``F k`` near-equal blocks ``[i d // (F k), (i + 1) d // (F k))``, block i to fragment ``i mod F``.

    Each fragment's blocks in the buffer's order (``k`` = ``stride_blocks``
    of them).  With ``d >= F k`` no block is empty.
    """
    blocks = fragments * stride_blocks
    bounds = [(i * d // blocks, (i + 1) * d // blocks) for i in range(blocks)]
    return [bounds[f::fragments] for f in range(fragments)]


def fragment_sizes(d: int, fragments: int, layout: str = "contiguous", stride_blocks: int = 1) -> List[int]:
    """Each fragment's values (its elements per exchange) in ``layout``."""
    if layout == "strided":
        return [sum(b - a for a, b in blocks) for blocks in fragment_blocks(d, fragments, stride_blocks)]
    return [b - a for a, b in fragment_bounds(d, fragments)]


def fragment_offsets(period: int, fragments: int) -> List[int]:
    """Fragment f's exchange starts after the steps ``t`` with ``t mod period == f period // F``."""
    return [f * period // fragments for f in range(fragments)]


def _fragment_index(blocks: List[Tuple[int, int]]) -> np.ndarray:
    """One fragment's positions in the flat buffer, its blocks one after the other (set-up only)."""
    return np.concatenate([np.arange(a, b, dtype=np.intp) for a, b in blocks])



@register
class StreamingDiLoCo(Compressed, LocalStepState, SynchronousAlgorithm):
    """Streaming DiLoCo (Douillard et al. 2025): DiLoCo fragment by fragment, each exchange overlapped with ``overlap_steps`` steps.

    With a ``codec`` each fragment sends its pseudo-gradient ``theta_start_f - theta_f`` (the paper's fp4); the
    residual ``codec_residual`` is laid out as ``pending_sum`` is, fragment after fragment.
    """

    name = "streaming_diloco"
    inner_role = "local"
    inner_rule = ("theta_i <- inner(theta_i, g_i); fragment f tau steps after its exchange: "
                  "theta_f <- alpha theta_f + (1 - alpha) OuterNesterov(theta_start_f, mean_i (theta_start_f - theta_i,f))  "
                  "(the paper: inner = AdamW)")
    listing_order = 32
    schema = BASE.with_defaults(lr=0.1) + Schema(
        Hyperparameter("period", 100, positive(integer=True), "steps between two exchanges of a fragment (H)"),
        Hyperparameter("fragments", 4, positive(integer=True), "fragments of the parameters (F <= H)"),
        Hyperparameter("layout", "contiguous", choice(*LAYOUTS), "fragments as contiguous slices or strided blocks (block i to fragment i mod F)"),
        Hyperparameter("stride_blocks", 8, positive(integer=True), "blocks per fragment in the strided layout (k; F k blocks in all)"),
        Hyperparameter("overlap_steps", 1, positive(allow_zero=True, integer=True), "steps an exchange overlaps (tau < H)"),
        Hyperparameter("alpha", 0.5, in_range(0.0, 1.0), "weight of the local fragment in the merge, in [0, 1]"),
        Hyperparameter("outer_lr", 0.7, positive(), "outer SGD learning rate"),
        Hyperparameter("outer_momentum", 0.9, in_range(0.0, 1.0, high_open=True), "outer SGD momentum, in [0, 1)"),
        Hyperparameter("outer_nesterov", True, boolean(), "Nesterov outer momentum (ignored at outer_momentum 0)"),
    ) + CODEC + FEEDBACK + PROGRESS + LOCAL_SGD
    evaluates = "average"
    fused_gradient_check = True
    islands_refusal = None
    state_arrays = ("theta_start", "outer_momentum_buffer", "momentum_buffer", "pending_sum", "merge_steps", "codec_residual")
    # A survivor of a lost rank drops the fragments' exchanges in flight (they died with the rank).
    survival_resets = {"merge_steps": 0, "pending_sum": None}
    # A codec's pending_sum is the sum of the decoded pseudo-gradients (rescaled alike); residuals are owed to the mean.
    resize_rules = {
        "theta_start": COPY, "outer_momentum_buffer": COPY, "momentum_buffer": FOLLOW, "pending_sum": RESCALE, "merge_steps": COPY,
        "codec_residual": RESIDUAL,
    }
    training_defaults = {"lr": 0.05, "momentum": 0.9, "period": 8, "fragments": 2, "overlap_steps": 1}
    wire_summary = "4d every `period` steps in `fragments` pieces, overlapped (a codec: each piece's payload, all-gathered)"
    update_goal = 1.3

    @classmethod
    def _plan(cls, d: int, ranks: int, hyper: Mapping[str, Any], groups: List[int], steps: range, itemsize: int) -> List[Call]:
        period, fragments, tau = int(hyper["period"]), int(hyper["fragments"]), int(hyper["overlap_steps"])
        sizes = fragment_sizes(d, fragments, hyper["layout"], int(hyper["stride_blocks"]))
        flight = dict(overlap_steps=tau, progress_rounds=progress_rounds(hyper["progress"], tau))
        return [
            cls._codec_call(size, ranks, hyper, due_steps(period, steps, offset), **flight)
            or Call("iallreduce", itemsize * size, ranks, due_steps(period, steps, offset), **flight)
            for size, offset in zip(sizes, fragment_offsets(period, fragments))
        ]

    periodic_allreduce = "period"  # the cycle; each fragment's share of the Allreduce is in _plan

    def __init__(self, topology: Topology, **hyperparameters: Any) -> None:
        super().__init__(topology, **hyperparameters)
        if self.fragments > self.period:
            raise ValueError(f"fragments={self.fragments} must be at most period={self.period} (one fragment's start per step)")
        if self.overlap_steps >= self.period:
            raise ValueError(
                f"overlap_steps={self.overlap_steps} must be less than period={self.period} (one exchange in flight per fragment)"
            )
        self.local = LocalSGD.from_values(self._values)
        self.theta_start: Optional[Any] = None
        self.outer_momentum_buffer: Optional[Any] = None
        self.merge_steps = np.zeros(self.fragments, np.int64)  # the step after which fragment f merges; 0: none pending
        self._sum: Optional[Any] = None
        self._bounds: List[Tuple[int, int]] = []  # each fragment's region of the sum buffer (its slice of params if contiguous)
        self._index: List[Optional[Any]] = [None] * self.fragments  # strided: each fragment's positions in params
        self._gathered: List[Any] = []  # strided: scratch for one fragment's theta_start, outer momentum, parameters
        self._offsets = fragment_offsets(self.period, self.fragments)
        self._inflight = [InFlight() for _ in range(self.fragments)]  # each fragment's Iallreduce and progress thread
        self._outer_work: List[List[Any]] = [[] for _ in range(self.fragments)]  # each fragment's scratch
        self._wires: List[Any] = []  # with a codec: each fragment's exchange
        self._undecoded = [False] * self.fragments  # a codec's payloads not yet summed into the fragment's region

    pending_sum = PendingBuffer("_sum", lambda alg: alg.merge_steps.any())  # state only while a merge is pending

    @property
    def in_flight(self) -> bool:
        return any(f.active for f in self._inflight)

    def state_dict(self) -> Dict[str, Any]:
        """As :meth:`Algorithm.state_dict`, after completing (not merging) the exchanges in flight; zeros in the
        idle fragments' regions of ``pending_sum`` (docs/algorithm-notes.md)."""
        for f in range(self.fragments):
            self._complete(f)
        state = super().state_dict()
        pending = state["arrays"]["pending_sum"]  # the base class's copy: the live buffer keeps its scratch
        if pending is not None:
            for f, (a, b) in enumerate(self._bounds):
                if not self.merge_steps[f]:
                    pending[a:b] = 0
        return state

    def load_state_dict(self, state: Mapping[str, Any], *, override_hyperparameters: bool = False) -> None:
        if self.in_flight:
            raise RuntimeError("streaming_diloco: load_state_dict() while an exchange is in flight; call finish(params) first")
        merge_steps = state.get("arrays", {}).get("merge_steps")
        if merge_steps is not None and np.any(merge_steps) and state["arrays"].get("pending_sum") is None:
            raise ValueError("streaming_diloco state has a pending merge (merge_steps > 0) but lacks its sum")
        super().load_state_dict(state, override_hyperparameters=override_hyperparameters)

    def hyperparameters(self) -> Dict[str, Any]:
        # The strided layout alone records its layout: the contiguous record is what it was before the option
        # existed (stride_blocks does nothing there), so checkpoints saved then still resume, and any other
        # record differs in "layout" from a strided one.
        unrecorded = () if self.layout == "strided" else ("layout", "stride_blocks")
        return {k: v for k, v in super().hyperparameters().items() if k not in unrecorded}

    def _allocate(self, params: Any) -> None:
        d = params.shape[0]
        if d < self.fragments:
            raise ValueError(f"streaming_diloco: {d} parameters cannot make fragments={self.fragments}")
        if self.layout == "strided" and d < self.fragments * self.stride_blocks:
            raise ValueError(
                f"streaming_diloco: {d} parameters cannot make fragments * stride_blocks = "
                f"{self.fragments} * {self.stride_blocks} strided blocks"
            )
        check_progress(self.name, self.progress, self.topology, params)
        self.local.allocate(params)
        sizes = fragment_sizes(d, self.fragments, self.layout, self.stride_blocks)
        ends = np.cumsum(sizes).tolist()
        self._bounds = [(end - size, end) for size, end in zip(sizes, ends)]  # contiguous: fragment_bounds itself
        if self.layout == "strided":
            blocks = fragment_blocks(d, self.fragments, self.stride_blocks)
            self._index = [self._xp.asarray(_fragment_index(b)) for b in blocks]
            self._gathered = [self._xp.empty(max(sizes), params.dtype) for _ in range(3)]
        else:
            self._index, self._gathered = [None] * self.fragments, []
        world = self.workers
        self._sum = empty_apart(params)
        self._outer_work = [[] for _ in range(self.fragments)]
        self.theta_start = empty_apart(params)
        world.Allreduce(params, out=self.theta_start)  # the common start: the ranks' mean
        self.theta_start /= world.size
        params[...] = self.theta_start
        self.outer_momentum_buffer = empty_apart(params, zero=True) if self.outer_momentum else None
        self.merge_steps = np.zeros(self.fragments, np.int64)
        self._allocate_codec(params)
        residual = self.codec_residual
        self._wires = [] if self._codec is None else [
            self._codec_exchange(self._sum[a:b], None if residual is None else residual[a:b]) for a, b in self._bounds
        ]

    def _step(self, params: Any, grad: Any, loss: Optional[float]) -> None:
        step = self.steps + 1  # the base class counts the step after _step returns
        if self.local.apply(params, grad, self.lr, check_finite=self._checks_in_step()) is False:
            self._non_finite_gradient()  # before any exchange starts
        for f in range(self.fragments):
            if self.merge_steps[f] == step:  # started tau > 0 steps ago
                self._merge(f, params)
        for f in range(self.fragments):
            if step % self.period == self._offsets[f]:
                self._start(f, step, params)
                if self.overlap_steps == 0:
                    self._merge(f, params)
        if self.progress == "test":
            self.progress_hook()

    def _start(self, f: int, step: int, params: Any) -> None:
        a, b = self._bounds[f]
        if self._index[f] is None:
            self._sum[a:b] = params[a:b]
        else:
            take_rows(params, self._index[f], self._sum[a:b])
        threaded = self.progress == "thread" and self.overlap_steps  # with tau = 0 it is completed at once
        if self._wires:  # Delta_f = theta_start_f - theta_f
            start = self.theta_start[a:b] if self._index[f] is None else self._gathered[0][: b - a]
            if self._index[f] is not None:
                take_rows(self.theta_start, self._index[f], start)
            self._xp.subtract(start, self._sum[a:b], out=self._sum[a:b])
            request, self._undecoded[f] = self._wires[f].start(self.workers, self._sum[a:b], nonblocking=True), True
        else:
            request = self.workers.Iallreduce(self._sum[a:b])
        self._inflight[f].start(
            request, thread_interval=self.progress_interval if threaded else None,
            tests=self.tests_per_poke, name=f"streaming-diloco-progress-{f}",
        )
        self.merge_steps[f] = step + self.overlap_steps

    def _merge(self, f: int, params: Any) -> None:
        """Fragment f's outer step from its sum, then ``alpha * local + (1 - alpha) * outer`` into the parameters."""
        self._complete(f)
        a, b = self._bounds[f]
        index, total = self._index[f], self._sum[a:b]
        if index is None:  # views of the fragment's slice
            start, local = self.theta_start[a:b], params[a:b]
            buffer = None if self.outer_momentum_buffer is None else self.outer_momentum_buffer[a:b]
        else:  # the strided fragment gathered into scratch, scattered back below
            start, moment, local = (g[: b - a] for g in self._gathered)
            take_rows(self.theta_start, index, start)
            take_rows(params, index, local)
            buffer = None
            if self.outer_momentum_buffer is not None:
                take_rows(self.outer_momentum_buffer, index, moment)
                buffer = moment
        options = dict(lr=self.outer_lr, momentum=self.outer_momentum, nesterov=self.outer_nesterov, buffer=buffer,
                       work=self._outer_work[f])
        if self._wires:  # the decoded sum of the pseudo-gradients, the same on every rank
            total /= self.workers.size
            outer_update(start, total, out=local if self.alpha == 0.0 else None, **options)
            if self.alpha != 0.0:  # total is scratch now
                mix_into(local, start, self.alpha, total)
        else:  # the outer step and the mix in one pass
            outer_step(start, total, self.workers.size, out=local, alpha=self.alpha, **options)
        if index is not None:
            self.theta_start[index] = start
            params[index] = local
            if buffer is not None:
                self.outer_momentum_buffer[index] = buffer
        self.merge_steps[f] = 0

    def _complete(self, f: int) -> None:
        """Wait for fragment f's exchange, if in flight (a codec's payloads then decoded and summed into its region)."""
        self._inflight[f].complete()
        if self._undecoded[f]:
            a, b = self._bounds[f]
            self._wires[f].total(out=self._sum[a:b])
            self._undecoded[f] = False

    def progress_hook(self) -> bool:
        """Poke every exchange in flight (``tests_per_poke`` ``Test`` calls each); True when none is left in flight.

        Cheap when nothing is in flight: a training loop may call it as often
        as it likes, e.g. after each layer's backward pass.  With
        ``progress="thread"`` it only reports: the helper threads poke.
        """
        done = [f.poke(self.tests_per_poke) for f in self._inflight]  # a list: every fragment is poked
        return all(done)

    def _finish(self, params: Any) -> None:
        for f in range(self.fragments):
            if self.merge_steps[f]:
                self._merge(f, params)
