"""Error feedback: ``a = e + g``, send ``a`` at the selected entries, keep the rest in ``e``.

:func:`error_feedback` takes any selection; :func:`feedback_select` fuses
``a = e + g`` with the top-k (or RegTop-k) selection in one C pass over
memory, with the same floats and indices.
"""

from __future__ import annotations

from typing import Any, Callable, Optional, Tuple

import numpy as np

from .._backend import check_array
from .index_sets import _TAKE_ZERO, _check_indices, _indexed, _sparsec
from .selection import FeedbackSelection, TopkWorkspace, _sample_plan, _sample_threshold, _scan_select

__all__ = ["error_feedback", "take_and_zero", "fused_feedback_available", "feedback_select"]


def error_feedback(grad: Any, error: Any, select: Callable[[Any], Any], values_out: Any = None) -> Tuple[Any, Any]:
    """One error-feedback step, in place: ``a = e + g``; send ``a`` on ``S = select(a)``; ``e <- a - a 1_S``.

    ``error`` holds ``a`` while ``select`` ranks it, so no dense temporary is
    made.  The sent values are copied from the same float sums that stay in
    ``error`` elsewhere, so mass is conserved exactly: scattering ``values`` at
    ``indices`` into the new ``error`` gives ``old error + grad`` bit for bit.

    Parameters
    ----------
    grad : array, 1-D floating
    error : array like ``grad``
        Updated in place.
    select : callable
        ``select(a) -> indices``: unique int indices sorted ascending, e.g.
        ``lambda a: topk_indices(a, k)``.  It must not modify ``a``.
    values_out : array like ``grad``, shape (>= len(indices),), optional
        Where the sent values go (their first entries), instead of a new array.

    Returns
    -------
    indices : array of int
        What ``select`` returned.
    values : array like ``grad``, shape indices.shape
        ``a`` at ``indices``, to send.
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
    """``values = error[indices]; error[indices] = 0``: what error feedback sends, and what it keeps.

    Parameters
    ----------
    error : array, 1-D floating
        Updated in place.
    indices : array of int
        Checked positions (unique, in range).
    values_out : array like ``error``, shape (>= len(indices),), optional
        Where the values go (their first entries), instead of a new array.

    Returns
    -------
    array like ``error``, shape indices.shape
    """
    if values_out is not None and _indexed(_TAKE_ZERO, error, indices, values_out[: indices.shape[0]]):
        return values_out[: indices.shape[0]]
    values = error[indices]
    error[indices] = 0
    return values


def fused_feedback_available(grad: Any, error: Any, workspace: Optional[TopkWorkspace]) -> bool:
    """Whether :func:`feedback_select` can run on these arrays.

    Parameters
    ----------
    grad, error : arrays
    workspace : TopkWorkspace or None

    Returns
    -------
    bool
        True for numpy arrays of the workspace's length and dtype, C-contiguous
        and not overlapping, when the C loops were built.
    """
    return (
        workspace is not None and workspace.fits(error, workspace.k) and isinstance(grad, np.ndarray)
        and grad.dtype == error.dtype and grad.shape == error.shape and grad.flags.c_contiguous
        and not np.may_share_memory(grad, error)
    )


def feedback_select(
    grad: Any, error: Any, k: int, workspace: TopkWorkspace, *, sent_indices: Any = None, sent_factors: Any = None,
) -> FeedbackSelection:
    """Error feedback's ``a = e + g`` (into ``error``) and the top-k selection of ``a``, in one pass over memory.

    The same as ``error += grad`` followed by ``topk_indices(error, k)`` (Top-k),
    or by ``topk_indices(regtopk_scores(error, ...), k, absolute=False)``
    (RegTop-k, with the paper's ``q``, whose unsent entries score ``|a_j|``):
    a threshold is estimated from a strided sample of ``e + g`` (the same float
    sums), and one C loop (:mod:`mpiopt.kernels.threads`' threads) adds,
    stores and collects the candidates that reach it.

    Parameters
    ----------
    grad, error : arrays
        As :func:`error_feedback`'s; :func:`fused_feedback_available` must hold.
    k : int
        ``workspace.k``, with ``0 < k <= d``.
    workspace : TopkWorkspace
        Made for ``error``'s length, ``k`` and dtype; its buffers are
        overwritten.
    sent_indices, sent_factors : arrays, optional
        RegTop-k: the entries sent last step (int32, ascending) and their
        regularizers (:func:`~mpiopt.kernels.sparse.regtopk_sent_factors`), which multiply ``|a_j|``
        there in the same pass (no gathers of ``e`` and ``g`` at them).

    Returns
    -------
    FeedbackSelection
        ``indices``: the k indices (``workspace.selected``), or None when the
        candidates did not fit the workspace (rare; the caller selects with
        the general code) or the gradient is not finite; ``error`` holds
        ``a`` all the same.  ``finite``: whether every element of ``grad``
        is finite, checked in the same pass (the algorithms' gradient check
        under ``nan_policy="raise"``, with no pass of its own).

    Raises
    ------
    ValueError
        Arrays :func:`fused_feedback_available` refuses, ``k`` that is not the
        workspace's or not in ``[1, d]``, or only one of ``sent_indices`` and
        ``sent_factors`` (or lengths that differ).
    """
    if not fused_feedback_available(grad, error, workspace):
        raise ValueError("feedback_select needs numpy arrays of the workspace's length and dtype and the C loops (fused_feedback_available)")
    if k != workspace.k or not 0 < k <= error.shape[0]:
        raise ValueError(f"k must be the workspace's k ({workspace.k}) and in [1, {error.shape[0]}], got {k!r}")
    if (sent_indices is None) != (sent_factors is None) or (sent_indices is not None and sent_indices.shape != sent_factors.shape):
        raise ValueError("give sent_indices and sent_factors together, of one length")
    if sent_indices is not None:
        check_array("sent_indices", sent_indices, ndim=1, kinds="i", dtype=np.int32)
        check_array("sent_factors", sent_factors, ndim=1, kinds="f", dtype=error.dtype)
        if not (sent_indices.flags.c_contiguous and sent_factors.flags.c_contiguous):
            raise ValueError("sent_indices and sent_factors must be contiguous")
    stride, _, rank = _sample_plan(error.shape[0], k)
    sample = np.add(error[::stride], grad[::stride], out=workspace.sample)
    np.abs(sample, out=sample)
    if sent_indices is not None and sent_indices.shape[0]:  # the sampled entries that were sent score their factor times |a|
        _sparsec.scale_sampled(sample, sent_indices, sent_factors, sent_indices.shape[0], sample.dtype.itemsize, stride)
    threshold = _sample_threshold(np, sample, rank, False, sample)
    return _scan_select(error, grad, threshold, True, k, workspace, sent_indices, sent_factors)
