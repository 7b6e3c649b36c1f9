"""Algorithms by name: ``create("lsgd", topology, lr=0.1, ...)``."""

from __future__ import annotations

import importlib
from typing import Any, Dict, List, Type, TypeVar

from ..comm import Topology
from .base import Algorithm

__all__ = ["register", "create", "available"]

_REGISTRY: Dict[str, Type[Algorithm]] = {}
# Name -> module of mpiopt.algorithms that defines it; imported on first use
# so that one algorithm's optional needs never slow down or break another.
_MODULES: Dict[str, str] = {
    "sgd": "sgd",
    "easgd": "easgd",
    "lsgd": "lsgd",
    "dasgd": "dasgd",
    "signum": "signum",
    "topk": "topk",
    "regtopk": "topk",
    "async_msgd": "async_msgd",
    "async_lsgd": "async_lsgd",
}
A = TypeVar("A", bound=Type[Algorithm])


def register(cls: A) -> A:
    """Class decorator: make ``cls`` available to :func:`create` under ``cls.name``."""
    if not cls.name or cls.name in _REGISTRY:
        raise ValueError(f"algorithm name {cls.name!r} is empty or taken")
    _REGISTRY[cls.name] = cls
    return cls


def available() -> List[str]:
    """Names accepted by :func:`create` (those whose module is present)."""
    names = []
    for name in _MODULES:
        try:
            algorithm_class(name)
        except ValueError:
            continue
        names.append(name)
    return sorted(names)


def algorithm_class(name: str) -> Type[Algorithm]:
    """The class registered under ``name`` (importing its module on first use)."""
    if name not in _MODULES:
        raise ValueError(f"unknown algorithm {name!r}; available: {', '.join(available())}")
    if name not in _REGISTRY:
        module = f"{__package__}.{_MODULES[name]}"
        try:
            importlib.import_module(module)
        except ModuleNotFoundError as err:
            if err.name != module:
                raise
            raise ValueError(f"algorithm {name!r} is not part of this installation (no module {module})") from None
    return _REGISTRY[name]


def create(name: str, topology: Topology, **hyperparameters: Any) -> Algorithm:
    """Create the algorithm ``name`` on ``topology``.

    Parameters
    ----------
    name : str
        One of :func:`available`.
    topology : Topology
        Communicators to use.
    **hyperparameters
        Keyword arguments of the algorithm's class (papers' defaults apply).

    Raises
    ------
    ValueError
        For an unknown name (the message lists the known ones), or a bad
        hyperparameter value.
    TypeError
        For an unknown hyperparameter or one of the wrong type.
    """
    return algorithm_class(name)(topology, **hyperparameters)
