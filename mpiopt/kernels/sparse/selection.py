"""Top-k selection: the indices of the k largest scores, exact, in about one pass (a sampled threshold, then one scan)."""

from __future__ import annotations

import math
import numbers
from types import ModuleType
from typing import Any, NamedTuple, Optional, Tuple

import numpy as np

from .._backend import block_length, check_array, check_count
from ..threads import get_num_threads
from .index_sets import _MAX_LENGTH, _sparsec

__all__ = ["density_to_k", "TopkWorkspace", "FeedbackSelection", "topk_indices"]

# Threshold estimate: a strided sample of at most 65,536 entries and at most
# 1/16 of the vector (so it costs little next to the scan at any d), and the
# safety margin (in standard deviations of the binomial count of sample entries
# above the true k-th largest) that makes a too-high threshold, and so the
# full fallback, rare.
_SAMPLE = 1 << 16
_MIN_STRIDE = 16
_MARGIN_SIGMAS = 4.0
# Candidate scan: 1 MiB of float32 per block, so |block| is still in cache for
# the comparison and the gather, while the per-block calls cost little.
_SCAN_BLOCK = 1 << 18


def density_to_k(d: int, density_or_count: float | int) -> int:
    """Entries to send, in ``[1, d]``: an ``int`` count as is, a ``float`` density in ``(0, 1]`` as ``round(density * d)``."""
    d = check_count("d", d, 1)
    value = density_or_count
    if isinstance(value, numbers.Integral) and not isinstance(value, bool):
        return check_count("density_or_count", value, 1, d)
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"density_or_count must be an int (count) or a float (density), got {value!r}")
    density = float(value)
    if not 0.0 < density <= 1.0:
        raise ValueError(f"density_or_count as a density must be in (0, 1], got {density!r}")
    return min(d, max(1, round(density * d)))


def _sample_plan(d: int, k: int) -> Tuple[int, int, int]:
    """(stride, sample size n, rank): the threshold is the rank-th largest of every stride-th score."""
    stride = max(_MIN_STRIDE, d // _SAMPLE)
    n = -(-d // stride)
    expected = k * n / d  # sample entries expected at or above the k-th largest
    return stride, n, min(n, math.ceil(expected + _MARGIN_SIGMAS * (math.sqrt(expected) + 1)))


def _threshold(xp: ModuleType, values: Any, k: int, absolute: bool, scratch: Any = None) -> Any:
    """A score that about ``k * (1 + margin)`` entries reach, estimated from a strided sample (in ``scratch`` if given)."""
    stride, _, rank = _sample_plan(values.shape[0], k)
    return _sample_threshold(xp, values[::stride], rank, absolute, scratch)


def _sample_threshold(xp: ModuleType, sample: Any, rank: int, absolute: bool, scratch: Any = None) -> Any:
    """The rank-th largest score of ``sample`` (``scratch``, which may be ``sample`` itself, is overwritten)."""
    n = sample.shape[0]
    if scratch is None:
        scratch = xp.empty_like(sample)
    if absolute:
        xp.abs(sample, out=scratch)
    elif scratch is not sample:
        scratch[...] = sample
    # NaN ranks below every number, so it counts as -inf here (partition would put it on top).
    xp.fmax(scratch, -math.inf, out=scratch)
    scratch.partition(n - rank)  # in place
    return scratch[n - rank]  # the rank-th largest


def _workspace_plan(d: int, k: int, dtype: Any) -> Tuple[int, int, np.dtype, int, int]:
    """A workspace's ``(d, k, dtype, sample size, candidate capacity)``: room for twice the expected candidates."""
    d, k = check_count("d", d, 1, _MAX_LENGTH), check_count("k", k, 0, d)
    stride, n, rank = _sample_plan(d, max(k, 1))
    return d, k, np.dtype(dtype), n, min(d, 2 * (rank * stride + k) + 64)


class TopkWorkspace:
    """Buffers that let :func:`topk_indices` select ``k`` of ``d`` numpy values without allocating (needs the C loops).

    Sized for twice the expected candidates; more fall back to the allocating code with the same result.
    (:class:`~mpiopt.kernels.sparse.device.DeviceTopkWorkspace` is its twin for cupy arrays.)
    """

    def __init__(self, d: int, k: int, dtype: Any) -> None:
        d, k, dtype, n, capacity = _workspace_plan(d, k, dtype)
        self.d, self.k, self.dtype = d, k, dtype
        self.sample = np.empty(n, dtype)
        self.candidates = np.empty(capacity, np.int32)
        self.scores = np.empty(capacity, dtype)
        self.partition = np.empty(capacity, dtype)
        self.keep = np.empty(capacity, bool)
        self.ties = np.empty(capacity, bool)
        self.selected = np.empty(k, np.int32)
        # regtopk_scores' k-sized temporaries: three rows of values.
        self.rows = np.empty((3, k), dtype)

    def fits(self, values: Any, k: int) -> bool:
        """Whether this workspace (and the C loops) can select ``k`` of ``values``."""
        return (
            _sparsec is not None and isinstance(values, np.ndarray) and values.dtype == self.dtype
            and values.shape == (self.d,) and k == self.k and values.flags.c_contiguous
        )

    def scan_select(
        self, values: Any, grad: Any, threshold: Any, absolute: bool, k: int, over: Any = None, over_factors: Any = None,
    ) -> FeedbackSelection:
        """One C scan (``values += grad`` first, when given) and the k best of its candidates (see ``_scan_select``)."""
        return _scan_select(values, grad, threshold, absolute, k, self, over, over_factors)

    def regtopk_ratio(
        self, prev: Any, sent_indices: Any, sent_values: Any, out: Any, w: float, q: float, mu: float, support: Any = None,
    ) -> bool:
        """RegTop-k's ``|1 + delta| / mu`` at last step's entries into ``out`` (one C loop, numpy's roundings); ``prev`` is
        the dense ``G_prev``, or its values at ``support`` (ascending int32).  False (nothing written) without the C loops."""
        if _sparsec is None:
            return False
        _sparsec.regtopk_ratio(
            prev, sent_indices, sent_values, out, sent_indices.shape[0], out.dtype.itemsize, w, q, mu, get_num_threads(), support,
        )
        return True

    def scale_sampled(self, sample: Any, sent_indices: Any, sent_factors: Any, stride: int) -> None:
        """``sample[j / stride] *= factor`` for the sent entries ``j`` that the strided ``sample`` holds."""
        _sparsec.scale_sampled(sample, sent_indices, sent_factors, sent_indices.shape[0], sample.dtype.itemsize, stride)


def _candidates(xp: ModuleType, values: Any, threshold: Any, absolute: bool) -> Tuple[Any, Any]:
    """Indices (ascending) and scores of the entries whose score reaches ``threshold``."""
    d = values.shape[0]
    block = block_length(xp, _SCAN_BLOCK, d)
    scratch = xp.empty(min(block, d), dtype=values.dtype) if absolute else None
    index_parts, score_parts = [], []
    for start in range(0, d, block):
        scores = values[start : start + block]
        if absolute:
            scores = xp.abs(scores, out=scratch[: scores.shape[0]])
        hits = xp.flatnonzero(scores >= threshold)
        index_parts.append(hits + start)
        score_parts.append(scores[hits])
    return xp.concatenate(index_parts), xp.concatenate(score_parts)


def _select(xp: ModuleType, candidates: Any, scores: Any, k: int, workspace: Optional[TopkWorkspace] = None) -> Any:
    """The k candidates of highest score (no NaN), lowest index first among ties; into the ``workspace`` when given."""
    n = candidates.shape[0]
    if workspace is None:
        kth = xp.partition(scores, n - k)[n - k]
        keep = scores > kth
        ties = xp.flatnonzero(scores == kth)  # ascending, because candidates are
        keep[ties[: k - int(keep.sum())]] = True
        return candidates[keep].astype(xp.int32)
    order = workspace.partition[:n]
    order[...] = scores
    order.partition(n - k)
    kth = order[n - k]
    keep = xp.greater(scores, kth, out=workspace.keep[:n])
    missing = k - int(xp.count_nonzero(keep))
    if missing:
        keep[xp.flatnonzero(xp.equal(scores, kth, out=workspace.ties[:n]))[:missing]] = True
    _sparsec.compress_marked(candidates, keep, n, workspace.selected)
    return workspace.selected


class FeedbackSelection(NamedTuple):
    """What ``feedback_select`` returns: ``indices`` (None when the candidates overflowed or ``finite`` is False), ``finite``."""

    indices: Optional[Any]
    finite: bool


def _scan_select(
    values: Any, grad: Any, threshold: Any, absolute: bool, k: int, workspace: TopkWorkspace, over: Any = None, over_factors: Any = None,
) -> FeedbackSelection:
    """One C scan (``values += grad`` first, when given) into the workspace, and the k best of its candidates.

    Entries at ``over`` score ``over_factors`` times their usual score; ``indices`` is None when fewer than k or
    too many candidates reach ``threshold`` or ``grad`` is not finite.
    """
    n, finite = _sparsec.scan(
        values, grad, values.shape[0], values.dtype.itemsize, float(threshold), absolute, over, over_factors,
        workspace.candidates, workspace.scores, get_num_threads(),
    )
    if finite and k <= n <= workspace.candidates.shape[0]:
        return FeedbackSelection(_select(np, workspace.candidates[:n], workspace.scores[:n], k, workspace), True)
    return FeedbackSelection(None, finite)


def topk_indices(values: Any, k: int, *, absolute: bool = True, workspace: Any = None) -> Any:
    """Indices of the ``k`` largest ``|values|`` (or ``values`` with ``absolute=False``), int32 sorted ascending.

    Exact, in about one pass.  Ties at the k-th place take the lowest indices; NaN ranks below every number.
    With a ``workspace`` (a :class:`TopkWorkspace`, or its cupy twin) that fits, the result is ``workspace.selected``
    (overwritten next call); the numpy one allocates nothing.
    """
    xp = check_array("values", values, ndim=1, kinds="f")
    d = values.shape[0]
    if d > _MAX_LENGTH:
        raise ValueError(f"values must have fewer than 2**31 entries (int32 indices), got {d}")
    k = check_count("k", k, 0, d)
    if k in (0, d):
        return xp.arange(k, dtype=xp.int32)
    if workspace is not None and workspace.fits(values, k):
        threshold = _threshold(xp, values, k, absolute, workspace.sample)
        # One scan into the workspace; more candidates than it holds take the code below.
        selected = workspace.scan_select(values, None, threshold, absolute, k).indices
        if selected is not None:
            return selected
    # Comparisons are false for NaN: candidates are numbers only.
    candidates, scores = _candidates(xp, values, _threshold(xp, values, k, absolute), absolute)
    if candidates.shape[0] < k:  # the estimate was too high: every number is a candidate
        candidates, scores = _candidates(xp, values, -math.inf, absolute)
        if candidates.shape[0] < k:  # fewer than k numbers: NaN fills up, lowest index first
            nan_indices = xp.flatnonzero(xp.isnan(values))[: k - candidates.shape[0]]
            return xp.sort(xp.concatenate([candidates, nan_indices])).astype(xp.int32)
    return _select(xp, candidates, scores, k)
