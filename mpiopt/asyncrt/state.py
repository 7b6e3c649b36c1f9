"""Checkpointing an asynchronous algorithm: the server's state beside the base class's, at a quiescent point.

Why a run's end is a checkpoint point: docs/internals-asyncrt.md, "State between runs".
"""

from __future__ import annotations

from typing import Any, Callable, Dict, Mapping, Optional, Tuple

import numpy as np

__all__ = ["ServerStateMixin", "state_array", "state_count"]


def _describe(value: Any) -> str:
    if isinstance(value, np.ndarray):
        return f"an array of shape {value.shape} and dtype {value.dtype}"
    return repr(value)


def state_array(state: Mapping[str, Any], key: str, shape: Tuple[Optional[int], ...], kinds: str) -> np.ndarray:
    """A copy of ``state[key]``: an array of ``shape`` (None: any length) whose dtype kind is in ``kinds`` ("i", "u", "f", "b")."""
    value = state.get(key)
    fits = (
        isinstance(value, np.ndarray)
        and value.ndim == len(shape)
        and all(want is None or want == got for want, got in zip(shape, value.shape))
        and value.dtype.kind in kinds
    )
    if not fits:
        wanted = "(" + ", ".join("any" if n is None else str(n) for n in shape) + ("," if len(shape) == 1 else "") + ")"
        raise ValueError(f"server state {key!r} must be an array of shape {wanted} (dtype kind in {kinds!r}), got {_describe(value)}")
    return value.copy()


def state_count(state: Mapping[str, Any], key: str) -> int:
    """``state[key]``, which must be an integer >= 0."""
    value = state.get(key)
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 0:
        raise ValueError(f"server state {key!r} must be an integer >= 0, got {_describe(value)}")
    return int(value)


class ServerStateMixin:
    """Adds the server's state to an ``Algorithm``'s ``state_dict`` under ``"server"``.

    The class provides :meth:`_server_state` (storable values) and :meth:`_server_loader` (checks a saved share,
    returns what restores it); a share that does not fit is refused before anything changes.
    """

    num_params: Optional[int]
    name: str

    def _server_state(self) -> Any:
        raise NotImplementedError

    def _server_loader(self, saved: Any) -> Callable[[], None]:
        raise NotImplementedError

    def state_dict(self) -> Dict[str, Any]:
        state = super().state_dict()  # type: ignore[misc]
        state["server"] = self._server_state()
        return state

    def load_state_dict(self, state: Mapping[str, Any], *, override_hyperparameters: bool = False) -> None:
        restore = None
        if self.num_params is not None and state.get("algorithm") == self.name:  # else the base class says what is wrong
            if "server" not in state:
                raise ValueError(f"state for {self.name!r} lacks ['server'] (the server's state)")
            restore = self._server_loader(state["server"])
        super().load_state_dict(state, override_hyperparameters=override_hyperparameters)  # type: ignore[misc]
        restore()
