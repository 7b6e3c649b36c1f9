"""What the kernels need beyond :mod:`mpiopt.arrays`: input checks, cached constants, cache-sized blocks, numpy/cupy differences."""

from __future__ import annotations

import importlib
import numbers
from types import ModuleType
from typing import Any, Callable, Dict, Hashable, List, Optional, Tuple

import numpy as np

from ..arrays import array_module

__all__ = [
    "C_FLOATS", "array_modules", "block_length", "c_loop_takes", "cached", "check_array", "check_count", "load_extension", "take_rows",
]

#: The element types the C loops (``_signsc``, ``_sparsec``, ``_updatec``) compute in.
C_FLOATS = (np.dtype(np.float32), np.dtype(np.float64))

_CONSTANTS: Dict[Tuple[Hashable, ...], Any] = {}


def load_extension(name: str, version: int) -> Optional[ModuleType]:
    """The optional C extension ``mpiopt.kernels.<name>``, or None where it was not built or is stale (``VERSION`` differs)."""
    try:
        module = importlib.import_module(f"{__package__}.{name}")
    except ImportError:  # pragma: no cover - built without a C compiler
        return None
    return module if getattr(module, "VERSION", 0) == version else None


def c_loop_takes(extension: Optional[ModuleType], x: Any) -> bool:
    """Whether ``extension`` (None where not built) computes on arrays like ``x``: C-contiguous numpy float32/float64."""
    return extension is not None and isinstance(x, np.ndarray) and x.dtype in C_FLOATS and x.flags.c_contiguous


def array_modules() -> List[ModuleType]:
    """``[numpy]`` or ``[numpy, cupy]`` when cupy imports and sees a GPU; tests run every case once per entry."""
    modules = [np]
    try:
        import cupy

        if cupy.cuda.runtime.getDeviceCount() > 0:
            modules.append(cupy)
    except Exception:  # noqa: BLE001 - no cupy, no driver or no device: numpy only
        pass
    return modules


def block_length(xp: ModuleType, cpu_block: int, total: int) -> int:
    """Length of a kernel's blocks: ``cpu_block`` on numpy (temporaries stay in L2), ``total`` on cupy (one launch); >= 1."""
    return max(1, cpu_block if xp is np else total)


def cached(xp: ModuleType, key: Hashable, build: Callable[[], np.ndarray]) -> Any:
    """The constant ``build()`` (a numpy array) on ``xp``'s device, built once per backend and device; read-only."""
    device = None if xp is np else xp.cuda.Device().id
    full_key = (xp.__name__, device, key)
    if full_key not in _CONSTANTS:
        _CONSTANTS[full_key] = xp.asarray(build())
    return _CONSTANTS[full_key]


def take_rows(table: Any, indices: Any, out: Any) -> None:
    """``out[i] = table[indices[i]]`` without bounds checks (numpy's ``mode="raise"`` is about 4x slower); indices must be valid."""
    if array_module(table) is np:
        np.take(table, indices, axis=0, out=out, mode="clip")
    else:
        table.take(indices, axis=0, out=out)


def check_array(name: str, value: Any, *, ndim: int, kinds: str, dtype: Any = None) -> ModuleType:
    """Validate array argument ``name`` (``ndim``, dtype ``kinds`` or exact ``dtype``) and return its module.

    ``TypeError`` for a non-array or a wrong dtype, ``ValueError`` for wrong dimensions, naming ``name``.
    """
    if not (hasattr(value, "ndim") and hasattr(value, "dtype") and hasattr(value, "shape")):
        raise TypeError(f"{name} must be a numpy or cupy array, got {type(value).__name__}")
    xp = array_module(value)
    if dtype is not None:
        if value.dtype != np.dtype(dtype):
            raise TypeError(f"{name} must have dtype {np.dtype(dtype)}, got {value.dtype}")
    elif value.dtype.kind not in kinds:
        raise TypeError(f"{name} must have a dtype of kind {kinds!r} (f: float, i: int, u: uint), got {value.dtype}")
    if value.ndim != ndim:
        raise ValueError(f"{name} must be {ndim}-D, got shape {tuple(value.shape)}")
    return xp


def check_count(name: str, value: Any, minimum: int, maximum: int | None = None) -> int:
    """An integer argument (``bool`` rejected) in ``[minimum, maximum]`` as ``int``; ``TypeError``/``ValueError`` otherwise."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name} must be an int, got {type(value).__name__} {value!r}")
    value = int(value)
    if value < minimum or (maximum is not None and value > maximum):
        upper = "" if maximum is None else f" and <= {maximum}"
        raise ValueError(f"{name} must be >= {minimum}{upper}, got {value}")
    return value
