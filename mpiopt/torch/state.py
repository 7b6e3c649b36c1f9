"""The algorithm's state in a ``DistributedOptimizer.state_dict()``: tensors and plain values, as ``torch.load`` reads them.

:meth:`Algorithm.state_dict <mpiopt.algorithms.base.Algorithm.state_dict>`
holds numpy arrays (the HDF5 checkpoints store them as they are).
``torch.load``'s default, ``weights_only=True`` since torch 2.6, refuses
numpy objects, so ``torch.save(opt.state_dict(), f); torch.load(f)`` needs
the arrays as tensors: :func:`as_tensors` makes them so,
:func:`as_arrays` turns them back for the algorithm's ``load_state_dict``.
"""

from __future__ import annotations

from typing import Any, Callable, Mapping

import numpy as np
import torch

__all__ = ["as_tensors", "as_arrays"]


def _map_leaves(value: Any, leaf: Callable[[Any], Any]) -> Any:
    """``value`` with ``leaf`` applied to everything that is not a mapping, list or tuple (those are walked)."""
    if isinstance(value, Mapping):
        return {key: _map_leaves(item, leaf) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_map_leaves(item, leaf) for item in value)
    return leaf(value)


def _tensor(value: Any) -> Any:
    if isinstance(value, np.ndarray):
        return torch.from_numpy(value)
    if isinstance(value, np.generic):
        return value.item()
    return value


def _array(value: Any) -> Any:
    return value.detach().cpu().numpy() if isinstance(value, torch.Tensor) else value


def as_tensors(state: Any) -> Any:
    """An algorithm's ``state_dict`` with its numpy arrays as CPU tensors and its numpy scalars as Python numbers.

    Each tensor shares its array's memory: the algorithm's ``state_dict``
    hands out host copies (also of GPU state), never its live buffers, so
    the result keeps its values when training continues.
    """
    return _map_leaves(state, _tensor)


def as_arrays(state: Any) -> Any:
    """:func:`as_tensors`'s result (its tensors on any device) with host numpy arrays again.

    A state whose arrays are numpy arrays already (one saved before they
    were tensors) comes back as it is.
    """
    return _map_leaves(state, _array)
