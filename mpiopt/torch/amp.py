"""``GradScaler``: torch's loss scaler whose overflow check agrees across a ``DistributedOptimizer``'s ranks.

Every rank then backs off and grows its scale together, as under DDP (docs/torch.md, "Mixed precision").
"""

from __future__ import annotations

from typing import Any, Dict

import torch

from .optimizer import DistributedOptimizer

__all__ = ["GradScaler"]


class GradScaler(torch.amp.GradScaler):
    """``torch.amp.GradScaler`` whose overflow check agrees across the ranks of a :class:`DistributedOptimizer`.

    Used as torch's; each check of a ``DistributedOptimizer``'s gradients is one small collective, so every rank calls alike.
    """

    # torch's one place where a check's per-device overflow flags are made: the scaler's own check
    # before an amp-aware optimizer's step, and unscale_() (as torch's ShardedGradScaler does).
    def _unscale_grads_(self, optimizer: Any, inv_scale: torch.Tensor, found_inf: torch.Tensor, allow_fp16: bool) -> Dict[Any, torch.Tensor]:
        per_device = super()._unscale_grads_(optimizer, inv_scale, found_inf, allow_fp16)
        if isinstance(optimizer, DistributedOptimizer):
            optimizer.agree_on_overflow(per_device)
        return per_device
