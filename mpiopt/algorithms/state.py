"""``state_dict``/``load_state_dict`` from the declared state names, and how a saved state differs from this instance."""

from __future__ import annotations

from typing import Any, ClassVar, Dict, List, Mapping, Optional, Tuple

import numpy as np

from ..arrays import array_module, empty_apart, to_numpy
from ..comm.communicator import differing_lines, plain
from .schema import Schema

__all__ = ["StateDict", "hyperparameter_lines", "describe_layout"]

#: The entries every state_dict has.
STATE_KEYS = frozenset({"algorithm", "world_size", "steps", "lr", "hyperparameters", "arrays", "scalars"})


def describe_layout(layout: Mapping[str, Any]) -> str:
    """A state's :meth:`~mpiopt.algorithms.islands.IslandWorkers.worker_layout` in words: "worker 1 of 2 islands of 2 ranks"."""
    size, count = int(layout["ranks_per_worker"]), int(layout["workers"])
    kind = (f"island{'s' * (count != 1)} of {size} ranks") if size > 1 else f"rank{'s' * (count != 1)}"
    return f"worker {layout['worker']} of {count} {kind}"


def hyperparameter_lines(saved: Mapping[str, Any], here: Mapping[str, Any], *, skip: Any = ()) -> List[str]:
    """``"key: saved X, here Y"`` for each key (but ``skip``) whose values differ as plain data; tables entry by entry."""
    return differing_lines([plain(dict(saved)), plain(dict(here))], ["saved", "here"], skip=skip)


class StateDict:
    """Mixin of :class:`~mpiopt.algorithms.base.Algorithm`: its state as arrays and scalars, and back."""

    name: ClassVar[str]
    schema: ClassVar[Schema]
    state_arrays: ClassVar[Tuple[str, ...]]
    state_scalars: ClassVar[Tuple[str, ...]]
    topology: Any
    steps: int
    lr: float
    num_params: Optional[int]
    _xp: Any

    def state_dict(self) -> Dict[str, Any]:
        """Arrays and scalars only (host numpy copies), never a communicator.

        Besides the state (``steps``, ``lr``, ``arrays``, ``scalars``) it records what
        :meth:`load_state_dict` checks: ``algorithm``, ``world_size`` and ``hyperparameters``.
        """
        arrays = {}
        for key in self.state_arrays:
            value = getattr(self, key)
            arrays[key] = None if value is None else to_numpy(value).copy()
        return {
            "algorithm": self.name,
            "world_size": self.topology.size,
            "steps": self.steps,
            "lr": self.lr,
            "hyperparameters": self.hyperparameters(),
            "arrays": arrays,
            "scalars": {key: getattr(self, key) for key in self.state_scalars},
            "worker_layout": self.worker_layout(),  # the workers the state is kept per (islands: one state per island, on each of its ranks)
        }

    def load_state_dict(self, state: Mapping[str, Any], *, override_hyperparameters: bool = False) -> None:
        """Restore what :meth:`state_dict` returned (after :meth:`setup`; this rank alone, no communication).

        ``steps`` and ``lr`` are restored with the arrays and scalars.  With
        ``override_hyperparameters`` a state saved with other hyperparameters
        loads and this instance's stay in force.  ValueError, naming every
        difference with the saved value and this instance's, for a state of
        another algorithm, world size, hyperparameters or array shapes, or one
        lacking an entry; nothing is changed then.
        """
        if self.num_params is None:
            raise RuntimeError(f"{type(self).__name__}.setup(params) must be called before load_state_dict()")
        if state.get("algorithm") != self.name:
            raise ValueError(f"state is for algorithm {state.get('algorithm')!r}, not {self.name!r}")
        missing = sorted(STATE_KEYS - set(state))
        if not missing:
            missing = sorted((set(self.state_arrays) - set(state["arrays"])) | (set(self.state_scalars) - set(state["scalars"])))
        if missing:
            raise ValueError(f"state for {self.name!r} lacks {missing}")
        differences = self._state_differences(state, override_hyperparameters)
        if differences:
            hint = "" if override_hyperparameters else " (override_hyperparameters=True keeps this instance's hyperparameters)"
            raise ValueError(
                f"state does not fit this {self.name}{hint}; saved vs here:\n" + "\n".join(f"  {line}" for line in differences)
            )
        for key in self.state_arrays:
            self._load_array(key, state["arrays"][key])
        for key in self.state_scalars:
            setattr(self, key, state["scalars"][key])
        self.steps = int(state["steps"])
        self.lr = float(state["lr"])

    def _state_differences(self, state: Mapping[str, Any], override_hyperparameters: bool) -> List[str]:
        """``"key: saved X, here Y"`` for each world size, hyperparameter and array shape that differs."""
        lines = []
        if plain(state["world_size"]) != self.topology.size:
            lines.append(f"world_size: saved {state['world_size']!r}, here {self.topology.size!r}")
        saved, here = plain(dict(state.get("worker_layout") or self.worker_layout())), self.worker_layout()  # states from before islands: this one
        if any(saved[key] != here[key] for key in ("workers", "ranks_per_worker")):
            lines.append(f"workers: saved {describe_layout(saved)}, here {describe_layout(here)} "
                         "(a checkpoint's resume moves states between workers: mpiopt train --resume)")
        if not override_hyperparameters:
            # Execution knobs never refuse a resume (states saved before they were told apart carry them).
            lines += [f"hyperparameter {line}" for line in hyperparameter_lines(state["hyperparameters"], self.hyperparameters(), skip=self.schema.knobs())]
        for key in self.state_arrays:
            value, current = state["arrays"][key], getattr(self, key)
            if value is not None and current is not None and tuple(np.shape(value)) != tuple(current.shape):
                lines.append(f"array {key} shape: saved {tuple(np.shape(value))}, here {tuple(current.shape)}")
        return lines

    def _load_array(self, key: str, value: Optional[np.ndarray]) -> None:
        current = getattr(self, key)
        if value is None or current is None:
            # Arrays that appear lazily (a momentum buffer) take the parameters' backend and a placement of their own.
            placed = None
            if value is not None:
                source = self._xp.asarray(value)
                placed = empty_apart(source)
                placed[...] = source
            setattr(self, key, placed)
            return
        current[...] = array_module(current).asarray(value)
