"""torch.optim.SGD's local update, DaSGD's merge, EASGD's pull and DiLoCo's outer step as one function each: a fused pass, or array code.

Every backend rounds each product and sum to the parameters' dtype on its own, in the same order, so all give
the same bits (not quite torch's: its CPU kernels use FMA).  Formulas and rounding: docs/internals-kernels.md.
"""

from __future__ import annotations

import numbers
from typing import Any, List, NamedTuple, Optional, Sequence, Tuple, Union

import numpy as np

from ..arrays import array_module, empty_apart
from . import _cuda
from ._backend import c_loop_takes, check_array, check_count, load_extension
from .threads import get_num_threads

# The optional fused C loop (setup.py); without it the array code below runs, with the same bits.
_updatec = load_extension("_updatec", 5)

__all__ = ["Merge", "all_finite", "divide_finite", "elastic_pull", "fused_update_available", "merge_average", "mix_into", "outer_sgd", "reads_support", "sgd_update"]

#: How many arrays :func:`sgd_update`'s ``copy_to`` may name.
MAX_COPIES = 2
#: :func:`merge_average`'s rules (DaSGD's ``merge``).
MERGE_RULES = ("delayed", "proportion")

def fused_update_available(params: Any) -> bool:
    """Whether :func:`sgd_update` on arrays like ``params`` runs one fused pass (C-contiguous float32/float64)."""
    return c_loop_takes(_updatec, params) or _cuda.takes(params)


def reads_support(params: Any, grad_support: Optional[Tuple[Any, Any]]) -> bool:
    """Whether :func:`sgd_update` reads ``grad_support`` instead of ``grad`` (C loop, support under an eighth of the entries)."""
    return (
        grad_support is not None and c_loop_takes(_updatec, params) and 8 * grad_support[0].shape[0] < params.shape[0]
        and all(isinstance(a, np.ndarray) and a.flags.c_contiguous for a in grad_support)
    )


def _fused(params: Any, arrays: List[Tuple[str, Any]]) -> bool:
    """Whether the fused pass takes ``params`` and the other (checked) ``(name, array)`` operands."""
    return fused_update_available(params) and all(arr.flags.c_contiguous for _, arr in arrays)


def all_finite(arr: Any) -> bool:
    """Whether every element of the floating-point array ``arr`` is finite: one fused pass, else a sum checked exactly on doubt."""
    if c_loop_takes(_updatec, arr):
        return _updatec.all_finite(arr, get_num_threads())
    if _cuda.takes(arr):
        return _cuda.all_finite(arr)
    xp = array_module(arr)
    with np.errstate(all="ignore"):  # the sum may overflow: then the exact check decides
        return bool(xp.isfinite(arr.sum())) or bool(xp.isfinite(arr).all())


def divide_finite(grad: Any, divisor: int, out: Any) -> bool:
    """``out = grad / divisor`` and whether every element of ``grad`` is finite, in one pass where the C loop takes them.

    An Allreduce's sum becomes the mean, checked on the way; ``out`` may be ``grad``.
    """
    if c_loop_takes(_updatec, grad) and c_loop_takes(_updatec, out) and grad.dtype == out.dtype and grad.shape == out.shape:
        return _updatec.all_finite(grad, get_num_threads(), out, float(divisor))
    array_module(grad).divide(grad, divisor, out=out)
    return all_finite(out)


def _real(name: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not np.isfinite(value):
        raise ValueError(f"{name} must be a finite real number, got {value!r}")
    return float(value)


def _check_like(xp: Any, params: Any, arrays: List[Tuple[str, Any]]) -> None:
    """Each ``(name, array)`` like ``params`` (1-D, its dtype, shape and backend), and no two of them overlapping."""
    for name, arr in arrays:
        check_array(name, arr, ndim=1, kinds="f", dtype=params.dtype)
        if array_module(arr) is not xp or arr.shape != params.shape:
            raise ValueError(f"{name} must be a {xp.__name__} array of shape {params.shape}, got {type(arr).__name__} {arr.shape}")
    everything = [("params", params)] + arrays
    if xp is np:
        for i, (first_name, first) in enumerate(everything):
            for second_name, second in everything[i + 1:]:
                if np.may_share_memory(first, second):
                    raise ValueError(f"{first_name} and {second_name} must not overlap")


def _copies(copy_to: Union[None, Any, Sequence[Any]]) -> List[Tuple[str, Any]]:
    """``copy_to`` as ``(name, array)`` pairs, at most :data:`MAX_COPIES`."""
    if copy_to is None:
        return []
    if not isinstance(copy_to, (list, tuple)):
        return [("copy_to", copy_to)]
    if len(copy_to) > MAX_COPIES:
        raise ValueError(f"copy_to takes at most {MAX_COPIES} arrays (the fused loop's outputs), got {len(copy_to)}")
    return [(f"copy_to[{i}]", copy) for i, copy in enumerate(copy_to)]


class Merge(NamedTuple):
    """:func:`merge_average`'s arguments after ``params``, for :func:`sgd_update` to fuse (``snapshot`` unread by ``"proportion"``)."""

    snapshot: Any
    total: Any
    world_size: int
    rule: str = "delayed"
    proportion: float = 0.25


def _checked_merge(merge: Merge) -> Merge:
    """``merge`` with its scalars checked (``ValueError`` naming the bad one)."""
    if merge.rule not in MERGE_RULES:
        raise ValueError(f"rule must be one of {MERGE_RULES}, got {merge.rule!r}")
    world_size = check_count("world_size", merge.world_size, 1)
    return merge._replace(world_size=world_size, proportion=_real("proportion", merge.proportion))


def _merge_operands(merge: Merge) -> List[Tuple[str, Any]]:
    """The arrays ``merge`` reads, named (the proportion rule reads no snapshot)."""
    return [("total", merge.total)] + ([("snapshot", merge.snapshot)] if merge.rule == "delayed" else [])


def _c_merge(merge: Merge) -> Tuple[Any, Any, int, Optional[float]]:
    """``merge`` as the C loops take it: (snapshot, total, world size, proportion or None for the delayed rule)."""
    return merge.snapshot, merge.total, merge.world_size, merge.proportion if merge.rule == "proportion" else None


def _array_merge(params: Any, merge: Merge) -> None:
    """The merge as numpy's in-place operations (the C loops round each as they do); ``total`` is overwritten."""
    average = merge.total
    average /= merge.world_size
    if merge.rule == "delayed":
        params -= merge.snapshot
        params += average
    else:
        params *= merge.proportion
        average *= 1.0 - merge.proportion
        params += average


def sgd_update(
    params: Any,
    grad: Any,
    buffer: Optional[Any] = None,
    *,
    lr: float,
    momentum: float = 0.0,
    dampening: float = 0.0,
    nesterov: bool = False,
    weight_decay: float = 0.0,
    first_step: bool = False,
    grad_divisor: int = 1,
    check_finite: bool = False,
    work: Optional[List[Any]] = None,
    copy_to: Union[None, Any, Sequence[Any]] = None,
    merge: Optional[Merge] = None,
    grad_support: Optional[Tuple[Any, Any]] = None,
) -> Optional[bool]:
    """``params -= lr * step(grad)`` in place, with torch.optim.SGD's momentum, dampening, Nesterov and weight decay.

    Parameters
    ----------
    buffer : array, optional
        Momentum buffer, needed when ``momentum != 0``; its contents are ignored at ``first_step``.
    grad_divisor : int
        Use ``grad / grad_divisor`` (an Allreduce's sum becomes the mean in the same pass).
    check_finite : bool
        Also return whether ``grad`` is finite (free in the fused loop).
    work : list of array, optional
        Scratch for the array code, appended to as needed, so a caller passing the same list allocates once.
    copy_to, merge, grad_support
        Fused extras (DaSGD's copies and merge, a sparse gradient's support): docs/internals-kernels.md.

    Raises
    ------
    TypeError, ValueError
        Mismatched or overlapping arrays, a missing buffer, or a non-finite hyperparameter.
    """
    xp = check_array("params", params, ndim=1, kinds="f")
    lr, momentum, dampening, weight_decay = (
        _real(name, value)
        for name, value in (("lr", lr), ("momentum", momentum), ("dampening", dampening), ("weight_decay", weight_decay))
    )
    if not isinstance(nesterov, bool):
        raise TypeError(f"nesterov must be a bool, got {nesterov!r}")
    grad_divisor = check_count("grad_divisor", grad_divisor, 1)
    copies = _copies(copy_to)
    if merge is not None:
        if copies:
            raise ValueError("copy_to and merge exclude each other: the fused loop copies only without a merge")
        merge = _checked_merge(Merge(*merge))
    arrays = [("grad", grad)] + ([("buffer", buffer)] if momentum else []) + copies
    arrays += _merge_operands(merge) if merge is not None else []
    if momentum and buffer is None:
        raise ValueError(f"momentum={momentum} needs a buffer, got buffer=None")
    _check_like(xp, params, arrays)
    if grad_support is not None:
        support, values = grad_support
        check_array("grad_support's indices", support, ndim=1, kinds="i", dtype=np.int32)
        check_array("grad_support's values", values, ndim=1, kinds="f", dtype=params.dtype)
        if values.shape != support.shape:
            raise ValueError(f"grad_support's values must match its indices' shape {support.shape}, got {values.shape}")
    if _fused(params, arrays):
        c_merge = _c_merge(merge) if merge is not None else None
        if xp is not np:
            return _cuda.sgd(
                params, grad, buffer if momentum else None, tuple(copy for _, copy in copies), c_merge,
                grad_divisor, lr, weight_decay, momentum, dampening, nesterov, bool(first_step), bool(check_finite),
            )
        outputs = [copy for _, copy in copies] + [None] * (MAX_COPIES - len(copies))
        support = grad_support if reads_support(params, grad_support) else (None, None)
        finite = _updatec.sgd(
            params, grad, buffer if momentum else None, *outputs, c_merge, grad_divisor, lr, weight_decay, momentum,
            dampening, nesterov, bool(first_step), get_num_threads(), *support,
        )
        return finite if check_finite else None
    work = [] if work is None else work
    # A second array where an operand must be formed while work[0] holds d (see _array_update).
    d_in_work = grad_divisor != 1 or weight_decay
    needed = 2 if (weight_decay and grad_divisor != 1) or (nesterov and momentum and d_in_work) else 1
    work.extend(empty_apart(params) for _ in range(needed - len(work)))
    with np.errstate(all="ignore"):  # inf - inf is NaN here as in the C loop, silently in both
        _array_update(xp, params, grad, buffer, grad_divisor, lr, momentum, dampening, nesterov, weight_decay, bool(first_step), work)
        if merge is not None:
            _array_merge(params, merge)
    for _, copy in copies:
        xp.copyto(copy, params)
    return all_finite(grad) if check_finite else None


def _array_update(
    xp: Any,
    params: Any,
    grad: Any,
    buffer: Any,
    grad_divisor: int,
    lr: float,
    momentum: float,
    dampening: float,
    nesterov: bool,
    weight_decay: float,
    first_step: bool,
    work: List[Any],
) -> None:
    """The update as array calls, one pass per operation of the fused loop, scalars in the parameters' dtype."""
    scalar = params.dtype.type
    out = work[0]
    d = grad
    if grad_divisor != 1:
        xp.divide(grad, scalar(grad_divisor), out=out)
        d = out
    if weight_decay:
        term = out if d is grad else work[1]
        xp.multiply(params, scalar(weight_decay), out=term)
        xp.add(term, d, out=out)
        d = out
    step = d
    if momentum:
        if first_step:
            xp.copyto(buffer, d)
        else:
            buffer *= scalar(momentum)
            if dampening:  # no Nesterov here, so d is not needed again
                xp.multiply(d, scalar(1.0 - dampening), out=out)
                buffer += out
            else:
                buffer += d
        if nesterov:
            term = out if d is grad else work[1]
            xp.multiply(buffer, scalar(momentum), out=term)
            xp.add(d, term, out=out)
            step = out
        else:
            step = buffer
    xp.multiply(step, scalar(lr), out=out)
    params -= out


def merge_average(params: Any, snapshot: Any, total: Any, world_size: int, rule: str = "delayed", proportion: float = 0.25) -> None:
    """DaSGD's merge of the average ``total / world_size`` into ``params``, in place, by ``rule`` ``"delayed"`` or ``"proportion"``.

    The bits of numpy's in-place passes (docs/internals-kernels.md); ``total`` is scratch.  ``TypeError`` or
    ``ValueError`` for mismatched or overlapping arrays or a bad ``world_size``, ``rule`` or ``proportion``.
    """
    xp = check_array("params", params, ndim=1, kinds="f")
    merge = _checked_merge(Merge(snapshot, total, world_size, rule, proportion))
    arrays = _merge_operands(merge)
    _check_like(xp, params, arrays)
    if _fused(params, arrays):
        if xp is np:
            _updatec.merge_average(params, *_c_merge(merge), get_num_threads())
        else:
            _cuda.merge_average(params, *_c_merge(merge))
        return
    with np.errstate(all="ignore"):  # inf - inf is NaN here as in the C loop, silently in both
        _array_merge(params, merge)


def elastic_pull(params: Any, center: Any, total: Any, world_size: int, alpha: float, beta: float, work: Optional[Any] = None) -> None:
    """EASGD's pull of a worker and the centre towards each other, in place (Zhang et al. eqs. (5)-(6) without the gradient).

    ``params -= alpha (params - center)``; ``center += beta (total / world_size - center)`` from the pre-pull
    ``params``.  ``total`` and ``work`` are scratch; the bits of numpy's passes.
    """
    xp = check_array("params", params, ndim=1, kinds="f")
    world_size = check_count("world_size", world_size, 1)
    alpha, beta = _real("alpha", alpha), _real("beta", beta)
    operands = [("center", center), ("total", total)]
    _check_like(xp, params, operands + ([("work", work)] if work is not None else []))
    if _fused(params, operands):
        if xp is np:
            _updatec.elastic_pull(params, center, total, float(world_size), alpha, beta, get_num_threads())
        else:
            _cuda.elastic_pull(params, center, total, world_size, alpha, beta)
        return
    work = empty_apart(params) if work is None else work
    with np.errstate(all="ignore"):  # inf - inf is NaN here as in the C loop, silently in both
        total /= world_size
        xp.subtract(params, center, out=work)
        work *= alpha
        params -= work
        total -= center
        total *= beta
        center += total


def outer_sgd(
    params: Any, total: Any, world_size: int, buffer: Optional[Any], *, lr: float, momentum: float, nesterov: bool,
    out: Optional[Any] = None, alpha: float = 0.0, work: Optional[List[Any]] = None,
) -> None:
    """DiLoCo's outer step in place: :func:`sgd_update` on the pseudo-gradient ``params - total / world_size``.

    Parameters
    ----------
    params, total
        The outer model, updated in place, and the sum of ``world_size`` models (scratch: unchanged by the
        fused pass, overwritten by the array code).
    buffer : array, optional
        The momentum, needed when ``momentum != 0``; never a first step (a zero buffer gives torch's first
        ``b = d`` bitwise).
    out : array, optional
        Receives the new ``params`` (``alpha = 0``) or Streaming DiLoCo's mix ``out * alpha + params * (1 - alpha)``.
    work : list of array, optional
        Scratch for the array code, as :func:`sgd_update`'s.

    One pass over ``(params, total, buffer, out)`` where the fused loops take them, else array code with the
    same bits.  ``TypeError``/``ValueError`` for mismatched or overlapping arrays or a bad scalar, naming it.
    """
    xp = check_array("params", params, ndim=1, kinds="f")
    world_size = check_count("world_size", world_size, 1)
    lr, momentum, alpha = _real("lr", lr), _real("momentum", momentum), _real("alpha", alpha)
    if momentum and buffer is None:
        raise ValueError(f"momentum={momentum} needs a buffer, got buffer=None")
    if alpha and out is None:
        raise ValueError(f"alpha={alpha} mixes into out, got out=None")
    arrays = [("total", total)] + ([("buffer", buffer)] if momentum else []) + ([("out", out)] if out is not None else [])
    _check_like(xp, params, arrays)
    nesterov = bool(nesterov) and momentum != 0.0
    buffer = buffer if momentum else None
    if _fused(params, arrays):
        if xp is np:
            _updatec.outer_sgd(params, total, buffer, out, float(world_size), lr, momentum, alpha, nesterov, get_num_threads())
        else:
            _cuda.outer_sgd(params, total, buffer, out, world_size, lr, momentum, alpha, nesterov)
        return
    with np.errstate(all="ignore"):  # inf - inf is NaN here as in the C loop, silently in both
        total /= world_size
        xp.subtract(params, total, out=total)
        sgd_update(params, total, buffer, lr=lr, momentum=momentum, nesterov=nesterov, work=work, copy_to=None if alpha else out)
        if alpha:  # total is scratch again
            mix_into(out, params, alpha, total)


def mix_into(out: Any, result: Any, alpha: float, scratch: Any) -> None:
    """Streaming DiLoCo's ``out = out * alpha + result * (1 - alpha)`` as array passes (``scratch`` overwritten)."""
    array_module(out).multiply(result, 1.0 - alpha, out=scratch)
    out *= alpha
    out += scratch
