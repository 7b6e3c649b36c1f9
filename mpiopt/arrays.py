"""Array-module dispatch (the same code runs on numpy (CPU) and cupy (GPU)), and placement of large state arrays."""

from __future__ import annotations

import threading
import weakref
from types import ModuleType
from typing import Any, List, Sequence

import numpy as np

__all__ = ["array_module", "empty_apart", "host_apart", "keep_apart", "to_numpy"]


def array_module(x: Any) -> ModuleType:
    """``cupy`` for a cupy array, else ``numpy`` (cupy is imported only when one is passed)."""
    if type(x).__module__.startswith("cupy"):
        import cupy

        return cupy
    return np


def to_numpy(x: Any) -> np.ndarray:
    """A host numpy copy (or view, for numpy input) of ``x``."""
    if type(x).__module__.startswith("cupy"):
        return x.get()
    return np.asarray(x)


#: Arrays of at least this many bytes are placed apart (smaller ones stay in cache, where placement hardly matters).
PLACE_MIN_BYTES = 1 << 20
#: Offsets modulo this are kept apart: a load stalls behind a store to the same offset in another 4 KiB page.
ALIAS_PAGE = 4096
#: Streams a multiple of this apart run several times slower (cache and memory-bank set conflicts; docs/benchmarks-kernels.md).
ALIAS_SPAN = 1 << 28
#: How far from those multiples a placed array starts.
SPAN_GAP = 1 << 16
#: Placement keeps apart from at most this many known arrays, the latest (the padding grows with their number).
MAX_KNOWN = 32
_CACHE_LINE = 64

_known: List["weakref.ref[np.ndarray]"] = []  # large host arrays to keep apart from: placed ones, parameter buffers
_lock = threading.Lock()  # over _known


def keep_apart(*arrays: Any) -> None:
    """Make arrays placed later by :func:`empty_apart` keep apart from ``arrays`` too (weakly held; host arrays only)."""
    with _lock:
        known = {arr.ctypes.data for arr in (ref() for ref in _known) if arr is not None}
        for arr in arrays:
            if isinstance(arr, np.ndarray) and arr.nbytes >= PLACE_MIN_BYTES and arr.ctypes.data not in known:
                _known.append(weakref.ref(arr))  # another view of a known buffer (a tensor's .numpy()) counts once
                known.add(arr.ctypes.data)


def _live_addresses() -> List[int]:
    """The distinct start addresses of the latest :data:`MAX_KNOWN` known arrays still alive (the dead ones are forgotten)."""
    with _lock:
        live = [arr for arr in (ref() for ref in _known) if arr is not None][-MAX_KNOWN:]
        _known[:] = [weakref.ref(arr) for arr in live]
    return list(dict.fromkeys(arr.ctypes.data for arr in live))


def _padding(others: int) -> int:
    """Bytes beyond the array's own that leave :func:`_start` a choice: a page, and a slot per other array and one more."""
    return ALIAS_PAGE + (others + 1) * 2 * SPAN_GAP


def _start(address: int, others: Sequence[int]) -> int:
    """The offset from ``address`` (within :func:`_padding`) at which a placed array starts, clear of the others' aliasing."""
    if not others:
        return 0
    slots = np.arange(len(others) + 1)[:, None] * 2 * SPAN_GAP
    offsets = (slots + np.arange(0, ALIAS_PAGE, _CACHE_LINE)[None, :]).ravel()
    apart = address + offsets[:, None] - np.asarray(others, dtype=np.int64)[None, :]
    clear = (_circular(apart, ALIAS_SPAN) >= SPAN_GAP).all(axis=1)
    return int(offsets[clear][np.argmax(_circular(apart[clear], ALIAS_PAGE).min(axis=1))])


def _circular(distance: np.ndarray, period: int) -> np.ndarray:
    distance = distance % period
    return np.minimum(distance, period - distance)


def empty_apart(like: Any, near: Sequence[Any] = (), *, zero: bool = False) -> Any:
    """An array of ``like``'s shape and dtype placed apart from the arrays it will be streamed with (host arrays only)."""
    xp = array_module(like)
    if xp is not np:
        return xp.zeros_like(like) if zero else xp.empty_like(like)
    return host_apart(like.shape, like.dtype, near, zero=zero)


def host_apart(shape: Any, dtype: Any, near: Sequence[Any] = (), *, zero: bool = False) -> np.ndarray:
    """A numpy array placed in memory apart from the arrays it will be streamed with (``near`` and those known).

    Streams at the same page offset, or a multiple of 256 MiB apart, slow the update loops several times, and where
    they fall depends on the allocation order.  How the offset is chosen: docs/internals-kernels.md.
    """
    dtype = np.dtype(dtype)
    nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    if nbytes < PLACE_MIN_BYTES:
        return (np.zeros if zero else np.empty)(shape, dtype)
    others = list(dict.fromkeys(_live_addresses() + [a.ctypes.data for a in near if isinstance(a, np.ndarray)]))
    buffer = (np.zeros if zero else np.empty)(nbytes + _padding(len(others)), np.uint8)
    start = _start(buffer.ctypes.data, others)
    result = buffer[start : start + nbytes].view(dtype).reshape(shape)
    with _lock:
        _known.append(weakref.ref(result))
    return result
