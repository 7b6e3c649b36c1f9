"""Error feedback: ``a = e + g``, send ``a`` at the selected entries, keep the rest in ``e``; optionally fused with top-k."""

from __future__ import annotations

from typing import Any, Callable, Tuple

import numpy as np

from ...arrays import array_module
from .._backend import check_array
from .device import take_zero
from .index_sets import _TAKE_ZERO, _check_indices, _indexed
from .selection import FeedbackSelection, _sample_plan, _sample_threshold

__all__ = ["error_feedback", "take_and_zero", "fused_feedback_available", "feedback_select"]


def error_feedback(grad: Any, error: Any, select: Callable[[Any], Any], values_out: Any = None) -> Tuple[Any, Any]:
    """One error-feedback step in place; returns ``(indices, values)`` to send, ``indices = select(a)``.

    ``error`` holds ``a`` while ``select`` (which must not modify it) ranks it; mass is conserved bit for bit.
    """
    check_array("grad", grad, ndim=1, kinds="f")
    check_array("error", error, ndim=1, kinds="f", dtype=grad.dtype)
    if error.shape != grad.shape:
        raise ValueError(f"error must have grad's shape {grad.shape}, got {error.shape}")
    if not callable(select):
        raise TypeError(f"select must be callable (a -> indices), got {type(select).__name__}")
    error += grad
    indices = select(error)
    _check_indices("select(a)", indices, error.shape[0])
    return indices, take_and_zero(error, indices, values_out)


def take_and_zero(error: Any, indices: Any, values_out: Any = None) -> Any:
    """``values = error[indices]; error[indices] = 0``: what error feedback sends, and what it keeps (``indices``
    unique, as a selection's; ``values_out``, when given, holds at least as many)."""
    if values_out is not None:
        values = values_out[: indices.shape[0]]
        if _indexed(_TAKE_ZERO, error, indices, values) or take_zero(error, indices, values):
            return values
    values = error[indices]
    error[indices] = 0
    return values


def fused_feedback_available(grad: Any, error: Any, workspace: Any) -> bool:
    """Whether :func:`feedback_select` can run: arrays fitting ``workspace`` (a :class:`TopkWorkspace` with the C loops
    built, or its cupy twin), contiguous and disjoint."""
    return (
        workspace is not None and workspace.fits(error, workspace.k) and type(grad) is type(error)
        and grad.dtype == error.dtype and grad.shape == error.shape and grad.flags.c_contiguous
        and not array_module(error).may_share_memory(grad, error)
    )


def feedback_select(
    grad: Any, error: Any, k: int, workspace: Any, *, sent_indices: Any = None, sent_factors: Any = None,
) -> FeedbackSelection:
    """``error += grad`` and the top-k (or RegTop-k) selection of it, in one pass over memory; a :class:`FeedbackSelection`.

    The same result as ``error += grad`` then ``topk_indices``; ``sent_indices`` and ``sent_factors`` (both or
    neither) give RegTop-k's factors at last step's entries.  ``indices`` is None when the candidates overflow the
    workspace (the caller selects with the general code) or ``grad`` is not finite.
    """
    if not fused_feedback_available(grad, error, workspace):
        raise ValueError("feedback_select needs arrays of the workspace's length and dtype and its loops (fused_feedback_available)")
    if k != workspace.k or not 0 < k <= error.shape[0]:
        raise ValueError(f"k must be the workspace's k ({workspace.k}) and in [1, {error.shape[0]}], got {k!r}")
    if (sent_indices is None) != (sent_factors is None) or (sent_indices is not None and sent_indices.shape != sent_factors.shape):
        raise ValueError("give sent_indices and sent_factors together, of one length")
    if sent_indices is not None:
        check_array("sent_indices", sent_indices, ndim=1, kinds="i", dtype=np.int32)
        check_array("sent_factors", sent_factors, ndim=1, kinds="f", dtype=error.dtype)
        if not (sent_indices.flags.c_contiguous and sent_factors.flags.c_contiguous):
            raise ValueError("sent_indices and sent_factors must be contiguous")
    xp = array_module(error)
    stride, _, rank = _sample_plan(error.shape[0], k)
    sample = xp.add(error[::stride], grad[::stride], out=workspace.sample)
    xp.abs(sample, out=sample)
    if sent_indices is not None and sent_indices.shape[0]:  # the sampled entries that were sent score their factor times |a|
        workspace.scale_sampled(sample, sent_indices, sent_factors, stride)
    threshold = _sample_threshold(xp, sample, rank, False, sample)
    return workspace.scan_select(error, grad, threshold, True, k, sent_indices, sent_factors)
