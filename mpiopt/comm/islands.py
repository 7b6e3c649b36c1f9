"""``Islands``: each group of the topology (a node) one worker, its exchanges sharded over the island's ranks.

Every rank of an island holds the same vector, so rank j of each island exchanges only slice j along its rail (the
ranks of local index j across the islands) and the island reassembles the result over its own links.  An algorithm
calls the collectives it calls on the world, with whole buffers; only the bytes that cross between islands shrink.
Why and what it costs: docs/islands.md.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any, Callable, Dict, List, Optional, Tuple

import numpy as np

from ..arrays import array_module
from .communicator import SUM, Comm, Request
from .ledger import Call

__all__ = ["Islands", "IslandRequest", "slice_bounds", "shard_counts", "island_plan", "ISLAND", "RAIL"]

#: The names of an island's communicator and of a rail's: the ledger's operations say which level moved the bytes.
ISLAND, RAIL = "island", "rail"


def slice_bounds(n: int, parts: int, part: int) -> Tuple[int, int]:
    """Elements ``[part n // parts, (part + 1) n // parts)``: slice ``part`` of ``n`` cut in ``parts`` near-equal slices."""
    return part * n // parts, (part + 1) * n // parts


def shard_counts(n: int, parts: int) -> List[int]:
    """The sizes of :func:`slice_bounds`' slices, in order."""
    return [b - a for a, b in (slice_bounds(n, parts, q) for q in range(parts))]


def _bytes(buf: Any) -> Any:
    """A flat uint8 view of a contiguous numpy or cupy array."""
    if not buf.flags.c_contiguous:
        raise ValueError(f"buffer must be C-contiguous, got a strided {type(buf).__name__}")
    return buf.reshape(-1).view(array_module(buf).uint8)


def _address(buf: Any) -> int:
    return buf.data.ptr if hasattr(buf.data, "ptr") else buf.ctypes.data


def island_plan(calls: List[Call], d: int, ranks_per_island: int, workers: int, steps: int, itemsize: int = 4) -> List[Call]:
    """The calls of an island run whose workers' plan is ``calls`` (``workers`` islands of ``ranks_per_island``).

    Every step the island's mean gradient; each call of the plan along the rails (``ranks_per_island`` copies, a
    slice each) and its reassembly in the islands (``workers`` copies), as :class:`Islands` makes them.
    """
    G = int(ranks_per_island)
    out = [Call("allreduce", itemsize * d, G, steps, copies=workers, level="node")] if G > 1 else []
    for call in calls:
        if G == 1:
            out.append(call)
        elif call.op in ("allreduce", "iallreduce"):  # elements [j d / G, (j + 1) d / G): the slices add up
            out.append(replace(call, nbytes=call.nbytes / G, copies=G, phase=2 * call.phase + 1))
            out.append(Call("allgatherv", call.nbytes / G, G, call.count, phase=2 * call.phase + 2, copies=workers, level="node"))
        elif call.op in ("allgather", "allgatherv", "twophase"):  # each block's bytes cut in slices of one width
            width = -(-int(call.nbytes) // G)
            rounds = 2 if call.op == "twophase" else 1  # the vote's Alltoall, then its Allgather, each reassembled
            out.append(replace(call, nbytes=width, copies=G, phase=2 * call.phase + 1))
            out.append(Call("allgather", workers * width, G, rounds * call.count, phase=2 * call.phase + 2, copies=workers, level="node"))
        else:
            raise ValueError(f"islands shard Allreduce, Allgather and Alltoall, not {call.op!r}")
    return out


class IslandRequest:
    """A nonblocking island exchange: the rail's part in flight; the island's reassembly in :meth:`Wait`.

    :meth:`Test` advances the rail's part but never completes the request: the reassembly is a collective on the
    island, and every rank must reach it at the same point of its program, which only ``Wait`` is.
    """

    def __init__(self, rail: Request, reassemble: Callable[[], None]) -> None:
        self._rail, self._reassemble = rail, reassemble
        self.done = False

    def Test(self) -> bool:
        """Advance the rail's part; False until :meth:`Wait`."""
        if not self.done:
            self._rail.Test()
        return self.done

    def Wait(self) -> None:
        """Complete the rail's part, then reassemble the island's result."""
        if not self.done:
            self._rail.Wait()
            self._reassemble()
            self.done = True


class Islands:
    """The islands of a topology as workers: :attr:`size` islands, this rank's is :attr:`rank`.

    Collectives take the whole buffers a rank-per-worker run passes to the world, identical on the ranks of an
    island, and leave the whole result on each of them: Allreduce (slices of elements), Allgather and Alltoall
    (slices of each block's bytes), and their nonblocking forms.

    Parameters
    ----------
    island : Comm
        This rank's island (a group of the topology).
    rail : Comm
        The ranks of this rank's local index in every island, in island order.
    """

    def __init__(self, island: Comm, rail: Comm) -> None:
        self.island, self.rail = island, rail
        self.ledger = rail.ledger
        self._scratch: Dict[Tuple[str, int, Tuple[int, ...]], Any] = {}

    @property
    def size(self) -> int:
        """Number of islands (workers)."""
        return self.rail.size

    @property
    def rank(self) -> int:
        """This rank's island."""
        return self.rail.rank

    @property
    def thread_multiple(self) -> bool:
        return self.rail.thread_multiple

    def __repr__(self) -> str:
        return f"Islands(island={self.rank}/{self.size}, rank in island={self.island.rank}/{self.island.size})"

    def _whole(self) -> bool:
        """Nothing to shard: islands of one rank (the world's own exchange), or one island (no traffic at all)."""
        return self.island.size == 1 or self.rail.size == 1

    def mean(self, grad: Any, out: Any) -> Any:
        """The island's mean of ``grad`` into ``out`` (``grad`` itself: in place): one Allreduce over the island, then one
        division."""
        self.island.Allreduce(grad, out=None if out is grad else out)
        out /= self.island.size
        return out

    def broadcast(self, buf: Any) -> None:
        """The island's first rank's ``buf`` on every rank of the island (an island's worker starts as one)."""
        self.island.Bcast(buf, root=0)

    # -- Allreduce: slice j of the elements along rail j, then gathered over the island ---------------------------
    def _allreduce(self, buf: Any, out: Optional[Any], op: Any, nonblocking: bool) -> Any:
        if self._whole():
            fn = self.rail.Iallreduce if nonblocking else self.rail.Allreduce
            return fn(buf, out=out, op=op)
        if out is not None and (out.shape != buf.shape or out.dtype != buf.dtype):
            raise ValueError(f"out must be like buf ({buf.shape}, {buf.dtype}), got ({out.shape}, {out.dtype})")
        n, G = buf.shape[0], self.island.size
        counts = shard_counts(n, G)
        a, b = slice_bounds(n, G, self.island.rank)
        target = buf if out is None else out
        mine = None if out is None else out[a:b]
        reassemble = lambda: self.island.Allgatherv(None, target, counts)  # noqa: E731
        if nonblocking:
            return IslandRequest(self.rail.Iallreduce(buf[a:b], out=mine, op=op), reassemble)
        self.rail.Allreduce(buf[a:b], out=mine, op=op)
        reassemble()
        return None

    def Allreduce(self, buf: Any, out: Optional[Any] = None, op: Any = SUM) -> None:
        """Reduce ``buf`` over the islands into ``out`` (in place when None), on every rank of each island."""
        self._allreduce(buf, out, op, nonblocking=False)

    def Iallreduce(self, buf: Any, out: Optional[Any] = None, op: Any = SUM) -> Any:
        """Nonblocking :meth:`Allreduce`: the buffers must not be touched until the request's ``Wait``."""
        return self._allreduce(buf, out, op, nonblocking=True)

    # -- Allgather, Alltoall: slice j of each block's bytes along rail j, then gathered over the island ------------
    def _blocks(self, op: str, sendbuf: Any, recvbuf: Any, nonblocking: bool) -> Any:
        """``op`` ("Allgather" or "Alltoall") of blocks of bytes, each block cut in the island's slices."""
        if self._whole():
            return getattr(self.rail, ("I" + op.lower()) if nonblocking else op)(sendbuf, recvbuf)
        send, recv = _bytes(sendbuf), _bytes(recvbuf)
        P, G, j = self.size, self.island.size, self.island.rank
        rows = 1 if op == "Allgather" else P  # the blocks this rank sends: one to all, or one to each island
        expected = send.size * P if op == "Allgather" else send.size
        if recv.size != expected or send.size % rows:
            raise ValueError(f"{op} over {P} islands: sendbuf has {send.size} bytes, recvbuf {recv.size}; they do not fit")
        block = send.size // rows
        width = -(-block // G)  # every slice padded to one width: one plain collective along the rail
        a, b = min(j * width, block), min((j + 1) * width, block)
        piece = self._buffer("piece", recvbuf, (rows, width))
        piece[:, : b - a] = send.reshape(rows, block)[:, a:b]
        gathered = self._buffer("gathered", recvbuf, (P, width))

        def reassemble() -> None:
            everything = self._buffer("island", recvbuf, (G, P, width))
            self.island.Allgather(gathered, everything)
            recv.reshape(P, block)[...] = everything.transpose(1, 0, 2).reshape(P, G * width)[:, :block]

        if nonblocking:
            return IslandRequest(getattr(self.rail, "I" + op.lower())(piece, gathered), reassemble)
        getattr(self.rail, op)(piece, gathered)
        reassemble()
        return None

    def Allgather(self, sendbuf: Any, recvbuf: Any) -> None:
        """Every island's ``sendbuf`` into ``recvbuf`` (``size`` blocks, island order)."""
        self._blocks("Allgather", sendbuf, recvbuf, nonblocking=False)

    def Iallgather(self, sendbuf: Any, recvbuf: Any) -> Any:
        """Nonblocking :meth:`Allgather`: the buffers must not be touched until the request's ``Wait``."""
        return self._blocks("Allgather", sendbuf, recvbuf, nonblocking=True)

    def Alltoall(self, sendbuf: Any, recvbuf: Any) -> None:
        """Block ``q`` of ``sendbuf`` to island ``q``; island ``q``'s block for this island into block ``q``."""
        self._blocks("Alltoall", sendbuf, recvbuf, nonblocking=False)

    def Ialltoall(self, sendbuf: Any, recvbuf: Any) -> Any:
        """Nonblocking :meth:`Alltoall`: the buffers must not be touched until the request's ``Wait``."""
        return self._blocks("Alltoall", sendbuf, recvbuf, nonblocking=True)

    def _buffer(self, role: str, owner: Any, shape: Tuple[int, ...]) -> Any:
        """A reusable byte buffer of ``shape`` for the exchange into ``owner`` (one per receive buffer, so exchanges in
        flight at once never share one); zeros when new, so padding sends no stale memory."""
        key = (role, _address(owner), shape)
        buffer = self._scratch.get(key)
        if buffer is None:
            buffer = self._scratch[key] = array_module(owner).zeros(shape, dtype=np.uint8)
        return buffer
