"""The ranks' vote on a GradScaler's verdict: any rank's overflow makes every rank skip, so none waits alone.

Under torch DDP the averaged gradient carries an overflow to every rank; here
the check reads each rank's own gradient, so the ranks vote (one Allreduce
of three numbers on the control communicator, only when a scaler is used).
"""

from __future__ import annotations

import warnings
from typing import Any, Dict, NamedTuple, Optional

import numpy as np
import torch

from ..comm import Comm

__all__ = ["ScalerVote", "Verdict"]


class Verdict(NamedTuple):
    """What every rank does with this step's scaled gradient."""

    skip: bool  #: some rank overflowed
    inverse_scale: Optional[torch.Tensor]  #: to unscale with; None: nothing to unscale
    same_scale: bool  #: every rank's scale is the same (a sum of scaled gradients then unscales exactly)


NO_SCALER = Verdict(False, None, True)


class ScalerVote:
    """Agrees on overflows over ``control`` (a communicator every rank of the optimizer calls alike)."""

    def __init__(self, control: Comm) -> None:
        self.control = control
        self._votes = np.zeros(3)  # overflow somewhere, largest scale, -smallest scale
        self._warned = False

    def agree(self, found_inf_per_device: Dict[Any, torch.Tensor]) -> None:
        """Make a check's overflow flags every rank's maximum, in place (:class:`mpiopt.torch.GradScaler`'s check)."""
        flags = list(found_inf_per_device.values())
        self._votes[:] = (max((float(flag) for flag in flags), default=0.0), 0.0, 0.0)
        self.control.vote(self._votes)
        for flag in flags:
            flag.fill_(self._votes[0])

    def verdict(self, optimizer: torch.optim.Optimizer, dtype: torch.dtype, resends: bool) -> Verdict:
        """The verdict on what ``GradScaler.step(optimizer)`` handed it (``found_inf``, ``grad_scale``), or :data:`NO_SCALER`.

        ``resends``: whether diverged scales make the step send the gradient again (said in the warning).
        """
        found_inf = getattr(optimizer, "found_inf", None)
        if found_inf is None:
            return NO_SCALER
        scale = getattr(optimizer, "grad_scale", None)  # None: scaler.unscale_(opt) has unscaled already
        value = 0.0 if scale is None else float(scale)
        self._votes[:] = (1.0 if float(found_inf) > 0 else 0.0, value, -value)
        self.control.vote(self._votes)
        inverse = None if scale is None else scale.double().reciprocal().float().to(dtype)
        same_scale = bool(self._votes[1] == -self._votes[2])
        if not same_scale and not self._warned:
            self._warned = True
            warnings.warn(
                "the ranks' GradScalers have different scales (an earlier overflow on some ranks only backed off those "
                "ranks' scales): use mpiopt.torch.GradScaler, whose overflow checks agree across the ranks as under torch "
                "DDP" + ("; until the scales agree each step sends the gradient twice" if resends else ""),
                stacklevel=4,
            )
        return Verdict(bool(self._votes[0]), inverse, same_scale)
