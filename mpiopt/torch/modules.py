"""Keep a module's buffers (BatchNorm statistics) the same on every rank: broadcast at start, averaged before evaluating.

Each rank normalises with its own batch statistics in between, as DDP without SyncBatchNorm (docs/torch.md).
"""

from __future__ import annotations

from typing import Dict, List, Optional, Union

import torch

from ..comm import Comm, Topology

__all__ = ["broadcast_module", "average_buffers"]


def _world(where: Optional[Union[Topology, Comm]]) -> Comm:
    if where is None:
        raise TypeError("pass the topology (or its world Comm) the optimizer uses, e.g. opt.topology")
    if isinstance(where, Topology):
        return where.world
    if isinstance(where, Comm):
        return where
    raise TypeError(f"expected an mpiopt.Topology or Comm, got {type(where).__name__}")


def _by_dtype(tensors: List[torch.Tensor]) -> Dict[torch.dtype, List[torch.Tensor]]:
    groups: Dict[torch.dtype, List[torch.Tensor]] = {}
    for t in tensors:
        groups.setdefault(t.dtype, []).append(t)
    return groups


def _exchange(world: Comm, tensors: List[torch.Tensor], average: bool, root: int) -> None:
    """One collective per dtype over the concatenation of ``tensors``, copied back in place."""
    for group in _by_dtype(tensors).values():
        flat = torch.cat([t.detach().reshape(-1) for t in group])
        if average:
            world.Allreduce(flat)
            flat /= world.size
        else:
            world.Bcast(flat, root=root)
        with torch.no_grad():
            parts = torch.split(flat, [t.numel() for t in group])
            torch._foreach_copy_(group, [part.view_as(t) for part, t in zip(parts, group)])


@torch.no_grad()
def broadcast_module(module: torch.nn.Module, topology: Optional[Union[Topology, Comm]] = None, *, root: int = 0) -> None:
    """Copy ``root``'s parameters and buffers into every rank's ``module`` (a collective call).

    Parameters
    ----------
    module : torch.nn.Module
        The model; every rank must pass the same architecture.
    topology : Topology or Comm
        Where to broadcast (``opt.topology`` of a :class:`DistributedOptimizer`).
    root : int
        The rank whose state wins.
    """
    world = _world(topology)
    tensors = list(module.state_dict(keep_vars=True).values())
    world.agree({"broadcast_module": [[str(t.dtype), list(t.shape)] for t in tensors]}, what="module structure")
    _exchange(world, [t.data for t in tensors], average=False, root=root)


@torch.no_grad()
def average_buffers(module: torch.nn.Module, topology: Optional[Union[Topology, Comm]] = None) -> None:
    """Replace every floating-point buffer of ``module`` by its mean over the ranks (a collective call).

    See the module docstring for when mpiopt calls it.  Parameters are left
    alone: which model a rank holds is the algorithm's business.
    """
    world = _world(topology)
    buffers = [b for b in module.buffers() if b.is_floating_point()]
    _exchange(world, buffers, average=True, root=0)
