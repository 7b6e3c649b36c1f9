"""Sorted int32 index sets: the check of the convention, and the C loops (``_sparsec``) that work at such indices."""

from __future__ import annotations

from types import ModuleType
from typing import Any

import numpy as np

from .._backend import C_FLOATS, block_length, check_array, load_extension
from ..threads import get_num_threads

_MAX_LENGTH = 2**31 - 1  # int32 indices
# Indices checked per block: a bounded temporary (4 KiB) for the "sorted" comparison.
_CHECK_BLOCK = 1 << 12
# _sparsec.indexed's operations.
_TAKE_ZERO, _ADD, _ZERO, _DIVIDE, _SUB_SCALED, _GATHER, _SET = range(7)

# The optional fused C loops (setup.py); the numpy code gives the same bits.
_sparsec = load_extension("_sparsec", 1)


def _check_indices(name: str, indices: Any, d: int) -> ModuleType:
    """Check that ``indices`` are int, unique, sorted ascending and in ``[0, d)``; return their module."""
    xp = check_array(name, indices, ndim=1, kinds="iu")
    n = indices.shape[0]
    ok = not n or (int(indices[0]) >= 0 and int(indices[n - 1]) < d)
    block = block_length(xp, _CHECK_BLOCK, n)
    ascending = xp.empty(min(block, n), dtype=bool) if ok and n > 1 else None
    for start in range(0, n - 1 if ok else 0, block):  # in blocks: no k-sized temporary
        stop = min(start + block, n - 1)
        ok = bool(xp.greater(indices[start + 1 : stop + 1], indices[start:stop], out=ascending[: stop - start]).all())
        if not ok:
            break
    if not ok:
        raise ValueError(f"{name} must be unique indices in [0, {d}) sorted ascending")
    return xp


def _indexed(op: int, x: Any, indices: Any, other: Any = None, scalar: float = 0.0) -> bool:
    """Run one of ``_sparsec.indexed``'s loops on numpy arrays; False (nothing done) where it cannot."""
    arrays = (x, indices) if other is None else (x, indices, other)
    if _sparsec is None or not all(isinstance(a, np.ndarray) and a.flags.c_contiguous for a in arrays):
        return False
    if indices.dtype != np.int32 or x.dtype not in C_FLOATS or (other is not None and other.dtype != x.dtype):
        return False
    _sparsec.indexed(op, x, indices, indices.shape[0], x.dtype.itemsize, x if other is None else other, scalar, get_num_threads())
    return True
