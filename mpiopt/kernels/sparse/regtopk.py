"""RegTop-k's scores (Bereyhi et al. 2024/2025): Top-k's ``|a_j|`` times a regularizer from last step.

Where other workers cancelled what this worker sent, ``tanh(|1 + delta_j| / mu)`` drops toward 0 and the entry
stays in the error buffer.  Formula: docs/internals-kernels.md, "Sparse vectors".
"""

from __future__ import annotations

import math
import numbers
from typing import Any, Optional, Tuple

import numpy as np

from ...arrays import array_module
from .._backend import check_array, check_count
from .index_sets import _GATHER, _SET, _check_indices, _indexed
from .selection import TopkWorkspace

__all__ = ["unsent_factor", "regtopk_sent_factors", "regtopk_scores"]


def unsent_factor(mu: float, q: float) -> float:
    """RegTop-k's ``tanh(|1 + q| / mu)`` for entries not sent last step: exactly 1.0 for the paper's ``q = 1e8``."""
    return math.tanh(abs(1.0 + q) / mu)


def _check_regularizer_scalars(n_workers: Any, mu: Any, q: Any) -> int:
    """RegTop-k's ``n_workers`` (returned as an int), ``mu`` and ``q``, checked; the error names the bad value."""
    n_workers = check_count("n_workers", n_workers, 1)
    if not (isinstance(mu, numbers.Real) and math.isfinite(mu) and mu > 0):
        raise ValueError(f"mu must be a finite number > 0, got {mu!r}")
    if not (isinstance(q, numbers.Real) and math.isfinite(q)):
        raise ValueError(f"q must be a finite number, got {q!r}")
    return n_workers


def regtopk_sent_factors(
    sent_indices: Any, sent_values: Any, prev_aggregate: Optional[Any], n_workers: int, mu: float, q: float, workspace: Optional[TopkWorkspace],
    prev_support: Optional[Tuple[Any, Any]] = None,
) -> Optional[Any]:
    """The regularizer at last step's sent entries, in ``workspace.rows[2]``, for :func:`feedback_select` to apply.

    It needs only last step's selection and aggregate (or ``prev_support``), so it is ready before ``a`` is formed.
    None where the workspace or the C loops cannot compute it; the floats of :func:`regtopk_scores`.
    """
    n_workers = _check_regularizer_scalars(n_workers, mu, q)
    return _sent_factors(sent_indices, sent_values, prev_aggregate, n_workers, mu, q, workspace, prev_support)


def _sent_factors(
    sent_indices: Any, sent_values: Any, prev_aggregate: Any, n_workers: int, mu: float, q: float, workspace: Optional[TopkWorkspace],
    prev_support: Optional[Tuple[Any, Any]] = None,
) -> Optional[Any]:
    """:func:`regtopk_sent_factors` on checked scalars."""
    k = sent_indices.shape[0]
    support, prev = (None, prev_aggregate) if prev_support is None else prev_support
    if workspace is None or k > workspace.k or (support is None and not workspace.fits(prev, workspace.k)):
        return None
    arrays = (sent_indices, sent_values, prev) + (() if support is None else (support,))
    if not all(type(a) is type(workspace.rows) and a.flags.c_contiguous for a in arrays) or sent_indices.dtype != np.int32 \
            or sent_values.dtype != workspace.dtype or prev.dtype != workspace.dtype \
            or (support is not None and (support.dtype != np.int32 or support.shape != prev.shape)):
        return None
    ratio, factors = workspace.rows[1][:k], workspace.rows[2][:k]
    # The expression's |1 + delta| / mu in one loop (its operations, each rounded as numpy rounds them),
    # then the array module's own tanh for its bits.
    if not workspace.regtopk_ratio(prev, sent_indices, sent_values, ratio, 1.0 / n_workers, q, mu, support):
        return None
    array_module(ratio).tanh(ratio, out=factors)
    return factors


def regtopk_scores(
    acc: Any,
    sent_indices: Any,
    sent_values: Any,
    prev_aggregate: Any,
    n_workers: int,
    mu: float,
    q: float = 1e8,
    out: Any = None,
    check_indices: bool = True,
    workspace: Optional[TopkWorkspace] = None,
) -> Any:
    """RegTop-k scores ``tanh(|1 + delta_j| / mu) * |a_j|`` of ``acc = g + e``, for ``topk_indices(..., absolute=False)``.

    ``delta_j`` compares last round's aggregate with this worker's share at ``sent_indices``, and is ``q`` elsewhere.
    ``workspace`` computes the sent entries' terms without allocating; ``check_indices=False`` trusts checked indices.
    """
    xp = check_array("acc", acc, ndim=1, kinds="f")
    d = acc.shape[0]
    if check_indices:
        _check_indices("sent_indices", sent_indices, d)
    else:
        check_array("sent_indices", sent_indices, ndim=1, kinds="iu")
    check_array("sent_values", sent_values, ndim=1, kinds="f")
    check_array("prev_aggregate", prev_aggregate, ndim=1, kinds="f")
    if sent_values.shape != sent_indices.shape:
        raise ValueError(f"sent_values must match sent_indices' shape {sent_indices.shape}, got {sent_values.shape}")
    if prev_aggregate.shape != acc.shape:
        raise ValueError(f"prev_aggregate must have acc's shape {acc.shape}, got {prev_aggregate.shape}")
    n_workers = _check_regularizer_scalars(n_workers, mu, q)
    if out is not None:
        check_array("out", out, ndim=1, kinds="f", dtype=acc.dtype)
        if out.shape != acc.shape:
            raise ValueError(f"out must have acc's shape {acc.shape}, got {out.shape}")
    scores = xp.abs(acc, out=out)
    unsent = unsent_factor(mu, q)  # exactly 1.0 for the paper's q = 1e8: no pass
    if unsent != 1.0:
        scores *= unsent
    k = sent_indices.shape[0]
    usable = k and workspace is not None and workspace.fits(acc, workspace.k)
    factor = _sent_factors(sent_indices, sent_values, prev_aggregate, n_workers, mu, q, workspace) if usable else None
    if factor is not None:
        own = workspace.rows[0][:k]
        if not _indexed(_GATHER, acc, sent_indices, own):  # cupy's workspace
            xp.take(acc, sent_indices, out=own)
        xp.abs(own, out=own)
        factor *= own
        if not _indexed(_SET, scores, sent_indices, factor):
            scores[sent_indices] = factor
        return scores
    if k:
        own = (1.0 / n_workers) * sent_values  # w * a_ref: this worker's share of G_prev
        sent = own != 0
        # A subnormal share can overflow delta to +-inf: tanh(inf) = 1 is the right limit.
        with np.errstate(over="ignore"):
            delta = xp.where(sent, (prev_aggregate[sent_indices] - own) / xp.where(sent, own, 1), q)
        scores[sent_indices] = xp.tanh(xp.abs(1 + delta) / mu) * xp.abs(acc[sent_indices])
    return scores
