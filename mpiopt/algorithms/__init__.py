"""Distributed optimizers on flat parameter vectors, one module each.

====================  =========================================================
name                  algorithm
====================  =========================================================
``sgd``               data-parallel SGD with Allreduce (the baseline)
``easgd``             elastic averaging SGD and EAMSGD (centre held on every rank)
``lsgd``              leader SGD: local leaders in node groups, a global leader
``dasgd``             local SGD with delayed averaging (overlapped Iallreduce)
``diloco``            DiLoCo: H inner steps, then an outer Nesterov step on the mean pseudo-gradient
``streaming_diloco``  DiLoCo's outer step fragment by fragment, each exchange overlapped
``signum``            signSGD / Signum with packed-bit majority vote (Allgather or two-phase)
``topk``              Top-k sparsification with error feedback (Allgather of fixed-size payloads)
``regtopk``           RegTop-k: Top-k whose selection is regularised by the previous aggregate
``async_msgd``        asynchronous momentum SGD on a parameter server (:mod:`mpiopt.asyncrt`)
``async_lsgd``        asynchronous multi-leader LSGD: pulls triggered by the total step count
====================  =========================================================

Create one with :func:`create`; see :class:`~mpiopt.algorithms.base.Algorithm`
for what every algorithm declares and the two protocols (``step`` or ``run``).
An algorithm is one module: everything the rest of the package asks about it
(protocol, evaluated model, resize rules, training defaults, communication
plan) is an attribute of its class.
"""

from .base import ASYNCHRONOUS, SYNCHRONOUS, Algorithm, AsynchronousAlgorithm, StepRecord, SynchronousAlgorithm
from .registry import algorithm_class, algorithms, available, create, register

__all__ = [
    "Algorithm", "SynchronousAlgorithm", "AsynchronousAlgorithm", "StepRecord", "SYNCHRONOUS", "ASYNCHRONOUS",
    "algorithm_class", "algorithms", "available", "create", "register",
]
