"""Overlap with backward: ``sgd``'s gradient Allreduce in buckets, started by the parameters' hooks while backward runs.

The mechanism behind ``DistributedOptimizer(overlap=True)`` (its module
docstring, "Overlapping the exchange with backward", says what it asks of a
training loop and why only ``sgd`` overlaps).
"""

from __future__ import annotations

import weakref
from typing import Any, Callable, List, Optional, Tuple

import numpy as np
import torch

from ..comm import Comm, Ledger
from ..comm.buffers import tensor_array

__all__ = ["BucketExchange", "bucket_bounds"]


def bucket_bounds(sizes: List[int], cap: int) -> Tuple[List[Tuple[int, int]], List[int]]:
    """Cut a flat buffer of parameters of ``sizes`` elements into buckets of about ``cap`` elements.

    Walks the parameters from the last to the first (backward's order) and
    closes a bucket once it holds ``cap`` elements or more, as DDP does.
    Returns the buckets' ``(start, end)`` element ranges, the end of the
    buffer's first, and the bucket of each parameter.
    """
    offsets = np.concatenate([[0], np.cumsum(sizes, dtype=np.int64)]).tolist()
    bounds: List[Tuple[int, int]] = []
    bucket_of = [0] * len(sizes)
    end = offsets[-1]
    for i in reversed(range(len(sizes))):
        bucket_of[i] = len(bounds)
        if end - offsets[i] >= cap or i == 0:
            bounds.append((offsets[i], end))
            end = offsets[i]
    return bounds, bucket_of


class BucketExchange:
    """The gradient's Allreduce in buckets, started by the parameters' hooks while backward runs.

    State of one step: how often each parameter's gradient was finished
    (``fired``), how many parameters of each bucket are final (``ready``),
    the requests of the buckets started so far, in bucket order, and the
    ledger's snapshot before the first of them.
    """

    def __init__(
        self, params: List[torch.nn.Parameter], grad_views: List[torch.Tensor], grads: torch.Tensor, total_array: Any,
        comm: Comm, passes: int, cap_bytes: float, local_mean: Callable[[int, int], None],
    ) -> None:
        cap = max(1, int(cap_bytes) // grads.element_size())
        self.bounds, self.bucket_of = bucket_bounds([p.numel() for p in params], cap)
        self.members = [self.bucket_of.count(b) for b in range(len(self.bounds))]
        self.comm, self.passes, self._local_mean = comm, passes, local_mean
        self._grads, self._grads_array, self._total_array = grads, tensor_array(grads), total_array
        self.pending = False  # some gradient was finished since the last step
        self._version = grads._version  # the flat gradient's version counter after the latest hook: later ones are the caller's
        self._fired = [0] * len(params)
        self._ready = [0] * len(self.bounds)
        self._requests: List[Any] = []
        self._oldest = 0  # first request not known to be complete
        self._before: Optional[Ledger] = None
        for i, (p, view) in enumerate(zip(params, grad_views)):
            self._hook(p, i, view)

    def _hook(self, param: torch.nn.Parameter, index: int, view: torch.Tensor) -> None:
        owner = weakref.ref(self)  # the hook must not keep a dropped optimizer alive
        address = param.data_ptr()

        def on_gradient(p: torch.Tensor) -> None:
            exchange = owner()
            if exchange is None or p.data_ptr() != address:
                handle.remove()  # our optimizer is gone, or another one has taken the parameter
                return
            if p.grad is not view:  # set to None (model.zero_grad()) and recreated by this pass
                view.copy_(p.grad)
                p.grad = view
            exchange.gradient_ready(index)

        handle = param.register_post_accumulate_grad_hook(on_gradient)

    def gradient_ready(self, index: int) -> None:
        """Parameter ``index``'s gradient of this pass is complete: start what is ready, advance what is in flight."""
        self.pending = True
        self._fired[index] += 1
        if self._fired[index] > self.passes:
            raise RuntimeError(
                f"parameter {index} got {self._fired[index]} gradients since the last step(), more than "
                f"backward_passes_per_step={self.passes}: with overlap=True its bucket leaves after the last pass; "
                "call step() (or zero_grad()) after every backward_passes_per_step passes"
            )
        if self._fired[index] == self.passes:
            self._ready[self.bucket_of[index]] += 1
            started = len(self._requests)
            while started < len(self.bounds) and self._ready[started] == self.members[started]:
                self._start_next()
                started += 1
        while self._oldest < len(self._requests) and self._requests[self._oldest].Test():
            self._oldest += 1
        self._version = self._grads._version

    def finished(self, index: int) -> bool:
        """Whether parameter ``index``'s gradient was finished (and so taken into its bucket) since the last step."""
        return self._fired[index] > 0

    def changed_since_backward(self) -> bool:
        """Whether the gradient was changed in place after backward's last hook (say, clipped): what has left would not have it."""
        return self.pending and self._grads._version != self._version

    def _start_next(self) -> None:
        if not self._requests:
            self._before = self.comm.ledger.snapshot()
        start, end = self.bounds[len(self._requests)]
        self._local_mean(start, end)  # the optimizer's division by the passes, on this bucket
        self._requests.append(self.comm.Iallreduce(self._grads_array[start:end], out=self._total_array[start:end]))

    def start_rest(self) -> None:
        """Start the buckets that backward left incomplete (a parameter without a gradient this time)."""
        while len(self._requests) < len(self.bounds):
            self._start_next()

    def finish(self) -> Ledger:
        """Wait for every bucket and reset for the next step; returns the ledger's snapshot from before the first."""
        for request in self._requests[self._oldest :]:
            request.Wait()
        self._requests.clear()
        self._oldest = 0
        self.pending = False
        self._fired = [0] * len(self._fired)
        self._ready = [0] * len(self._ready)
        return self._before
