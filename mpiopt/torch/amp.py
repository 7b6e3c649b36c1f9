"""``GradScaler``: torch's loss scaler, with the ranks of a ``DistributedOptimizer`` deciding overflows together.

torch's ``GradScaler`` checks this rank's gradients for an overflow and
updates this rank's scale from that.  Under torch DDP the gradient it checks
is the averaged one, which carries any rank's overflow to every rank: the
ranks back off and grow their scales together.  With
:class:`~mpiopt.torch.DistributedOptimizer` the check reads this rank's own
gradient (the exchange has not completed, or overlaps backward), so after an
overflow on some ranks only every rank skips the step (the optimizer decides
that together) but only those ranks back off.  The scales then differ: still
correct (each rank unscales its own gradient before the exchange), but with
``overlap=True`` every step until they agree again costs a second Allreduce,
and the run no longer takes the steps DDP would.

:class:`GradScaler` makes the check's verdict the maximum over the ranks,
so the scales stay equal, as under DDP.
"""

from __future__ import annotations

from typing import Any, Dict

import torch

from .optimizer import DistributedOptimizer

__all__ = ["GradScaler"]


class GradScaler(torch.amp.GradScaler):
    """``torch.amp.GradScaler`` whose overflow check agrees across the ranks of a :class:`DistributedOptimizer`.

    Takes ``torch.amp.GradScaler``'s arguments and is used the same way
    (``scale``, ``step``, ``update``, ``unscale_``, ``state_dict``); for
    other optimizers it is torch's scaler unchanged.  Each check of a
    ``DistributedOptimizer``'s gradients (in ``step`` and ``unscale_``) is
    one small collective on the optimizer's control communicator, so every
    rank must call them alike, as with the optimizer itself.

    Examples
    --------
    >>> scaler = mpiopt.torch.GradScaler("cuda")
    >>> with torch.autocast("cuda", dtype=torch.float16):
    ...     loss = loss_fn(model(x), y)
    >>> scaler.scale(loss).backward()
    >>> scaler.step(opt)
    >>> scaler.update()                         # the same scale on every rank
    """

    # torch's one place where a check's per-device overflow flags are made: the scaler's own check
    # before an amp-aware optimizer's step, and unscale_() (as torch's ShardedGradScaler does).
    def _unscale_grads_(self, optimizer: Any, inv_scale: torch.Tensor, found_inf: torch.Tensor, allow_fp16: bool) -> Dict[Any, torch.Tensor]:
        per_device = super()._unscale_grads_(optimizer, inv_scale, found_inf, allow_fp16)
        if isinstance(optimizer, DistributedOptimizer):
            optimizer.agree_on_overflow(per_device)
        return per_device
