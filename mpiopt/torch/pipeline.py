"""The pieces of ``DistributedOptimizer.step()``'s pipeline: where the exchange stands, and what it cost."""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple, Optional

import torch

from ..algorithms import StepRecord
from ..comm import Ledger
from ..comm.islands import ISLAND

__all__ = ["Exchanged", "LOCAL", "loss_value", "add_cost", "mean_over_passes"]


def loss_value(loss: Any) -> Optional[float]:
    """A loss (tensor, number or None) as a Python float, detached from the graph."""
    if loss is None:
        return None
    return float(loss.detach()) if isinstance(loss, torch.Tensor) else float(loss)


def add_cost(record: StepRecord, delta: Ledger) -> StepRecord:
    """``record`` with the bytes and blocked times of a ledger delta added."""
    comm, wait = delta.blocked_seconds()
    island = delta.total(ISLAND)
    return dataclasses.replace(
        record,
        bytes_sent=record.bytes_sent + delta.bytes_sent,
        bytes_recv=record.bytes_recv + delta.bytes_recv,
        island_bytes_sent=record.island_bytes_sent + island.bytes_sent,
        island_bytes_recv=record.island_bytes_recv + island.bytes_recv,
        comm_seconds=record.comm_seconds + comm,
        wait_seconds=record.wait_seconds + wait,
    )


def mean_over_passes(grads: torch.Tensor, passes: int, start: int = 0, end: Optional[int] = None) -> None:
    """This rank's gradient summed over ``passes`` backward passes, divided by them in place (the one place that does)."""
    if passes > 1:
        grads[start:end].div_(passes)


class Exchanged(NamedTuple):
    """Where the step's exchange stands once finished: ``local`` (the algorithm exchanges in its step),
    ``synchronized`` (``.grad`` holds the exchanged gradient, or with islands the island's mean; not ``finite``:
    every rank skipped it) or ``reduced`` (the buckets' sums)."""

    kind: str
    finite: bool = True
    cost: Optional[Ledger] = None  # synchronized: what it cost
    before: Optional[Ledger] = None  # reduced: the ledger before its first bucket


LOCAL = Exchanged("local")
