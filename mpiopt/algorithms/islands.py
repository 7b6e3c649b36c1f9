"""Islands as workers: what the base class does for an algorithm run with ``islands=True``.

Every group of the topology (a node) is then one worker: its ranks average their gradients over the island's links,
each runs the algorithm's update on the same bits, and the algorithm's exchanges go through :attr:`workers`, which
shards them over the island's ranks (:mod:`mpiopt.comm.islands`).  docs/islands.md.
"""

from __future__ import annotations

from typing import Any, ClassVar, Dict, Optional

from ..arrays import array_module, empty_apart
from ..comm import Comm, Topology

__all__ = ["IslandWorkers"]


class IslandWorkers:
    """Mixin of :class:`~mpiopt.algorithms.base.Algorithm`: who the workers are, and the gradient each steps on."""

    name: ClassVar[str]
    #: Why the algorithm takes no ``islands=True``; None: it exchanges through :attr:`workers` only, and takes them.
    islands_refusal: ClassVar[Optional[str]]
    overlaps_backward: bool
    islands: bool
    topology: Topology
    _island_grad: Optional[Any] = None  # the island's mean gradient (islands of more than one rank)

    def _check_islands(self) -> None:
        """Refuse ``islands=True`` (in the constructor: every rank alike, before any communication), naming the fix."""
        if not self.islands:
            return
        if self.islands_refusal is not None:
            raise ValueError(f"{self.name} takes no islands=True: {self.islands_refusal}; run it without islands")
        problem = self.topology.islands_problem()
        if problem is not None:
            raise ValueError(f"{self.name} with islands=True: {problem}")

    @property
    def workers(self) -> Any:
        """Whom the algorithm exchanges with: the world's ranks, or with ``islands`` the topology's islands."""
        return self.topology.islands() if self.islands else self.topology.world

    @property
    def worker_count(self) -> int:
        """How many workers there are (known without communication): islands, or ranks."""
        return self.topology.num_groups if self.islands else self.topology.size

    @property
    def worker_index(self) -> int:
        """This rank's worker: its island, or its rank."""
        return self.topology.group_index if self.islands else self.topology.rank

    @property
    def reduced_over(self) -> Optional[Comm]:
        """The ranks over which a caller may sum the gradient for ``step_reduced`` (the torch front end's buckets
        during backward): the island, the world where the exchange is that sum (``sgd``), else None."""
        if self.islands:
            return self.topology.islands().island
        return self.topology.world if self.overlaps_backward else None

    @property
    def reduced_ranks(self) -> int:
        """How many ranks :attr:`reduced_over` holds, known without communication (1: there is no such sum)."""
        if self.islands:
            return self.topology.group.size
        return self.topology.size if self.overlaps_backward else 1

    def worker_layout(self) -> Dict[str, int]:
        """Workers, this rank's worker and its ranks: what a state is kept per (state_dict, checkpoints, resizes)."""
        return {"workers": self.worker_count, "worker": self.worker_index,
                "ranks_per_worker": self.topology.group.size if self.islands else 1}

    def _setup_islands(self, params: Any) -> None:
        """With islands (collective): the communicators, the island's first rank's parameters on all of its ranks."""
        self._island_grad = None
        if not self.islands:
            return
        islands = self.topology.islands()
        if islands.island.size > 1:
            islands.broadcast(params)
            self._island_grad = empty_apart(params)

    def worker_gradient(self, grad: Any, reduced: Optional[Any] = None, out: Optional[Any] = None) -> Any:
        """The gradient this rank's worker steps on: ``grad``, or with islands the island's mean (a collective over
        the island; from ``reduced``, the island's sum of ``grad``, where the caller made it) in ``out`` (default: a
        buffer of the algorithm's; ``grad`` itself is allowed, as the torch front end's ``.grad``)."""
        if self._island_grad is None:
            return grad
        out = self._island_grad if out is None else out
        if reduced is not None:
            array_module(reduced).divide(reduced, self.topology.group.size, out=out)
            return out
        # A phase of its own, before the step's rollback point: a loss found here is found by the lost rank's island
        # alone, whose other ranks leave with it (Topology.recover); the survivors agree before any of them recovers.
        with self.topology.agreed("the island's mean gradient"):
            return self.topology.islands().mean(grad, out)
