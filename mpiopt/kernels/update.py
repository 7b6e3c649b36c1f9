"""torch.optim.SGD's local update (and DaSGD's merge) as one function each: a fused C loop, or array code.

``g = grad / grad_divisor`` (an average's division folded in; skipped for 1),
``d = g + weight_decay * x``; with momentum ``b = momentum * b + (1 -
dampening) * d`` (``b = d`` at the first step), then ``s = d + momentum * b``
(Nesterov) or ``s = b``; without momentum ``s = d``; finally ``x = x - lr * s``,
and on request the new ``x`` is also written into one or two more arrays
(``copy_to``: DaSGD's snapshot and send buffer), or merged with an average
of models (``merge``: DaSGD's merge, :func:`merge_average`), in the same pass.

On numpy float32/float64 arrays the whole update is one pass over memory in
``mpiopt.kernels._updatec`` when it was built (long vectors split across
:mod:`~mpiopt.kernels.threads`' threads), on cupy ones one CUDA kernel
(:mod:`~mpiopt.kernels._cuda`); elsewhere (other dtypes, no C compiler)
the same operations run as array calls with ``out=``.  All three round every
product and sum to the parameters' dtype on its own, in the same order, so
they give the same bits (NaN payloads aside).  That is not quite
``torch.optim.SGD``: torch's CPU kernels compute ``a + alpha * b`` with a
fused multiply-add, which rounds once where this rounds twice.

:func:`merge_average` is DaSGD's merge of an averaged model, fused and
rounded the same way.
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
_updatec = load_extension("_updatec", 4)

__all__ = ["Merge", "all_finite", "divide_finite", "elastic_pull", "fused_update_available", "merge_average", "reads_support", "sgd_update"]

#: How many arrays :func:`sgd_update`'s ``copy_to`` may name.
MAX_COPIES = 2
#: :func:`merge_average`'s rules (DaSGD's ``merge``).
MERGE_RULES = ("delayed", "proportion")

def fused_update_available(params: Any) -> bool:
    """Whether :func:`sgd_update` on arrays like ``params`` runs one fused pass (needing no scratch).

    True for C-contiguous float32/float64 arrays: numpy ones when
    ``mpiopt.kernels._updatec`` was built (the C loop), cupy ones wherever the
    CUDA kernels compiled (:mod:`~mpiopt.kernels._cuda`).
    """
    return c_loop_takes(_updatec, params) or _cuda.takes(params)


def reads_support(params: Any, grad_support: Optional[Tuple[Any, Any]]) -> bool:
    """Whether :func:`sgd_update` on ``params`` reads ``grad_support``'s values instead of its ``grad``.

    True for the fused C loop (numpy) and a support of contiguous arrays
    holding fewer than an eighth of the entries (more saves little); the
    caller may then leave ``grad`` unwritten.
    """
    return (
        grad_support is not None and c_loop_takes(_updatec, params) and 8 * grad_support[0].shape[0] < params.shape[0]
        and all(isinstance(a, np.ndarray) and a.flags.c_contiguous for a in grad_support)
    )


def _fused(params: Any, arrays: List[Tuple[str, Any]]) -> bool:
    """Whether the fused pass takes ``params`` and the other (checked) ``(name, array)`` operands."""
    return fused_update_available(params) and all(arr.flags.c_contiguous for _, arr in arrays)


def all_finite(arr: Any) -> bool:
    """Whether every element of the floating-point array ``arr`` is finite (no NaN, no +-inf).

    One C pass (split across :func:`~mpiopt.kernels.threads.get_num_threads`
    threads) on contiguous numpy float32/float64 arrays when
    ``mpiopt.kernels._updatec`` was built, one CUDA kernel on contiguous
    cupy ones; otherwise one reduction (a finite
    sum means every element is finite), and only when it overflows or is
    not finite, the exact elementwise check.

    Parameters
    ----------
    arr : array
        numpy or cupy, floating point.

    Returns
    -------
    bool
    """
    if c_loop_takes(_updatec, arr):
        return _updatec.all_finite(arr, get_num_threads())
    if _cuda.takes(arr):
        return _cuda.all_finite(arr)
    xp = array_module(arr)
    with np.errstate(all="ignore"):  # the sum may overflow: then the exact check decides
        return bool(xp.isfinite(arr.sum())) or bool(xp.isfinite(arr).all())


def divide_finite(grad: Any, divisor: int, out: Any) -> bool:
    """``out = grad / divisor`` and whether every element of ``grad`` is finite, in one pass where the C loop takes them.

    An Allreduce's sum made the mean a caller's optimizer reads, checked on
    the way: the sum is not finite exactly when some rank's gradient was
    not, or the summation overflowed.  The bits of ``numpy.divide(grad,
    divisor, out=out)``; ``out`` may be ``grad``.  Elsewhere (cupy, other
    dtypes) the division and :func:`all_finite` of ``out`` in two passes.

    Parameters
    ----------
    grad, out : array
        Contiguous floating-point buffers of one dtype and length.
    divisor : int
        Positive.

    Returns
    -------
    bool
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
    """:func:`merge_average`'s arguments after ``params``: a merge for :func:`sgd_update` to fuse.

    Attributes
    ----------
    snapshot : array or None
        ``w_k``, the parameters when the averaging started (unread, and may
        be None, under the proportion rule).
    total : array
        The sum of ``w_k`` over the ranks (scratch afterwards).
    world_size : int
        The number of ranks summed.
    rule : {"delayed", "proportion"}
        DaSGD's merge rule (see :func:`merge_average`).
    proportion : float
        ``p`` of the proportion rule.
    """

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
    """``params -= lr * step(grad)`` in place, with torch.optim.SGD's momentum and weight decay.

    Parameters
    ----------
    params : array
        Parameters (1-D numpy or cupy, floating point), updated in place.
    grad : array
        Gradient, same length and dtype; left unchanged.
    buffer : array, optional
        Momentum buffer, same length and dtype, updated in place; needed when
        ``momentum != 0`` (ignored otherwise).  At the first step its contents
        are ignored and it becomes the (decayed) gradient.
    lr, momentum, dampening, weight_decay : float
        As in ``torch.optim.SGD``; each is rounded to the parameters' dtype
        (``1 - dampening`` is computed first, in float64).
    nesterov : bool
        Nesterov momentum.
    first_step : bool
        The buffer's first step: ``b = d`` instead of ``b = momentum * b + ...``.
    grad_divisor : int
        Use ``grad / grad_divisor`` (rounded to the dtype, as numpy's ``grad /=
        grad_divisor``) as the gradient: an Allreduce's sum becomes the average
        in the same pass.
    check_finite : bool
        Also report whether every element of ``grad`` is finite (free in the
        fused loop; one more pass in the array code).
    work : list of array, optional
        Scratch for the array code: the arrays it lacks are allocated and
        appended, so a caller that passes the same list every time allocates
        once.  The fused loop uses none.
    copy_to : array or sequence of up to 2 arrays, optional
        Also receive the updated parameters (same length, dtype and backend,
        overlapping none of the others): the copies a caller would make after
        the update, written in the same pass by the fused loop.
    merge : Merge, optional
        Then ``merge_average(params, *merge)``, in the same pass on the fused
        loop (with its bits); not together with ``copy_to``.
    grad_support : (indices, values), optional
        The caller's promise that ``grad`` is ``values`` at ``indices`` (int32,
        unique, ascending; ``values`` of ``grad``'s dtype) and +0.0
        elsewhere: the fused C loop then reads these instead of ``grad``, one
        stream of memory fewer for a sparse gradient (Top-k's aggregate,
        ``P k`` of ``d`` entries), with the same bits.  The CUDA kernel, the
        array code, and supports of more than an eighth of the entries
        (where the saving is small) read ``grad``.

    Returns
    -------
    bool or None
        With ``check_finite``, whether every element of ``grad`` (before the
        division) is finite; else None.

    Raises
    ------
    TypeError, ValueError
        Arrays not 1-D or of a different length, dtype or backend, overlapping arrays, a
        missing buffer, or a non-finite hyperparameter.
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
    """The update as array calls: the fused loop's operations, one pass each.

    Each intermediate goes straight into ``work[0]``; ``work[1]`` holds a
    second operand (``weight_decay * x`` or ``momentum * b``) where ``work[0]``
    already holds ``d``.  The scalars are cast to the parameters' dtype so
    that numpy computes in that dtype, as the C loop does.
    """
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
    """Merge the average of ``world_size`` models, ``total / world_size``, into ``params`` in place (DaSGD's merge).

    ``rule="delayed"``: ``params = (params - snapshot) + total / world_size``;
    ``rule="proportion"``: ``params = proportion * params + (1 - proportion) *
    (total / world_size)`` (``snapshot`` unread).  Each operation is rounded
    to the parameters' dtype on its own, as numpy's in-place ``total /=
    world_size; params -= snapshot; params += total`` (or ``params *= p;
    total *= 1 - p; params += total``) round it, with the scalars cast to the
    dtype (``1 - p`` formed in float64 first): the C loop, one pass on numpy
    float32/float64 arrays, gives those bits.

    Parameters
    ----------
    params : array
        Parameters (1-D numpy or cupy, floating point), updated in place.
    snapshot : array
        The parameters when the averaging started (same length, dtype and
        backend); left unchanged.
    total : array
        The sum of ``world_size`` models (same length, dtype and backend).
        Scratch: the array code leaves its scaled average there, the C loop
        leaves it unchanged.
    world_size : int
        Models summed in ``total`` (>= 1).
    rule : {"delayed", "proportion"}
        Merge rule.
    proportion : float
        ``p`` of ``rule="proportion"``, a finite real number.

    Raises
    ------
    TypeError, ValueError
        Arrays not 1-D, of a different length, dtype or backend, or
        overlapping; a bad ``world_size``, ``rule`` or ``proportion``.
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

    ``params -= alpha * (params - center)`` and, from the same (pre-pull)
    ``params``, ``center += beta * (total / world_size - center)``.  Each
    operation is rounded to the parameters' dtype on its own, as numpy's
    in-place ``total /= world_size; work = params - center; work *= alpha;
    params -= work; total -= center; total *= beta; center += total`` round
    it (the scalars cast to the dtype): the C loop, one pass on numpy
    float32/float64 arrays, gives those bits.

    Parameters
    ----------
    params, center : array
        This worker's parameters and the centre variable (1-D numpy or cupy,
        floating point, same length, dtype and backend), updated in place.
    total : array
        The sum of the ``world_size`` workers' parameters.  Scratch: the
        array code leaves its scaled difference there, the C loop leaves it
        unchanged.
    world_size : int
        Workers summed in ``total`` (>= 1).
    alpha, beta : float
        The worker's and the centre's pull, finite.
    work : array, optional
        Scratch like ``params`` for the array code (allocated when needed
        and not given); the C loop needs none.

    Raises
    ------
    TypeError, ValueError
        Arrays not 1-D, of a different length, dtype or backend, or
        overlapping; a bad ``world_size``, ``alpha`` or ``beta``.
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
