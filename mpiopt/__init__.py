"""mpiopt: communication-efficient distributed training on MPI clusters.

>>> alg = mpiopt.create("sgd", mpiopt.Topology(), lr=0.1)
>>> alg.setup(params); alg.step(params, grad, loss=loss)      # params, grad: flat float arrays
"""

from ._version import __version__
from .algorithms import Algorithm, StepRecord, available, create
from .comm import Comm, Ledger, SetupMismatchError, Topology, abort_on_exception

__all__ = [
    "Algorithm",
    "StepRecord",
    "available",
    "create",
    "Comm",
    "Ledger",
    "SetupMismatchError",
    "Topology",
    "abort_on_exception",
    "__version__",
]
