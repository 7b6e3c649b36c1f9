"""Array-module dispatch: the same code runs on numpy (CPU) and cupy (GPU)."""

from __future__ import annotations

from types import ModuleType
from typing import Any

import numpy as np

__all__ = ["array_module", "to_numpy"]


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
