"""Distributed optimizers on flat parameter vectors, one module each (:func:`available` lists them by name).

Create one with :func:`create`.  What every algorithm declares, and which layer reads it: :mod:`.base` and
docs/new-algorithm.md.
"""

from .base import ASYNCHRONOUS, SYNCHRONOUS, Algorithm, AsynchronousAlgorithm, StepRecord, SynchronousAlgorithm
from .registry import algorithm_class, algorithms, available, create, register

__all__ = [
    "Algorithm", "SynchronousAlgorithm", "AsynchronousAlgorithm", "StepRecord", "SYNCHRONOUS", "ASYNCHRONOUS",
    "algorithm_class", "algorithms", "available", "create", "register",
]
