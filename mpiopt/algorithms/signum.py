"""signSGD and Signum with majority vote: one bit per parameter on the wire.

Bernstein, Wang, Azizzadenesheli and Anandkumar, "signSGD: compressed
optimisation for non-convex problems", ICML 2018 (Algorithms 1-3), and
Bernstein, Zhao, Azizzadenesheli and Anandkumar, "signSGD with majority vote
is communication efficient and fault tolerant", ICLR 2019 (Algorithm 1);
ALGORITHMS.md "signSGD, Signum and majority vote".

Every worker keeps its own momentum and sends only its signs::

    m_i <- beta m_i + (1 - beta) g_i          (Signum; beta = 0: m_i = g_i, signSGD)
    V   =  sign(sum_i sign(m_i))              (majority vote)
    x   <- x - lr (V + weight_decay x)        (weight decay after the vote)

Conventions (the same in every code path, see :mod:`mpiopt.kernels`):
sign(0) = sign(-0.0) = +1, as in the ICLR experiments; a tie of an even number
of voters votes +1.  Use an odd number of workers to avoid ties.

Exchange modes (identical results, bit for bit):

``allgather``
    One Allgather of the packed signs: each rank sends ceil(d/8) bytes and
    receives (P-1) ceil(d/8); every rank votes on the whole vector.
``twophase``
    Alltoall of packed chunks (rank q receives chunk q of every vector), a
    vote per chunk, Allgather of the voted chunks: each rank sends about
    d/8 bytes and receives about 2 (P-1)/P d/8, i.e. under 2 bits per
    parameter each way, whatever P.
``auto`` (default)
    ``twophase`` when it receives fewer bytes than ``allgather`` by more than
    :data:`LATENCY_BYTES` (the price of its second collective, expressed as
    bytes at the link's bandwidth), else ``allgather``.  At P = 2 both receive
    the same, so ``allgather`` wins; at P >= 3 ``twophase`` wins once d/8 is
    large enough.
``prevote``
    A node-local pre-vote through the :class:`~mpiopt.comm.Topology`: an
    Allgather and a vote inside each group (node), an Allgather and a vote of
    the group results among the group leaders, a Bcast of the outcome inside
    each group.  Only the leaders cross the network, each receiving
    (groups - 1) d/8 bytes.  **This changes the semantics**: the result is the
    majority of the groups' majorities, not the majority of all workers
    (ties vote +1 at both levels), so ``auto`` never picks it.  With one group
    it is the plain vote.

Compare with the float32 Allreduce of data-parallel SGD: 4d bytes each way.
"""

from __future__ import annotations

from typing import Any, Dict, Optional

import numpy as np

from ..comm import Topology
from ..kernels import chunk_bounds, majority_vote, pack_signs, packed_nbytes, unpack_signs, vote_chunk
from .base import Algorithm, check_choice, check_positive, check_range
from .registry import register

__all__ = ["Signum", "EXCHANGES", "LATENCY_BYTES", "choose_exchange", "exchange_bytes"]

EXCHANGES = ("auto", "allgather", "twophase", "prevote")

#: What one extra collective costs, in bytes at the link's bandwidth (about
#: 10 microseconds at 25 Gbit/s).  Used by ``exchange="auto"``.
LATENCY_BYTES = 32 * 1024


def exchange_bytes(mode: str, ranks: int, d: int) -> Dict[str, int]:
    """Bytes one rank sends and receives per step in ``mode`` (the ledger's convention).

    Parameters
    ----------
    mode : {"allgather", "twophase"}
        (``prevote``'s bytes depend on the group sizes: see the module docstring.)
    ranks : int
        World size P.
    d : int
        Number of parameters.
    """
    nbytes = packed_nbytes(d)
    if ranks == 1:
        return {"sent": 0, "recv": 0}
    if mode == "allgather":
        return {"sent": nbytes, "recv": (ranks - 1) * nbytes}
    chunk = _chunk_width(nbytes, ranks)
    return {"sent": ranks * chunk, "recv": 2 * (ranks - 1) * chunk}


def choose_exchange(ranks: int, d: int) -> str:
    """The mode ``auto`` picks for ``ranks`` workers and ``d`` parameters (see the module docstring)."""
    allgather = exchange_bytes("allgather", ranks, d)["recv"]
    twophase = exchange_bytes("twophase", ranks, d)["recv"]
    return "twophase" if allgather - twophase > LATENCY_BYTES else "allgather"


def _chunk_width(nbytes: int, ranks: int) -> int:
    bounds = chunk_bounds(nbytes, ranks)
    return int((bounds[:, 1] - bounds[:, 0]).max())


@register
class Signum(Algorithm):
    """Signum / signSGD with majority vote over packed sign bits.

    Parameters
    ----------
    topology : Topology
        The vote runs over ``topology.world``.
    lr : float
        Learning rate (ImageNet default 1e-4; CIFAR ResNet-20 signSGD: 1e-3).
    momentum : float
        ``beta`` in [0, 1); 0 gives signSGD (default 0.9).
    weight_decay : float
        Applied after the vote (default 1e-4).
    exchange : {"auto", "allgather", "twophase", "prevote"}
        How the signs are exchanged (see the module docstring; ``prevote``
        votes within node groups first and so changes the result).
    nan_policy : {"raise", "skip"}
        See :class:`~mpiopt.algorithms.base.Algorithm`.

    Attributes
    ----------
    mode : str
        The exchange in use ("allgather", "twophase" or "prevote"), fixed at ``setup``.
    """

    name = "signum"
    state_arrays = ("momentum_buffer",)

    def __init__(
        self,
        topology: Topology,
        *,
        lr: float = 1e-4,
        momentum: float = 0.9,
        weight_decay: float = 1e-4,
        exchange: str = "auto",
        nan_policy: str = "raise",
    ) -> None:
        super().__init__(topology, lr=lr, nan_policy=nan_policy)
        self.momentum = check_range("momentum", momentum, 0.0, 1.0, high_open=True)
        self.weight_decay = float(check_positive("weight_decay", weight_decay, allow_zero=True))
        self.exchange = check_choice("exchange", exchange, EXCHANGES)
        self.mode: Optional[str] = None
        self.momentum_buffer: Optional[Any] = None

    @property
    def vote(self) -> Any:
        """The packed majority vote of the last step (ceil(d/8) bytes, :mod:`mpiopt.kernels` bit order)."""
        return self._voted

    def hyperparameters(self) -> Dict[str, Any]:
        return {"momentum": self.momentum, "weight_decay": self.weight_decay, "exchange": self.exchange}

    def _allocate(self, params: Any) -> None:
        xp = self._xp
        P, d = self.topology.size, params.size
        self.mode = choose_exchange(P, d) if self.exchange == "auto" else self.exchange
        nbytes = packed_nbytes(d)
        self._nbytes = nbytes
        self._signs = xp.empty_like(params)  # the voted direction, then lr times it
        self._voted = xp.empty(nbytes, dtype=np.uint8)
        if self.momentum:
            self.momentum_buffer = xp.zeros_like(params)
        if self.mode == "allgather":
            self._packed = xp.empty(nbytes, dtype=np.uint8)
            self._stack = xp.empty((P, nbytes), dtype=np.uint8)
        elif self.mode == "prevote":
            topo = self.topology
            self._packed = xp.empty(nbytes, dtype=np.uint8)
            self._stack = xp.empty((topo.group.size, nbytes), dtype=np.uint8)
            self._leader_stack = xp.empty((topo.num_groups, nbytes), dtype=np.uint8) if topo.is_leader else None
        else:
            self._bounds = chunk_bounds(nbytes, P)
            width = _chunk_width(nbytes, P)
            # Row q of the send block is this rank's chunk q, zero-padded to a common width.
            self._packed = xp.zeros((P, width), dtype=np.uint8)
            self._chunks = xp.empty((P, width), dtype=np.uint8)
            self._my_vote = xp.zeros(width, dtype=np.uint8)
            self._gathered = xp.empty((P, width), dtype=np.uint8)

    def _direction(self, grad: Any) -> Any:
        """Signum's momentum update (the vector whose signs are sent); the gradient itself for signSGD."""
        if not self.momentum:
            return grad
        m = self.momentum_buffer
        m *= self.momentum
        # (1 - beta) g through the scratch buffer, which is free until the vote.
        self._xp.multiply(grad, 1.0 - self.momentum, out=self._signs)
        m += self._signs
        return m

    def _vote(self, direction: Any) -> Any:
        """The packed majority of every rank's signs of ``direction``."""
        world = self.topology.world
        if self.mode == "allgather":
            pack_signs(direction, out=self._packed, nan_policy="unchecked")
            world.Allgather(self._packed, self._stack)
            return majority_vote(self._stack, direction.size, out=self._voted)
        if self.mode == "prevote":
            return self._prevote(direction)
        bounds, send = self._bounds, self._packed
        for q, (start, stop) in enumerate(bounds):  # a loop over ranks, not parameters
            # Chunks start on whole words (64 signs), so packing chunk by chunk gives the whole vector's bits.
            pack_signs(direction[8 * start : 8 * stop], out=send[q, : stop - start], nan_policy="unchecked")
        world.Alltoall(send, self._chunks)
        start, stop = bounds[world.rank]
        vote_chunk(self._chunks, direction.size, int(start), int(stop), out=self._my_vote[: stop - start])
        world.Allgather(self._my_vote, self._gathered)
        for q, (start, stop) in enumerate(bounds):
            self._voted[start:stop] = self._gathered[q, : stop - start]
        return self._voted

    def _prevote(self, direction: Any) -> Any:
        """Majority of the groups' majorities: vote in the group, then among leaders, then Bcast."""
        topo, d = self.topology, direction.size
        pack_signs(direction, out=self._packed, nan_policy="unchecked")
        topo.group.Allgather(self._packed, self._stack)
        majority_vote(self._stack, d, out=self._voted)
        if topo.is_leader:
            topo.leaders.Allgather(self._voted, self._leader_stack)
            majority_vote(self._leader_stack, d, out=self._voted)
        topo.group.Bcast(self._voted, root=0)
        return self._voted

    def _step(self, params: Any, grad: Any, loss: Optional[float]) -> None:
        # The base class has checked the gradient, so the momentum holds no NaN.
        voted = self._vote(self._direction(grad))
        step = unpack_signs(voted, params.size, dtype=params.dtype, out=self._signs)
        # x <- x - lr (V + wd x)  ==  x (1 - lr wd) - lr V
        if self.weight_decay:
            params *= 1.0 - self.lr * self.weight_decay
        step *= self.lr
        params -= step
