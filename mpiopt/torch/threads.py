"""The one place that sets how many threads a rank computes with: torch's and mpiopt's C kernels' alike."""

from __future__ import annotations

import os
from typing import Optional

import torch

from ..comm import Comm
from ..kernels import threads as kernel_threads

__all__ = ["set_threads"]


def set_threads(threads: Optional[int] = None, world: Optional[Comm] = None) -> int:
    """Set torch's and the C kernels' thread counts; return the count.

    Parameters
    ----------
    threads : int, optional
        The count.  Default: the cores this process may use, shared by the
        ranks on its node (``world``'s shared-memory split, a collective
        call; all of them without ``world``); the kernels then keep
        ``MPIOPT_NUM_THREADS`` where it is set.
    world : Comm, optional
        The job's ranks, to find those on this node.
    """
    count = threads
    if not count:
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
        on_node = 1
        if world is not None:
            node = world.Split_shared("node")
            on_node = node.size
            node.Free()
        count = max(1, cores // on_node)
    torch.set_num_threads(count)
    if threads or not os.environ.get(kernel_threads.THREADS_ENV, "").strip():
        kernel_threads.set_num_threads(count, clamp=True)
    return count
