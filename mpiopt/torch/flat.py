"""The flat buffers: the model's parameters and gradients as views into two contiguous 1-D tensors.

The algorithms read and update them in place through zero-copy numpy (CPU)
or cupy (CUDA) arrays, so the torch layer adds no copy to a step.
"""

from __future__ import annotations

from typing import Callable, List

import torch

from ..arrays import host_apart
from ..comm.buffers import tensor_array, torch_numpy_dtype

__all__ = ["FlatBuffers", "flat_buffer"]

_SUPPORTED_DTYPES = (torch.float32, torch.float64)


def flat_buffer(total: int, like: torch.Tensor, zero: bool = False) -> torch.Tensor:
    """A flat buffer of ``total`` elements of ``like``'s dtype and device; on the host, placed by :func:`mpiopt.arrays.host_apart`."""
    if like.device.type != "cpu":
        return (torch.zeros if zero else torch.empty)(total, dtype=like.dtype, device=like.device)
    return torch.from_numpy(host_apart(total, torch_numpy_dtype(like), zero=zero))


def check_tensors(params: List[torch.nn.Parameter]) -> None:
    """One dtype (float32 or float64) and one device, every parameter trainable."""
    kinds = sorted({(str(p.dtype), str(p.device)) for p in params})
    if len(kinds) > 1:
        raise ValueError(f"all parameters must share one dtype and device; got {kinds}")
    for i, p in enumerate(params):
        if not p.requires_grad:
            raise ValueError(f"parameter {i} (shape {tuple(p.shape)}) does not require grad: leave frozen parameters out")
    if params[0].dtype not in _SUPPORTED_DTYPES:
        raise TypeError(
            f"parameters must be float32 or float64, got {params[0].dtype} (keep float32 master weights; use torch.autocast for lower precision)"
        )


class FlatBuffers:
    """Moves ``params`` into one flat parameter buffer and gives each a gradient view into a second one."""

    def __init__(self, params: List[torch.nn.Parameter]) -> None:
        check_tensors(params)
        self.params = params
        total = sum(p.numel() for p in params)
        self.flat_params = flat_buffer(total, params[0])
        self.flat_grads = flat_buffer(total, params[0], zero=True)
        offset = 0
        with torch.no_grad():
            for p in params:
                n = p.numel()
                view = self.flat_params[offset : offset + n].view_as(p)
                view.copy_(p)
                p.data = view
                p.grad = self.flat_grads[offset : offset + n].view_as(p)
                offset += n
        self.param_views = [p.data for p in params]
        self.grad_views = [p.grad for p in params]
        self.params_array = tensor_array(self.flat_params)
        self.grads_array = tensor_array(self.flat_grads)

    def check_views(self, keep_replaced_grads: bool, sent: Callable[[int], bool]) -> bool:
        """One pass over the parameters: each still lives in the flat buffer, and each gradient is its view again.

        A replaced gradient is copied into its view (``keep_replaced_grads``) or
        dropped; one set to None becomes the zeroed view.  Returns whether a
        replaced gradient was copied in, or one that was ``sent`` (overlap) set to None.
        """
        replaced = False
        for index, (p, param_view, grad_view) in enumerate(zip(self.params, self.param_views, self.grad_views)):
            if p.data_ptr() != param_view.data_ptr():
                raise RuntimeError(
                    "a parameter no longer lives in the optimizer's flat buffer (moved with .to()/.cuda() or replaced "
                    "after DistributedOptimizer was created): create the optimizer after moving the model"
                )
            if p.grad is not grad_view:
                if p.grad is None or not keep_replaced_grads:
                    grad_view.zero_()
                    replaced |= p.grad is None and sent(index)  # set to None after backward took it
                else:
                    grad_view.copy_(p.grad)
                    replaced = True
                p.grad = grad_view
        return replaced
