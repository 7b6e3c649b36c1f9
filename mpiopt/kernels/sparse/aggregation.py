"""Aggregation of the workers' payloads: ``G = (1/N) sum_n sent_n`` where some worker sent.

Scatter-adds into a zeroed dense aggregate, or with the C loops one merge and one walk: the same floats.
"""

from __future__ import annotations

from typing import Any, Optional, Tuple

import numpy as np

from ...arrays import array_module
from .._backend import C_FLOATS, check_array
from ..threads import get_num_threads
from .index_sets import _ADD, _DIVIDE, _SUB_SCALED, _ZERO, _check_indices, _indexed, _sparsec

__all__ = [
    "scatter_add", "zero_at", "divide_at", "subtract_scaled_at", "MERGE_MAX_ROWS", "merge_sorted_rows", "settle_aggregate", "union_of_sorted",
]


def scatter_add(out: Any, indices: Any, values: Any) -> Any:
    """``out[indices] += values`` for one worker's payload: O(k), correct because its indices are unique; returns ``out``."""
    check_array("out", out, ndim=1, kinds="f")
    _check_indices("indices", indices, out.shape[0])
    check_array("values", values, ndim=1, kinds="f")
    if values.shape != indices.shape:
        raise ValueError(f"values must match indices' shape {indices.shape}, got {values.shape}")
    if not _indexed(_ADD, out, indices, values):
        out[indices] += values
    return out


def zero_at(out: Any, indices: Any) -> Any:
    """``out[indices] = 0`` in place (one C loop for int32 numpy indices); returns ``out``."""
    if not _indexed(_ZERO, out, indices):
        out[indices] = 0
    return out


def divide_at(out: Any, indices: Any, divisor: int) -> Any:
    """``out[indices] /= divisor`` in place (one C loop for int32 numpy indices; nothing for 1)."""
    if divisor == 1:
        return out
    if not _indexed(_DIVIDE, out, indices, scalar=float(divisor)):
        out[indices] /= divisor
    return out


def subtract_scaled_at(x: Any, indices: Any, y: Any, scale: float) -> Any:
    """``x[indices] -= scale * y[indices]`` in place (products rounded); one C loop for int32 numpy indices.  Returns ``x``."""
    if not _indexed(_SUB_SCALED, x, indices, y, scale):
        x[indices] -= scale * y[indices]
    return x


#: The most rows :func:`merge_sorted_rows` merges (its C loop looks at every row for each entry).
MERGE_MAX_ROWS = _sparsec.MERGE_MAX_ROWS if _sparsec is not None else 8


def merge_sorted_rows(index_rows: list, value_rows: list, d: int, union_out: Any, sums_out: Any) -> Optional[Tuple[Any, Any]]:
    """``(union, sums)``: the sorted union of sorted index rows and the row-order sums there (the scatter-adds' floats).

    Views of ``union_out`` and ``sums_out``; None where the C loops cannot run (the caller scatter-adds instead).
    ``ValueError`` for rows that are not unique, ascending and in range, or outputs too small.
    """
    arrays = [*index_rows, *value_rows, union_out, sums_out]
    if _sparsec is None or len(index_rows) > MERGE_MAX_ROWS or not all(isinstance(a, np.ndarray) for a in arrays):
        return None
    if any(a.dtype != np.int32 for a in (*index_rows, union_out)) or any(v.dtype != sums_out.dtype for v in value_rows):
        return None
    if sums_out.dtype not in C_FLOATS or not all(a.flags.c_contiguous for a in arrays):
        return None
    if not all(a.flags.aligned for a in (*index_rows, union_out, sums_out)):  # the values are read unaligned
        return None
    u = _sparsec.merge_rows(tuple(index_rows), tuple(value_rows), d, sums_out.dtype.itemsize, union_out, sums_out)
    return union_out[:u], sums_out[:u]


def settle_aggregate(
    out: Optional[Any], union: Any, sums: Any, divisor: int, stale: Any = None, params: Any = None, lr: float = 0.0,
) -> None:
    """``out[union] = sums / divisor``, ``stale`` entries zeroed, and ``params[union] -= lr * out[union]``, in one C walk.

    ``sums`` becomes ``out[union]`` (for ``sgd_update``'s ``grad_support``); ``out=None`` leaves ``G`` only there.
    ``ValueError`` when the C loops were not built or the arrays do not fit.
    """
    arrays = [a for a in (out, union, sums, stale, params) if a is not None]
    if _sparsec is None or not all(isinstance(a, np.ndarray) and a.flags.c_contiguous and a.flags.aligned for a in arrays):
        raise ValueError("settle_aggregate needs the C loops and C-contiguous numpy arrays (merge_sorted_rows' results)")
    dtypes = [a.dtype for a in (out, sums, params) if a is not None]
    if sums.dtype not in C_FLOATS or any(dtype != sums.dtype for dtype in dtypes):
        raise ValueError(f"out, sums and params must share a float32 or float64 dtype, got {', '.join(map(str, dtypes))}")
    if union.dtype != np.int32 or (stale is not None and stale.dtype != np.int32):
        raise ValueError("union and stale must be int32 indices")
    _sparsec.settle(out, params, stale, union, sums, union.shape[0], sums.dtype.itemsize, float(divisor), float(lr), get_num_threads())


def union_of_sorted(arrays: list, d: int, bits: Any = None, out: Any = None) -> Any:
    """Sorted union of sorted index arrays in ``[0, d)``: through the bitmap ``bits`` into ``out`` with the C loops, else a merge sort."""
    xp = array_module(arrays[0]) if arrays else np
    if len(arrays) == 1 and out is not None and out.shape[0] >= arrays[0].shape[0]:
        union = out[: arrays[0].shape[0]]  # one sorted array is its own union
        union[...] = arrays[0]
        return union
    c_ok = _sparsec is not None and bits is not None and out is not None and xp is np
    if c_ok and all(a.dtype == np.int32 and a.flags.c_contiguous for a in arrays):
        bits[...] = 0
        for a in arrays:
            _sparsec.bitmap_mark(a, a.shape[0], d, bits)
        count = _sparsec.bitmap_indices(bits, d, out)
        if count <= out.shape[0]:
            return out[:count]
    joined = xp.concatenate(arrays)
    joined = xp.sort(joined, kind="stable") if xp is np else xp.sort(joined)
    keep = xp.empty(joined.shape[0], dtype=bool)
    keep[:1] = True
    xp.not_equal(joined[1:], joined[:-1], out=keep[1:])
    return joined[keep]
