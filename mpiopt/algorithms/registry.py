"""Algorithms by name: ``create("lsgd", topology, lr=0.1, ...)``."""

from __future__ import annotations

import importlib
import inspect
import os
import pkgutil
from typing import Any, Dict, List, Optional, Type, TypeVar

from ..comm import Topology
from .base import EVALUATED_MODELS, Algorithm

__all__ = ["register", "create", "available", "algorithm_class", "algorithms", "PLUGINS_ENV"]

#: Comma-separated modules (importable names) that define and register more algorithms, imported with mpiopt's own.
PLUGINS_ENV = "MPIOPT_ALGORITHMS"

_REGISTRY: Dict[str, Type[Algorithm]] = {}
_discovered = False
A = TypeVar("A", bound=Type[Algorithm])


def register(cls: A) -> A:
    """Class decorator: make ``cls`` available to :func:`create` under ``cls.name``.

    Works for algorithms defined outside :mod:`mpiopt.algorithms` too: once
    their module is imported (by the caller, or through ``$MPIOPT_ALGORITHMS``
    for the command line), ``create``, ``mpiopt train --algorithm NAME`` and
    the benchmarks find them like the built-in ones.
    """
    if not cls.name or cls.name in _REGISTRY:
        raise ValueError(f"algorithm name {cls.name!r} is empty or taken")
    if not cls.protocol:
        raise TypeError(f"{cls.__name__} must derive from SynchronousAlgorithm or AsynchronousAlgorithm")
    _check_schema(cls)
    if cls.evaluates not in EVALUATED_MODELS:
        raise ValueError(f"{cls.__name__}.evaluates must be one of {', '.join(EVALUATED_MODELS)}, got {cls.evaluates!r}")
    _REGISTRY[cls.name] = cls
    return cls


def _check_schema(cls: Type[Algorithm]) -> None:
    """A class that still writes its keywords in a signature (the base class takes them from the schema) matches its schema."""
    parameters = inspect.signature(cls.__init__).parameters
    keywords = {k: p.default for k, p in parameters.items() if p.kind is p.KEYWORD_ONLY}
    passes_on = any(p.kind is p.VAR_KEYWORD for p in parameters.values())
    declared = cls.schema.defaults()
    missing = sorted(set(keywords) - set(declared))
    extra = [] if passes_on else sorted(set(declared) - set(keywords))
    differ = sorted(k for k in set(keywords) & set(declared) if keywords[k] != declared[k])
    if missing or extra or differ:
        raise TypeError(
            f"{cls.__name__}.schema does not match its constructor: undeclared {missing}, not taken {extra}, "
            f"other defaults {differ}"
        )


def _discover() -> None:
    """Import this package's modules, and those of ``$MPIOPT_ALGORITHMS``, once: each algorithm module registers its classes."""
    global _discovered
    if _discovered:
        return
    modules = [f"{__package__}.{m.name}" for m in pkgutil.iter_modules(importlib.import_module(__package__).__path__)]
    modules += [name.strip() for name in os.environ.get(PLUGINS_ENV, "").split(",") if name.strip()]
    for module in modules:
        try:
            importlib.import_module(module)
        except ImportError as err:
            raise ImportError(f"cannot import algorithm module {module!r} (from ${PLUGINS_ENV} or mpiopt.algorithms): {err}") from err
    _discovered = True


def available(protocol: Optional[str] = None) -> List[str]:
    """Names accepted by :func:`create` (of one ``protocol`` only, if given), in their classes' ``listing_order``."""
    return [cls.name for cls in algorithms() if protocol is None or cls.protocol == protocol]


def algorithms() -> List[Type[Algorithm]]:
    """Every registered algorithm class, in the order of :func:`available`."""
    _discover()
    return sorted(_REGISTRY.values(), key=lambda cls: (cls.listing_order, cls.name))


def algorithm_class(name: str) -> Type[Algorithm]:
    """The class registered under ``name``."""
    if name not in _REGISTRY:
        _discover()
    if name not in _REGISTRY:
        raise ValueError(f"unknown algorithm {name!r}; available: {', '.join(available())}")
    return _REGISTRY[name]


def create(name: str, topology: Topology, *, islands: bool = False, **hyperparameters: Any) -> Algorithm:
    """Create the algorithm ``name`` (one of :func:`available`) on ``topology`` with its keyword ``hyperparameters``.

    ``islands=True``: each group of the topology (a node) is one worker (docs/islands.md).

    ValueError for an unknown name (listing the known ones) or a bad value;
    TypeError for an unknown keyword (naming the close match and what it takes).
    """
    cls = algorithm_class(name)
    # Before the constructor, whose own error would name only its __init__ (not the algorithm or what it takes);
    # here every entry point (create, DistributedOptimizer, the training loop) gets the schema's message.
    cls.schema.check_names(hyperparameters, what=name)
    return cls(topology, **hyperparameters, **({} if islands is False else {"islands": islands}))
