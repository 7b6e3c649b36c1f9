"""signSGD and Signum with majority vote: one bit per parameter on the wire.

Bernstein et al., ICML 2018 (Algorithms 1-3) and ICLR 2019 (Algorithm 1): every rank sends the signs of its momentum,
the majority of the ranks' signs is the step; by packed-bit Allgather, a two-phase vote or a per-node pre-vote.
Notes: docs/algorithm-notes.md.
"""

from __future__ import annotations

from collections import deque
from typing import Any, Deque, Dict, Iterator, List, Mapping, Optional, Tuple, Union

import numpy as np

from ..arrays import empty_apart
from ..comm import Request, Topology
from ..comm.ledger import Call, plan_bytes
from ..kernels import chunk_bounds, majority_vote, pack_signs, packed_nbytes, vote_chunk
from ..kernels.signs import apply_signs, fused_signs_available, momentum_signs
from .base import BASE, SynchronousAlgorithm
from .schema import Hyperparameter, Schema, choice, count_or_auto, in_range, positive
from .registry import register
from .resize import FOLLOW

__all__ = [
    "Signum", "EXCHANGES", "LATENCY_BYTES", "PIPELINE_CHUNKS", "PIPELINE_DEPTH", "PIPELINE_MIN_BYTES",
    "choose_exchange", "exchange_bytes", "pipeline_bounds",
]

EXCHANGES = ("auto", "allgather", "twophase", "prevote")

#: What one extra collective costs, in bytes at the link's bandwidth (about
#: 10 microseconds at 25 Gbit/s).  Used by ``exchange="auto"``.
LATENCY_BYTES = 32 * 1024

#: Chunks of a pipelined exchange under ``pipeline_chunks="auto"`` (measured:
#: docs/benchmarks-compressed.md).
PIPELINE_CHUNKS = 4
#: ``"auto"`` pipelines only when every chunk keeps this many packed bytes
#: (8 collectives' latency at the link's bandwidth), so small vectors pay no
#: extra latency.
PIPELINE_MIN_BYTES = 8 * LATENCY_BYTES
#: Chunks whose exchange may be in flight at once.
PIPELINE_DEPTH = 2


def exchange_bytes(mode: str, ranks: int, d: int, chunks: Union[int, str] = "auto") -> Dict[str, int]:
    """Bytes one rank sends and receives per step in ``mode`` (the ledger's convention, from the plan).

    Parameters
    ----------
    mode : {"allgather", "twophase"}
        (``prevote``'s bytes depend on the group sizes: docs/algorithm-notes.md.)
    ranks : int
        World size P.
    d : int
        Number of parameters.
    chunks : int or "auto"
        ``pipeline_chunks`` (the default is the algorithm's): ``twophase``
        pads each chunk's pieces to whole words.
    """
    calls = Signum.communication(d, ranks, {"exchange": mode, "pipeline_chunks": chunks})
    return {key: int(value) for key, value in plan_bytes(calls, ranks).items()}


def pipeline_bounds(d: int, chunks: Union[int, str], ranks: int) -> np.ndarray:
    """Byte ranges ``[start, stop)`` of the packed vector that a pipelined exchange sends one by one.

    Parameters
    ----------
    d : int
        Number of parameters.
    chunks : int or "auto"
        ``pipeline_chunks`` (docs/algorithm-notes.md).
    ranks : int
        Workers in the vote: ``"auto"`` pipelines nothing for one, whose
        exchange is a copy that a pipeline would not hide, only cut in pieces.

    Returns
    -------
    numpy.ndarray of int64, shape (n, 2)
        ``n >= 1`` non-empty chunks of whole 8-byte words (except the last),
        in order, covering ``[0, ceil(d / 8))``; one row when not pipelined.
    """
    nbytes = packed_nbytes(d)
    if chunks == "auto":
        chunks = PIPELINE_CHUNKS if nbytes >= PIPELINE_CHUNKS * PIPELINE_MIN_BYTES and ranks > 1 else 1
    bounds = chunk_bounds(nbytes, min(chunks, max(1, -(-nbytes // 8))))
    return bounds[bounds[:, 1] > bounds[:, 0]] if nbytes else bounds


def choose_exchange(ranks: int, d: int) -> str:
    """The mode ``auto`` picks for ``ranks`` workers and ``d`` parameters (docs/algorithm-notes.md)."""
    allgather = exchange_bytes("allgather", ranks, d)["recv"]
    twophase = exchange_bytes("twophase", ranks, d)["recv"]
    return "twophase" if allgather - twophase > LATENCY_BYTES else "allgather"


def _chunk_width(nbytes: int, ranks: int) -> int:
    bounds = chunk_bounds(nbytes, ranks)
    return int((bounds[:, 1] - bounds[:, 0]).max())


@register
class Signum(SynchronousAlgorithm):
    """Signum / signSGD with majority vote over packed sign bits.

    Attributes
    ----------
    mode : str
        The exchange in use ("allgather", "twophase" or "prevote"), fixed at ``setup``.
    chunks : int
        Pipeline chunks in use (1: not pipelined), fixed at ``setup``.
    """

    name = "signum"
    inner_refusal = (
        "Signum is its own optimizer: its update is the sign of the voted momentum, and an inner optimizer "
        "would have to step on those signs (use sgd, topk or regtopk to exchange gradients for an inner optimizer)"
    )
    listing_order = 40
    schema = BASE.with_defaults(lr=1e-4) + Schema(
        Hyperparameter("momentum", 0.9, in_range(0.0, 1.0, high_open=True), "momentum of the signs (0: signSGD)"),
        Hyperparameter("weight_decay", 1e-4, positive(allow_zero=True), "decoupled weight decay"),
        Hyperparameter("exchange", "auto", choice(*EXCHANGES), "how the signs are voted: Allgather, two-phase, or per-node pre-vote"),
        Hyperparameter("pipeline_chunks", "auto", count_or_auto(), "pieces the vote is pipelined in (same bits)", execution=True),
    )
    # Islands: the island's ranks keep the island's momentum alike and each sends a slice of its packed signs' bytes.
    islands_refusal = None
    state_arrays = ("momentum_buffer",)
    # Per-worker momentum goes with that worker's parameters: averaging would cast a lower-variance vote than any worker.
    resize_rules = {"momentum_buffer": FOLLOW}
    training_defaults = {"lr": 1e-3}  # the paper's 1e-4 barely moves a small model in a few hundred steps
    wire_summary = "d/8 sent; (P-1)d/8 or < d/4 received"
    update_goal = 2.0

    @classmethod
    def _plan(cls, d: int, ranks: int, hyper: Mapping[str, Any], groups: List[int], steps: range, itemsize: int) -> List[Call]:
        count, nbytes = len(steps), packed_nbytes(d)
        mode = choose_exchange(ranks, d) if hyper["exchange"] == "auto" else hyper["exchange"]
        if mode == "allgather":
            return [Call("allgather", nbytes, ranks, count)]
        if mode == "twophase":
            width = sum(_chunk_width(int(stop - start), ranks) for start, stop in pipeline_bounds(d, hyper["pipeline_chunks"], ranks))
            return [Call("twophase", width, ranks, count)]
        calls = []  # prevote: an Allgather in each group and its leader's Bcast of the outcome, then the leaders' Allgather
        for g in groups:
            if g > 1:
                calls += [Call("allgather", nbytes, g, count, 0), Call("bcast", nbytes, g, count, 1)]
        if len(groups) > 1:
            calls.append(Call("allgather", nbytes, len(groups), count, 2))
        return calls

    def __init__(self, topology: Topology, **hyperparameters: Any) -> None:
        super().__init__(topology, **hyperparameters)
        if self.islands and self.exchange == "prevote":
            raise ValueError("signum: exchange='prevote' votes inside each node first, and with islands=True a node is one "
                             "worker already: use exchange='auto', 'allgather' or 'twophase'")
        self.mode: Optional[str] = None
        self.chunks = 1
        self.momentum_buffer: Optional[Any] = None

    @property
    def vote(self) -> Any:
        """The packed majority vote of the last step (ceil(d/8) bytes, :mod:`mpiopt.kernels` bit order)."""
        return self._voted

    def _allocate(self, params: Any) -> None:
        xp = self._xp
        P, d = self.worker_count, params.size
        self.mode = choose_exchange(P, d) if self.exchange == "auto" else self.exchange
        nbytes = packed_nbytes(d)
        # Scratch of the array code's passes ((1 - beta) g, then lr times the vote); the fused passes need none.
        self._signs = None if fused_signs_available(params) else empty_apart(params)
        self._voted = xp.empty(nbytes, dtype=np.uint8)
        if self.momentum:
            self.momentum_buffer = empty_apart(params, zero=True)
        if self.mode == "prevote":
            topo = self.topology
            self._packed = xp.empty(nbytes, dtype=np.uint8)
            self._stack = xp.empty((topo.group.size, nbytes), dtype=np.uint8)
            self._leader_stack = xp.empty((topo.num_groups, nbytes), dtype=np.uint8) if topo.is_leader else None
            self.chunks = 1
            return
        bounds = pipeline_bounds(d, self.pipeline_chunks, P)
        self.chunks = len(bounds)
        self._plan = []
        if self.mode == "allgather":
            packed, stack = xp.empty(nbytes, dtype=np.uint8), xp.empty(P * nbytes, dtype=np.uint8)
            for start, stop in bounds.tolist():
                # Chunk c's (P, its bytes) receive block is contiguous: one Allgather's layout per chunk.
                self._plan.append((start, stop, packed[start:stop], stack[P * start : P * stop].reshape(P, stop - start)))
            return
        pieces = [chunk_bounds(stop - start, P) + start for start, stop in bounds.tolist()]
        widths = [_chunk_width(stop - start, P) for start, stop in bounds.tolist()]
        # Row q of a chunk's send block is this rank's piece q of the chunk, zero-padded to a common width.
        send, recv, gathered = (xp.zeros(P * sum(widths), dtype=np.uint8) for _ in range(3))
        mine = xp.zeros(sum(widths), dtype=np.uint8)
        offset = 0
        for (start, stop), piece, width in zip(bounds.tolist(), pieces, widths):
            rows = slice(P * offset, P * (offset + width))
            blocks = (buf[rows].reshape(P, width) for buf in (send, recv, gathered))
            self._plan.append((start, stop, piece.tolist(), *blocks, mine[offset : offset + width]))
            offset += width

    def _pack(self, grad: Any, lo: int, hi: int, out: Any) -> None:
        """Signum's momentum update of elements ``[lo, hi)`` and their signs packed into ``out`` (signSGD: the gradient's)."""
        if not self.momentum:
            pack_signs(grad[lo:hi], out=out, nan_policy="unchecked")
            return
        # (1 - beta) g goes through the scratch buffer (numpy only), which is free until this chunk's vote.
        momentum_signs(self.momentum_buffer[lo:hi], grad[lo:hi], self.momentum, out, scratch=self._scratch(lo, hi))

    def _apply(self, params: Any, start: int, stop: int) -> None:
        """x <- x - lr (V + wd x) on the elements that voted bytes ``[start, stop)`` cover."""
        lo, hi = 8 * start, min(8 * stop, params.size)
        # x (1 - lr wd) - lr V: element by element, so chunk by chunk gives the same floats.
        decay = 1.0 - self.lr * self.weight_decay if self.weight_decay else 1.0
        apply_signs(self._voted[start:stop], params[lo:hi], self.lr, decay, scratch=self._scratch(lo, hi))

    def _scratch(self, lo: int, hi: int) -> Optional[Any]:
        """Elements ``[lo, hi)`` of the array code's scratch (None with the fused passes)."""
        return None if self._signs is None else self._signs[lo:hi]

    def _exchange(self, op: str, send: Any, recv: Any) -> Optional[Request]:
        """The workers' ``Allgather``/``Alltoall``, nonblocking (its request returned) when pipelined."""
        world = self.workers
        if self.chunks > 1:
            return getattr(world, "I" + op.lower())(send, recv)
        return getattr(world, op)(send, recv)

    def _allgather_chunk(self, params: Any, grad: Any, chunk: Tuple) -> Iterator[Optional[Request]]:
        """One chunk of the Allgather vote; yields its exchange's request (None when blocking)."""
        start, stop, packed, stack = chunk
        d = params.size
        self._pack(grad, 8 * start, min(8 * stop, d), packed)
        yield self._exchange("Allgather", packed, stack)
        vote_chunk(stack, d, start, stop, out=self._voted[start:stop])
        self._apply(params, start, stop)

    def _twophase_chunk(self, params: Any, grad: Any, chunk: Tuple) -> Iterator[Optional[Request]]:
        """One chunk of the two-phase vote: Alltoall of its P pieces, a vote on ours, Allgather of the votes."""
        start, stop, pieces, send, recv, gathered, mine = chunk
        d, rank = params.size, self.workers.rank
        for q, (a, b) in enumerate(pieces):  # a loop over ranks, not parameters
            # Pieces start on whole words (64 signs), so packing piece by piece gives the whole chunk's bits.
            self._pack(grad, 8 * a, min(8 * b, d), send[q, : b - a])
        yield self._exchange("Alltoall", send, recv)
        a, b = pieces[rank]
        vote_chunk(recv, d, a, b, out=mine[: b - a])
        yield self._exchange("Allgather", mine, gathered)
        for q, (a, b) in enumerate(pieces):
            self._voted[a:b] = gathered[q, : b - a]
        self._apply(params, start, stop)

    def _prevote(self, grad: Any) -> Any:
        """Majority of the groups' majorities: vote in the group, then among leaders, then Bcast."""
        topo, d = self.topology, grad.size
        self._pack(grad, 0, d, self._packed)
        topo.group.Allgather(self._packed, self._stack)
        majority_vote(self._stack, d, out=self._voted)
        if topo.is_leader:
            topo.leaders.Allgather(self._voted, self._leader_stack)
            majority_vote(self._leader_stack, d, out=self._voted)
        topo.group.Bcast(self._voted, root=0)
        return self._voted

    def _step(self, params: Any, grad: Any, loss: Optional[float]) -> None:
        # The base class has checked the gradient, so the momentum holds no NaN.
        if self.mode == "prevote":
            self._prevote(grad)
            self._apply(params, 0, self._voted.size)
            return
        work = self._allgather_chunk if self.mode == "allgather" else self._twophase_chunk
        inflight: Deque[Tuple[Iterator[Optional[Request]], Request]] = deque()
        for chunk in self._plan:
            _advance(inflight, work(params, grad, chunk))
            while len(inflight) > PIPELINE_DEPTH:
                _finish_oldest(inflight)
            for _, request in inflight:
                request.Test()  # MPI moves a nonblocking collective's data only inside MPI calls
        while inflight:
            _finish_oldest(inflight)


def _advance(inflight: Deque, work: Iterator[Optional[Request]]) -> None:
    """Run ``work`` until it posts a nonblocking exchange (queued, with ``work``, in ``inflight``) or ends."""
    for request in work:
        if request is not None:
            inflight.append((work, request))
            return


def _finish_oldest(inflight: Deque) -> None:
    """Complete the oldest exchange in flight and run its chunk on.

    Always the oldest, never whichever finished first: every rank must post
    its collectives in the same order.
    """
    work, request = inflight.popleft()
    request.Wait()
    _advance(inflight, work)
