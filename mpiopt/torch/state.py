"""``DistributedOptimizer.state_dict()``: torch.optim's shape, the algorithm's state in tensors and plain values, as ``torch.load`` reads them.

:meth:`Algorithm.state_dict <mpiopt.algorithms.base.Algorithm.state_dict>`
holds numpy arrays (the HDF5 checkpoints store them as they are).
``torch.load``'s default, ``weights_only=True`` since torch 2.6, refuses
numpy objects, so ``torch.save(opt.state_dict(), f); torch.load(f)`` needs
the arrays as tensors: :func:`as_tensors` makes them so,
:func:`as_arrays` turns them back for the algorithm's ``load_state_dict``.
"""

from __future__ import annotations

from typing import Any, Callable, Dict, Mapping

import numpy as np
import torch

__all__ = ["as_tensors", "as_arrays", "on_host", "optimizer_state", "load_optimizer_state"]


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


def on_host(state: Any) -> Any:
    """``state`` with its tensors on the CPU: another process may not have their device (``load_state_dict`` moves
    each to its parameter's)."""
    return _map_leaves(state, lambda value: value.detach().cpu() if torch.is_tensor(value) else value)


def optimizer_state(opt: Any) -> Dict[str, Any]:
    """A ``DistributedOptimizer``'s ``state_dict()``: torch.optim's shape plus the algorithm's state under ``"mpiopt"``."""
    groups, index = [], 0
    for group in opt.param_groups:
        saved = {k: v for k, v in group.items() if k != "params"}
        saved["params"] = list(range(index, index + len(group["params"])))
        index += len(group["params"])
        groups.append(saved)
    return {
        "state": {} if opt.inner is None else opt.inner.state_dict()["state"],
        "param_groups": groups,
        "mpiopt": {"algorithm": as_tensors(opt.algorithm.state_dict()), "backward_passes_per_step": opt.backward_passes_per_step},
    }


def load_optimizer_state(opt: Any, state_dict: Mapping[str, Any], override_hyperparameters: bool) -> None:
    """Restore :func:`optimizer_state`'s result, its tensors on any device (or numpy arrays, its earlier form).

    Other hyperparameters only with ``override_hyperparameters`` (see ``Algorithm.load_state_dict``).
    """
    if "mpiopt" not in state_dict:
        raise ValueError("not a DistributedOptimizer state (no 'mpiopt' entry): was it saved by another optimizer?")
    groups = state_dict["param_groups"]
    if [len(g["params"]) for g in groups] != [len(g["params"]) for g in opt.param_groups]:
        raise ValueError(
            f"the state has parameter groups of sizes {[len(g['params']) for g in groups]}, "
            f"this optimizer {[len(g['params']) for g in opt.param_groups]}"
        )
    saved = state_dict["mpiopt"]
    if saved["backward_passes_per_step"] != opt.backward_passes_per_step:
        raise ValueError(
            f"backward_passes_per_step is {opt.backward_passes_per_step}, the state has {saved['backward_passes_per_step']}"
        )
    opt.algorithm.load_state_dict(as_arrays(saved["algorithm"]), override_hyperparameters=override_hyperparameters)
    if opt.inner is not None:  # its state and groups, in torch.optim's own format
        opt.inner.load_state_dict({"state": state_dict["state"], "param_groups": groups})
        return
    for group, stored in zip(opt.param_groups, groups):
        group.update({k: v for k, v in stored.items() if k != "params"})
