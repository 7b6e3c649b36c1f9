"""The local optimizer step shared by every algorithm: torch.optim.SGD's rule.

``g = grad + weight_decay * x``; with momentum ``b = momentum * b + (1 -
dampening) * g`` (``b = g`` at the first step), then ``g = g + momentum * b``
(Nesterov) or ``g = b``; finally ``x = x - lr * g``.  The arithmetic lives in
:func:`mpiopt.kernels.update.sgd_update` (one fused pass over memory on numpy
when its C loop was built); a step allocates nothing after the first.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Tuple, Union

from ..arrays import array_module, empty_apart
from ..kernels.update import Merge, all_finite, divide_finite, merge_average, sgd_update
from .schema import Hyperparameter, Schema, boolean, in_range, positive

__all__ = ["LocalSGD", "InnerUpdate", "LocalStepState", "LOCAL_SGD"]

#: torch.optim.SGD's keywords, every one per parameter group; each algorithm re-defaults them to its paper's values.
LOCAL_SGD = Schema(
    Hyperparameter("momentum", 0.0, in_range(0.0, 1.0, high_open=True), "momentum factor, in [0, 1)", per_group=True),
    Hyperparameter("dampening", 0.0, in_range(0.0, 1.0), "dampening of the momentum, in [0, 1]", per_group=True),
    Hyperparameter("nesterov", False, boolean(), "Nesterov momentum (needs momentum > 0 and dampening 0)", per_group=True),
    Hyperparameter("weight_decay", 0.0, positive(allow_zero=True), "L2 penalty added to the gradient", per_group=True),
)


class LocalSGD:
    """Momentum SGD on a flat buffer, exactly as ``torch.optim.SGD`` defines it.

    Parameters
    ----------
    momentum : float
        Momentum factor in [0, 1).
    dampening : float
        Dampening for momentum in [0, 1].
    nesterov : bool
        Nesterov momentum (needs ``momentum > 0`` and ``dampening == 0``).
    weight_decay : float
        L2 penalty added to the gradient.
    """

    def __init__(self, momentum: float = 0.0, dampening: float = 0.0, nesterov: bool = False, weight_decay: float = 0.0) -> None:
        self.momentum = LOCAL_SGD["momentum"].validate(momentum)
        self.dampening = LOCAL_SGD["dampening"].validate(dampening)
        self.weight_decay = float(LOCAL_SGD["weight_decay"].validate(weight_decay))
        LOCAL_SGD["nesterov"].validate(nesterov)
        if nesterov and (self.momentum == 0 or self.dampening != 0):
            raise ValueError(f"nesterov=True needs momentum > 0 and dampening = 0, got momentum={momentum}, dampening={dampening}")
        self.nesterov = nesterov
        self.buffer: Optional[Any] = None  # momentum buffer, allocated at the first step
        self._work: List[Any] = []  # scratch of the array code (no fused loop: other dtypes, no C compiler): filled at the first step
        # Parameter groups: contiguous [start, stop) slices, each with its own lr and local hyperparameters (set_groups).
        self.groups: Optional[List[Tuple[int, int]]] = None
        self.group_values: List[Dict[str, Any]] = []
        self._group_work: List[List[Any]] = []

    @classmethod
    def from_values(cls, values: Mapping[str, Any]) -> "LocalSGD":
        """The update of an algorithm's checked :data:`LOCAL_SGD` values (the one place they become a ``LocalSGD``)."""
        return cls(**LOCAL_SGD.pick(values))

    def set_groups(self, bounds: Sequence[Tuple[int, int]]) -> None:
        """Run the update group by group over these contiguous slices (each with :attr:`group_values`' settings)."""
        self.groups = [(int(a), int(b)) for a, b in bounds]
        self.group_values = [dict(self.hyperparameters()) for _ in self.groups]
        self._group_work = [[] for _ in self.groups]

    def set_group_values(self, values: Sequence[Dict[str, Any]]) -> None:
        """Each group's ``lr``, ``momentum``, ``dampening``, ``nesterov``, ``weight_decay`` for the next steps (checked)."""
        if self.groups is None or len(values) != len(self.groups):
            raise ValueError(f"expected the values of {0 if self.groups is None else len(self.groups)} groups, got {len(values)}")
        checked = []
        for index, group in enumerate(values):
            out = {key: LOCAL_SGD[key].validate(group[key]) if key in LOCAL_SGD else group[key] for key in group}
            if out.get("nesterov") and (out.get("momentum", 0) == 0 or out.get("dampening", 0) != 0):
                raise ValueError(f"parameter group {index}: nesterov=True needs momentum > 0 and dampening = 0, got {group}")
            checked.append(out)
        self.group_values = checked
    def hyperparameters(self) -> Dict[str, Any]:
        return {"momentum": self.momentum, "dampening": self.dampening, "nesterov": self.nesterov, "weight_decay": self.weight_decay}

    def allocate(self, params: Any) -> None:
        """Forget the scratch of earlier parameters; it and the momentum buffer appear at the first step.

        The fused C loop needs no scratch; the array code allocates its own
        once (in ``apply``) and reuses it.
        """
        self._work = []

    def apply(
        self,
        params: Any,
        grad: Any,
        lr: float,
        grad_divisor: int = 1,
        *,
        copy_to: Union[None, Any, Sequence[Any]] = None,
        merge: Optional[Merge] = None,
        check_finite: bool = False,
        grad_support: Optional[Tuple[Any, Any]] = None,
    ) -> Optional[bool]:
        """``params -= lr * direction(grad / grad_divisor)`` in place; ``grad`` is left unchanged.

        ``grad_divisor`` turns an Allreduce's sum into the average in the same
        pass, with the bits of ``grad /= grad_divisor`` first.  ``copy_to``,
        ``merge``, ``check_finite`` and ``grad_support`` are :func:`~mpiopt.kernels.update.sgd_update`'s:
        copies of the new ``params``, or DaSGD's merge of an average into
        them, in the same pass; with ``check_finite`` the return value says
        whether every element of ``grad`` was finite (else None); a sparse
        ``grad`` can be given by its ``grad_support`` (indices, values).

        The same floating-point operations as ``torch.optim.SGD``, each rounded
        on its own (torch fuses ``a + alpha * b`` into one rounding: see
        :mod:`mpiopt.kernels.update`).
        """
        if self.groups is not None and len(self.groups) > 1:
            return self._apply_groups(params, grad, lr, grad_divisor, copy_to, merge, check_finite)
        values = self.group_values[0] if self.groups is not None else {}
        lr = values.get("lr", lr)
        momentum = values.get("momentum", self.momentum)
        first_step = bool(momentum) and self.buffer is None
        if first_step:
            self.buffer = empty_apart(params, near=(grad,))
        return sgd_update(
            params,
            grad,
            self.buffer,
            lr=lr,
            momentum=momentum,
            dampening=values.get("dampening", self.dampening),
            nesterov=values.get("nesterov", self.nesterov),
            weight_decay=values.get("weight_decay", self.weight_decay),
            first_step=first_step,
            grad_divisor=grad_divisor,
            work=self._work,
            copy_to=copy_to,
            merge=merge,
            check_finite=check_finite,
            grad_support=grad_support,
        )


    def _apply_groups(
        self, params: Any, grad: Any, lr: float, grad_divisor: int, copy_to: Union[None, Any, Sequence[Any]],
        merge: Optional[Merge], check_finite: bool,
    ) -> Optional[bool]:
        """:meth:`apply` group by group: each slice with its group's settings (``lr`` too); one call per group."""
        first_step = any(v.get("momentum", self.momentum) for v in self.group_values) and self.buffer is None
        if first_step:  # zeros: a group whose momentum starts later begins from b = (1 - dampening) g, as from b = g
            self.buffer = empty_apart(params, near=(grad,), zero=True)
        copies = () if copy_to is None else ((copy_to,) if hasattr(copy_to, "shape") else tuple(copy_to))
        finite: Optional[bool] = True if check_finite else None
        for (a, b), values, work in zip(self.groups, self.group_values, self._group_work):
            momentum = values.get("momentum", self.momentum)
            part = None if merge is None else merge._replace(
                snapshot=None if merge.snapshot is None else merge.snapshot[a:b], total=merge.total[a:b])
            ok = sgd_update(
                params[a:b], grad[a:b], None if self.buffer is None else self.buffer[a:b], lr=values.get("lr", lr),
                momentum=momentum, dampening=values.get("dampening", self.dampening),
                nesterov=values.get("nesterov", self.nesterov), weight_decay=values.get("weight_decay", self.weight_decay),
                first_step=first_step and bool(momentum), grad_divisor=grad_divisor, work=work,
                copy_to=tuple(c[a:b] for c in copies) or None, merge=part, check_finite=check_finite,
            )
            if check_finite:
                finite = finite and bool(ok)
        return finite


class InnerUpdate:
    """The caller's optimizer as the local step, in :class:`LocalSGD`'s place (``Algorithm.use_inner``).

    ``step(params, grad)`` updates ``params`` in place from ``grad`` with the
    caller's own rule, learning rate and state (a ``torch.optim`` optimizer
    over views of the same memory, say).  What :class:`LocalSGD` fuses into
    its one pass takes passes of its own here, around the caller's step
    (DaSGD's copies and merge), or rides in one that must be made anyway:
    the finite check of an exchanged sum in its division by the world size
    (before the step: a non-finite one stops it); else the check reads the
    gradient on a helper thread while the caller's step runs (a non-finite
    gradient is then found after the step, as the built-in update's fused
    check finds it: ``nan_policy="raise"`` ends the job).

    Parameters
    ----------
    step : callable
        ``step(params, grad) -> None``.
    name : str
        What the step is (``"AdamW"``): recorded among the hyperparameters,
        so ranks and checkpoints agree on it.
    grad_buffer : array, optional
        Where ``step`` reads its gradient (a torch optimizer: the
        parameters' ``.grad`` views): an exchanged gradient is written there
        (the division by the world size in the same pass) and ``step`` gets
        this buffer.  Without one, a buffer of this object's own.
    """

    #: No momentum buffer of mpiopt's: the caller's optimizer keeps its own state.
    buffer = None

    def __init__(self, step: Callable[[Any, Any], None], name: str, grad_buffer: Optional[Any] = None) -> None:
        if not callable(step):
            raise TypeError(f"the inner step must be callable, got {type(step).__name__}")
        self.step = step
        self.name = str(name)
        self.grad_buffer = grad_buffer
        self._mean: Optional[Any] = None  # grad / grad_divisor without a grad_buffer, allocated once

    def hyperparameters(self) -> Dict[str, Any]:
        return {"inner": self.name}

    def allocate(self, params: Any) -> None:
        self._mean = None

    def apply(
        self,
        params: Any,
        grad: Any,
        lr: float,
        grad_divisor: int = 1,
        *,
        copy_to: Union[None, Any, Sequence[Any]] = None,
        merge: Optional[Merge] = None,
        check_finite: bool = False,
        grad_support: Optional[Tuple[Any, Any]] = None,
    ) -> Optional[bool]:
        """:meth:`LocalSGD.apply`'s contract with the caller's step (``lr`` is the caller's optimizer's own; ``grad`` dense).

        With ``check_finite``, False for a non-finite ``grad``: the caller's
        step was not taken where the check rode in the division, was taken
        where it ran beside the step (see the class docstring).
        """
        if grad_support is not None:
            raise ValueError("an inner optimizer reads the dense gradient: grad_support is for the built-in update")
        finite = None
        target = self.grad_buffer
        if target is None and grad_divisor != 1:
            if self._mean is None:
                self._mean = empty_apart(grad)
            target = self._mean
        if target is not None and grad_divisor != 1:  # one pass: the mean written where the step reads it, checked on the way
            if check_finite:
                finite = divide_finite(grad, grad_divisor, target)
            else:
                array_module(grad).divide(grad, grad_divisor, out=target)
            grad = target
        checking = None
        if check_finite and finite is None:
            # Nothing to ride in (one rank): a helper thread reads the gradient while the caller's step runs.
            checking = _checker().submit(all_finite, grad)
        elif finite is False:
            return False  # the caller's optimizer has not stepped: the caller ends the job or raises
        if target is not None and grad is not target:  # copied where the step reads it
            target[...] = grad
            grad = target
        self.step(params, grad)
        if checking is not None:
            finite = bool(checking.result())
        if merge is not None:
            merge_average(params, merge.snapshot, merge.total, merge.world_size, merge.rule, merge.proportion)
        for target in () if copy_to is None else ((copy_to,) if hasattr(copy_to, "shape") else copy_to):
            target[...] = params
        return finite


_CHECKER: Optional[ThreadPoolExecutor] = None


def _checker() -> ThreadPoolExecutor:
    """The one helper thread that checks an inner optimizer's gradient while it steps (started at the first use)."""
    global _CHECKER
    if _CHECKER is None:
        _CHECKER = ThreadPoolExecutor(max_workers=1, thread_name_prefix="mpiopt-check")
    return _CHECKER


class LocalStepState:
    """Mixin for algorithms whose local step is a :class:`LocalSGD` in ``self.local``.

    Exposes its momentum buffer as the state attribute ``momentum_buffer``
    (list it in ``state_arrays``).
    """

    local: LocalSGD

    @property
    def momentum_buffer(self) -> Optional[Any]:
        return self.local.buffer

    @momentum_buffer.setter
    def momentum_buffer(self, value: Optional[Any]) -> None:
        self.local.buffer = value
