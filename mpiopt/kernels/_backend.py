"""What the kernels need beyond :mod:`mpiopt.arrays`: input checks, cached constant
tables, cache-sized blocking on the CPU, and the one call whose arguments differ
between numpy and cupy.  cupy is never imported unless a cupy array is passed
(or :func:`array_modules` is asked which backends this machine has)."""

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
    """The optional C extension ``mpiopt.kernels.<name>`` (setup.py), or None where the numpy code must run.

    None when it was not built (no C compiler) or is a stale build whose
    ``VERSION`` is not ``version`` (other arguments: rebuild with ``pip install -e .``).
    """
    try:
        module = importlib.import_module(f"{__package__}.{name}")
    except ImportError:  # pragma: no cover - built without a C compiler
        return None
    return module if getattr(module, "VERSION", 0) == version else None


def c_loop_takes(extension: Optional[ModuleType], x: Any) -> bool:
    """Whether ``extension`` (a C-loop module, None where it was not built) computes on arrays like ``x``.

    True for C-contiguous numpy float32/float64 arrays.
    """
    return extension is not None and isinstance(x, np.ndarray) and x.dtype in C_FLOATS and x.flags.c_contiguous


def array_modules() -> List[ModuleType]:
    """The array modules usable here: numpy, and cupy when it imports and sees a GPU.

    Returns
    -------
    list of module
        ``[numpy]`` or ``[numpy, cupy]``; tests run every case once per entry.
    """
    modules = [np]
    try:
        import cupy

        if cupy.cuda.runtime.getDeviceCount() > 0:
            modules.append(cupy)
    except Exception:  # noqa: BLE001 - no cupy, no driver or no device: numpy only
        pass
    return modules


def block_length(xp: ModuleType, cpu_block: int, total: int) -> int:
    """Length of the blocks a kernel loops over.

    On numpy, a multi-pass kernel is far faster when each block's temporaries
    stay in the L2 cache; on cupy a single kernel launch over the whole array is
    best, so the loop runs once.

    Parameters
    ----------
    xp : module
        numpy or cupy.
    cpu_block : int
        Block length tuned for a CPU cache.
    total : int
        Length of the whole array.

    Returns
    -------
    int
        At least 1.
    """
    return max(1, cpu_block if xp is np else total)


def cached(xp: ModuleType, key: Hashable, build: Callable[[], np.ndarray]) -> Any:
    """A constant array built once per backend (and per GPU device) and reused.

    Parameters
    ----------
    xp : module
        numpy or cupy.
    key : hashable
        Names the constant (e.g. ``("sign_table", "float32")``).
    build : callable
        Returns the constant as a numpy array; copied to the device for cupy.

    Returns
    -------
    array
        The cached constant on ``xp``'s device.  Treat it as read-only.
    """
    device = None if xp is np else xp.cuda.Device().id
    full_key = (xp.__name__, device, key)
    if full_key not in _CONSTANTS:
        _CONSTANTS[full_key] = xp.asarray(build())
    return _CONSTANTS[full_key]


def take_rows(table: Any, indices: Any, out: Any) -> None:
    """``out[i] = table[indices[i]]`` for every i, without bounds checks.

    ``indices`` must be valid rows of ``table`` (the callers pass uint8 into a
    256-row table, which cannot be out of range).  numpy's default
    ``mode="raise"`` buffers the output and is about 4x slower than
    ``mode="clip"``; cupy's ``take`` has no ``mode`` and never checks.
    """
    if array_module(table) is np:
        np.take(table, indices, axis=0, out=out, mode="clip")
    else:
        table.take(indices, axis=0, out=out)


def check_array(name: str, value: Any, *, ndim: int, kinds: str, dtype: Any = None) -> ModuleType:
    """Validate an array argument and return its array module.

    Parameters
    ----------
    name : str
        The argument's name, used in the error message.
    value : object
        The argument.
    ndim : int
        Required number of dimensions.
    kinds : str
        Allowed dtype kinds (``"f"`` floating, ``"i"`` signed, ``"u"`` unsigned).
    dtype : dtype-like, optional
        Required exact dtype (checked instead of ``kinds`` when given).

    Returns
    -------
    module
        numpy or cupy.

    Raises
    ------
    TypeError
        Not a numpy/cupy array, or the wrong dtype.
    ValueError
        The wrong number of dimensions.
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
    """Validate an integer argument (``bool`` is rejected) and return it as ``int``.

    Raises
    ------
    TypeError
        Not an integer.
    ValueError
        Outside ``[minimum, maximum]``.
    """
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name} must be an int, got {type(value).__name__} {value!r}")
    value = int(value)
    if value < minimum or (maximum is not None and value > maximum):
        upper = "" if maximum is None else f" and <= {maximum}"
        raise ValueError(f"{name} must be >= {minimum}{upper}, got {value}")
    return value
